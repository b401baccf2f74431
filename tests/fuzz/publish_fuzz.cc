// Fuzz target `publish`: the Publish message stream as a trainer sends it. The input is a
// sequence of length-delimited wpub.v1.PublishRequest messages (protobuf's delimited format:
// a varint size, then the message; tests/fuzz/make_seeds.py writes valid publications), handled
// exactly as the Publish RPC handles them: wire conversion (wire/), then Engine::Open,
// AddBatch, AppendInline and Commit on a fresh in-process engine with the CPU backend and no
// receivers. Properties: nothing crashes; a COMMITTED report means the engine's committed
// version is the published one; afterwards the engine still publishes a small valid version.
//
// Shared-memory parts with a valid segment name are pointed at the target's own segment (64 KiB
// of finite values), so the fuzzer never maps other processes' memory.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/engine/engine.h"
#include "core/engine/inputs.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/delimited_message_util.h"
#include "tests/fuzz/fuzz_check.h"
#include "wire/convert.h"
#include "wpub/v1/publisher.pb.h"

namespace {

namespace pb = ::wpub::v1;
using wpub::engine::Engine;
using wpub::engine::PublicationSession;

constexpr size_t kSegmentBytes = 64 << 10;
constexpr uint64_t kMaxInlineBytes = 1 << 20;  // declared sizes beyond it are OUT_OF_RANGE
constexpr size_t kMaxChunkBytes = 64 << 10;    // the service's --max_chunk_bytes
constexpr int kMaxMessages = 512;

// The shared-memory segment every valid shm name is redirected to; unlinked at exit.
const std::string& SegmentName() {
  static const std::string name = [] {
    std::string n = absl::StrCat("/wpub-fuzz-publish-", getpid());
    shm_unlink(n.c_str());
    const int fd = shm_open(n.c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
    FUZZ_CHECK(fd >= 0 && ftruncate(fd, kSegmentBytes) == 0, "cannot create " + n);
    void* p = mmap(nullptr, kSegmentBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    FUZZ_CHECK(p != MAP_FAILED, "cannot map " + n);
    // 0x3c in every byte is a finite value in every float dtype (bf16, fp16, fp32, fp8).
    std::memset(p, 0x3c, kSegmentBytes);
    munmap(p, kSegmentBytes);
    ::close(fd);
    std::atexit([] { shm_unlink(SegmentName().c_str()); });
    return n;
  }();
  return name;
}

void RedirectShm(pb::Batch& batch) {
  for (pb::TensorDescriptor& t : *batch.mutable_tensors()) {
    for (pb::TensorPart& part : *t.mutable_parts()) {
      if (part.has_shm() && wpub::engine::ValidateShmName(part.shm().name(), t.name()).ok()) {
        part.mutable_shm()->set_name(SegmentName());
      }
    }
  }
}

std::unique_ptr<Engine> NewEngine() {
  wpub::engine::EngineOptions options;
  options.max_inline_bytes = kMaxInlineBytes;
  options.ack_deadline = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(options, nullptr);
  FUZZ_CHECK(engine.ok(), engine.status().ToString());
  return *std::move(engine);
}

// The rest of one publication after its header, as PublisherService::Publish handles it.
// Returns the report when the stream reached `commit`.
absl::StatusOr<wpub::engine::PublicationReport> Drive(
    PublicationSession& session, google::protobuf::io::ZeroCopyInputStream& in) {
  pb::PublishRequest request;
  for (int messages = 1; messages < kMaxMessages; ++messages) {
    bool clean_eof = false;
    request.Clear();  // the delimited parser merges into the message
    if (!google::protobuf::util::ParseDelimitedFromZeroCopyStream(&request, &in, &clean_eof)) {
      return absl::InvalidArgumentError("the stream ended without 'commit'");
    }
    absl::Status s;
    switch (request.kind_case()) {
      case pb::PublishRequest::kBatch: {
        RedirectShm(*request.mutable_batch());
        absl::StatusOr<wpub::engine::BatchInput> batch = wpub::wire::FromProto(request.batch());
        s = batch.ok() ? session.AddBatch(*std::move(batch)) : batch.status();
        break;
      }
      case pb::PublishRequest::kChunk: {
        const pb::Chunk& c = request.chunk();
        if (c.data().size() > kMaxChunkBytes) {
          s = absl::ResourceExhaustedError("chunk too large");
          break;
        }
        s = session.AppendInline(
            c.batch_index(), c.tensor_index(), c.part_index(), c.offset(),
            absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(c.data().data()),
                                c.data().size()));
        break;
      }
      case pb::PublishRequest::kExpected: {
        const auto& names = request.expected().names();
        s = session.DeclareExpected(std::vector<std::string>(names.begin(), names.end()));
        break;
      }
      case pb::PublishRequest::kCommit:
        return session.Commit();
      case pb::PublishRequest::kHeader:
      case pb::PublishRequest::KIND_NOT_SET:
        s = absl::InvalidArgumentError("unexpected message");
        break;
    }
    if (!s.ok()) {
      session.Fail(s);
      return s;
    }
  }
  return absl::InvalidArgumentError("too many messages");
}

// A small valid publication must still commit after whatever the input did.
void CheckStillServing(Engine& engine) {
  const uint64_t committed = engine.GetStatus().committed_version;
  if (committed == std::numeric_limits<uint64_t>::max()) return;  // nothing can follow it
  wpub::engine::PublicationHeader header;
  header.version = committed + 1;
  header.recipe = "bf16";
  absl::StatusOr<std::unique_ptr<PublicationSession>> session = engine.Open(header);
  FUZZ_CHECK(session.ok(), session.status().ToString());
  wpub::engine::BatchInput batch;
  batch.megatron_name = "decoder.final_layernorm.weight";
  wpub::engine::TensorInput t;
  t.desc = {"model.norm.weight", wpub::DType::kBFloat16, {8}};
  t.parts.push_back({wpub::engine::InlineSource{}, {8}});
  batch.tensors.push_back(std::move(t));
  absl::Status s = (*session)->AddBatch(std::move(batch));
  FUZZ_CHECK(s.ok(), s.ToString());
  const uint8_t bytes[16] = {0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f,
                             0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f};
  s = (*session)->AppendInline(0, 0, 0, 0, bytes);
  FUZZ_CHECK(s.ok(), s.ToString());
  absl::StatusOr<wpub::engine::PublicationReport> report = (*session)->Commit();
  FUZZ_CHECK(report.ok() && report->status == wpub::engine::PublicationStatus::kCommitted,
             report.ok() ? report->error : report.status().ToString());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Invalid UTF-8 in string fields is a parse failure the target expects; protobuf would log
  // every one of them.
  static const bool quiet = (google::protobuf::SetLogHandler(nullptr), true);
  (void)quiet;
  google::protobuf::io::ArrayInputStream in(data, static_cast<int>(size));
  pb::PublishRequest first;
  bool clean_eof = false;
  if (!google::protobuf::util::ParseDelimitedFromZeroCopyStream(&first, &in, &clean_eof) ||
      first.kind_case() != pb::PublishRequest::kHeader) {
    return 0;  // the service refuses such a stream before it reaches the engine
  }
  absl::StatusOr<wpub::engine::PublicationHeader> header = wpub::wire::FromProto(first.header());
  if (!header.ok()) return 0;
  std::unique_ptr<Engine> engine = NewEngine();
  {
    absl::StatusOr<std::unique_ptr<PublicationSession>> session = engine->Open(*header);
    if (session.ok()) {
      absl::StatusOr<wpub::engine::PublicationReport> report = Drive(**session, in);
      if (report.ok()) {
        pb::PublicationReport wire;
        wpub::wire::ToProto(*report, &wire);
        if (report->status == wpub::engine::PublicationStatus::kCommitted) {
          FUZZ_CHECK(engine->GetStatus().committed_version == header->version,
                     absl::StrCat("committed v", header->version, " but the engine holds v",
                                  engine->GetStatus().committed_version));
        }
      }
    }
  }
  pb::GetStatusResponse status;
  wpub::wire::ToProto(engine->GetStatus(), &status);
  CheckStillServing(*engine);
  return 0;
}
