// Streaming one publication to wpubd.
#include "server/client/publisher_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/common/status.h"
#include "wire/status_map.h"

namespace wpub::client {
namespace {

namespace pb = ::wpub::v1;

// Shared-memory segments created for one publication; unlinked when it ends (the daemon maps
// them while the publication is open and no longer needs the names afterwards).
class ShmSegments {
 public:
  ~ShmSegments() {
    for (const std::string& name : names_) shm_unlink(name.c_str());
  }
  // Creates segment `name` of `size` bytes and maps it writable into *data.
  absl::Status Create(const std::string& name, size_t size, uint8_t** data, size_t* mapped) {
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      return absl::InternalError(absl::StrCat("shm_open('", name, "'): ", std::strerror(errno)));
    }
    names_.push_back(name);
    const size_t bytes = size == 0 ? 1 : size;
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      return absl::InternalError(absl::StrCat("ftruncate('", name, "'): ", std::strerror(errno)));
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
      return absl::InternalError(absl::StrCat("mmap('", name, "'): ", std::strerror(errno)));
    }
    *data = static_cast<uint8_t*>(p);
    *mapped = bytes;
    return absl::OkStatus();
  }

 private:
  std::vector<std::string> names_;
};

void SetShape(const Shape& shape, google::protobuf::RepeatedField<int64_t>* out) {
  for (int64_t d : shape) out->Add(d);
}

Shape PartShape(const Shape& shape, int dim, int parts) {
  Shape s = shape;
  if (parts > 1) s[dim] /= parts;
  return s;
}

}  // namespace

TensorFiller SyntheticFiller(uint64_t seed) {
  return [seed](const TensorDesc& desc, absl::Span<uint8_t> out) {
    return synthetic::FillTensor(desc, seed, out);
  };
}

int PartsFor(const TensorDesc& desc, const StreamOptions& options) {
  if (options.parts <= 1) return 1;
  const int dim = options.concat_dim;
  if (static_cast<int>(desc.shape.size()) <= dim) return 1;
  if (desc.shape[dim] % options.parts != 0 || desc.shape[dim] < options.parts) return 1;
  return options.parts;
}

void CopyPart(const TensorDesc& desc, absl::Span<const uint8_t> full, int dim, int parts, int p,
              std::vector<uint8_t>* out) {
  if (parts <= 1) {
    out->assign(full.begin(), full.end());
    return;
  }
  int64_t outer = 1;
  for (int i = 0; i < dim; ++i) outer *= desc.shape[i];
  int64_t inner = DTypeSize(desc.dtype);
  for (size_t i = dim + 1; i < desc.shape.size(); ++i) inner *= desc.shape[i];
  const int64_t len = desc.shape[dim] / parts;
  const int64_t row = desc.shape[dim] * inner;  // bytes of one outer index
  out->resize(static_cast<size_t>(outer * len * inner));
  for (int64_t o = 0; o < outer; ++o) {
    std::memcpy(out->data() + o * len * inner, full.data() + o * row + p * len * inner,
                static_cast<size_t>(len * inner));
  }
}

PublisherClient::PublisherClient(const ClientOptions& options,
                                 std::shared_ptr<grpc::ChannelCredentials> credentials)
    : options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(options_.max_message_bytes);
  args.SetMaxReceiveMessageSize(64 << 20);
  channel_ = grpc::CreateCustomChannel(options_.target, std::move(credentials), args);
  stub_ = pb::Publisher::NewStub(channel_);
}

absl::StatusOr<std::unique_ptr<PublisherClient>> PublisherClient::Create(
    const ClientOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      wire::ChannelCredentialsFor(options.tls);
  if (!credentials.ok()) return credentials.status();
  std::unique_ptr<PublisherClient> client(new PublisherClient(options, *std::move(credentials)));
  const auto deadline = absl::ToChronoTime(absl::Now() + options.connect_timeout);
  for (;;) {
    const grpc_connectivity_state s = client->channel_->GetState(/*try_to_connect=*/true);
    if (s == GRPC_CHANNEL_READY) return client;
    if (s == GRPC_CHANNEL_TRANSIENT_FAILURE && options.fail_fast) {
      return absl::UnavailableError(absl::StrCat(
          "cannot connect to wpubd at '", options.target,
          "': the connection failed (is wpubd running and listening there? the address comes "
          "from --target or WPUB_TARGET)"));
    }
    if (!client->channel_->WaitForStateChange(s, deadline)) {
      return absl::UnavailableError(absl::StrCat("cannot connect to wpubd at '", options.target,
                                                 "' within ",
                                                 absl::FormatDuration(options.connect_timeout)));
    }
  }
}

void PublisherClient::Authorize(grpc::ClientContext* context) const {
  if (!options_.auth_token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", options_.auth_token));
  }
}

void PublisherClient::Cancel() {
  absl::MutexLock lock(&mu_);
  if (active_ != nullptr) active_->TryCancel();
}

absl::StatusOr<pb::PublicationReport> PublisherClient::Publish(
    const pb::PublicationHeader& header, absl::Span<const synthetic::ConversionBatch> batches,
    const TensorFiller& fill, const StreamOptions& options, PublishTimings* timings) {
  if (options.chunk_bytes == 0) return absl::InvalidArgumentError("chunk_bytes must be > 0");
  if (options.concat_dim != 0 && options.concat_dim != 1) {
    return absl::InvalidArgumentError("concat_dim must be 0 or 1");
  }
  PublishTimings local;
  PublishTimings& t = timings != nullptr ? *timings : local;
  t = PublishTimings{};
  ShmSegments segments;  // outlives the RPC: unlinked after the report
  grpc::ClientContext context;
  Authorize(&context);
  {
    absl::MutexLock lock(&mu_);
    active_ = &context;
  }
  struct ClearActive {
    PublisherClient* self;
    ~ClearActive() {
      absl::MutexLock lock(&self->mu_);
      self->active_ = nullptr;
    }
  } clear_active{this};

  const absl::Time start = absl::Now();
  pb::PublicationReport report;
  std::unique_ptr<grpc::ClientWriter<pb::PublishRequest>> writer =
      stub_->Publish(&context, &report);
  pb::PublishRequest request;
  *request.mutable_header() = header;
  bool stream_ok = writer->Write(request);
  ++t.messages;
  std::vector<uint8_t> full;
  std::vector<uint8_t> part;
  for (size_t b = 0; b < batches.size() && stream_ok; ++b) {
    const synthetic::ConversionBatch& batch = batches[b];
    // Parts of the batch, gathered first (shm needs the total size before the segment).
    std::vector<std::vector<std::vector<uint8_t>>> payload(batch.tensors.size());
    uint64_t batch_bytes = 0;
    for (size_t i = 0; i < batch.tensors.size(); ++i) {
      const TensorDesc& desc = batch.tensors[i];
      full.assign(static_cast<size_t>(desc.nbytes()), 0);
      WPUB_RETURN_IF_ERROR(fill(desc, absl::MakeSpan(full)));
      const int parts = PartsFor(desc, options);
      batch_bytes += full.size();
      if (parts == 1) {
        payload[i].push_back(std::move(full));
        full = {};
        continue;
      }
      for (int p = 0; p < parts; ++p) {
        CopyPart(desc, full, options.concat_dim, parts, p, &part);
        payload[i].push_back(std::move(part));
        part = {};
      }
    }
    uint8_t* shm_data = nullptr;
    size_t shm_mapped = 0;
    std::string shm_name;
    if (options.source == PayloadSource::kShm) {
      shm_name =
          absl::StrCat("/", options.shm_prefix, "-", getpid(), "-v", header.version(), "-b", b);
      WPUB_RETURN_IF_ERROR(segments.Create(shm_name, batch_bytes, &shm_data, &shm_mapped));
    }
    request.Clear();
    pb::Batch* msg = request.mutable_batch();
    msg->set_megatron_name(batch.megatron_name);
    uint64_t shm_offset = 0;
    for (size_t i = 0; i < batch.tensors.size(); ++i) {
      const TensorDesc& desc = batch.tensors[i];
      const int parts = static_cast<int>(payload[i].size());
      pb::TensorDescriptor* td = msg->add_tensors();
      td->set_name(desc.name);
      td->set_dtype(std::string(DTypeName(desc.dtype)));
      SetShape(desc.shape, td->mutable_shape());
      td->set_concat_dim(parts > 1 ? options.concat_dim : 0);
      for (int p = 0; p < parts; ++p) {
        pb::TensorPart* tp = td->add_parts();
        SetShape(PartShape(desc.shape, options.concat_dim, parts), tp->mutable_shape());
        if (options.source == PayloadSource::kShm) {
          const std::vector<uint8_t>& bytes = payload[i][p];
          if (!bytes.empty()) std::memcpy(shm_data + shm_offset, bytes.data(), bytes.size());
          tp->mutable_shm()->set_name(shm_name);
          tp->mutable_shm()->set_offset(shm_offset);
          tp->mutable_shm()->set_length(bytes.size());
          shm_offset += bytes.size();
        } else {
          tp->mutable_inline_();
        }
      }
    }
    if (shm_data != nullptr) munmap(shm_data, shm_mapped);
    stream_ok = writer->Write(request);
    ++t.messages;
    if (options.source == PayloadSource::kInline) {
      for (size_t i = 0; i < payload.size() && stream_ok; ++i) {
        for (size_t p = 0; p < payload[i].size() && stream_ok; ++p) {
          const std::vector<uint8_t>& bytes = payload[i][p];
          for (uint64_t off = 0; off < bytes.size() && stream_ok; off += options.chunk_bytes) {
            const uint64_t n = std::min<uint64_t>(options.chunk_bytes, bytes.size() - off);
            request.Clear();
            pb::Chunk* c = request.mutable_chunk();
            c->set_batch_index(b);
            c->set_tensor_index(static_cast<uint32_t>(i));
            c->set_part_index(static_cast<uint32_t>(p));
            c->set_offset(off);
            c->set_data(reinterpret_cast<const char*>(bytes.data() + off), n);
            stream_ok = writer->Write(request);
            ++t.messages;
          }
        }
      }
    }
    t.payload_bytes += batch_bytes;
    if (options.on_batch_sent) options.on_batch_sent(b);
    if (options.cancel_after_batches >= 0 &&
        static_cast<int64_t>(b + 1) >= options.cancel_after_batches) {
      context.TryCancel();
      stream_ok = false;
    }
  }
  if (stream_ok) {
    request.Clear();
    request.mutable_commit();
    stream_ok = writer->Write(request);
    ++t.messages;
  }
  t.send_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  t.total_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!status.ok()) return wire::ToAbslStatus(status);
  return report;
}

absl::StatusOr<pb::PublicationReport> PublisherClient::PublishRaw(
    const std::vector<pb::PublishRequest>& requests) {
  grpc::ClientContext context;
  Authorize(&context);
  pb::PublicationReport report;
  std::unique_ptr<grpc::ClientWriter<pb::PublishRequest>> writer =
      stub_->Publish(&context, &report);
  for (const pb::PublishRequest& r : requests) {
    if (!writer->Write(r)) break;  // the daemon ended the RPC; Finish says why
  }
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) return wire::ToAbslStatus(status);
  return report;
}

absl::StatusOr<pb::GetStatusResponse> PublisherClient::GetStatus(uint32_t max_reports) {
  grpc::ClientContext context;
  Authorize(&context);
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  pb::GetStatusRequest request;
  request.set_max_reports(max_reports);
  pb::GetStatusResponse response;
  grpc::Status status = stub_->GetStatus(&context, request, &response);
  if (!status.ok()) return wire::ToAbslStatus(status);
  return response;
}

absl::StatusOr<std::vector<pb::PublicationReport>> PublisherClient::ListReports(uint32_t limit) {
  grpc::ClientContext context;
  Authorize(&context);
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  pb::ListReportsRequest request;
  request.set_limit(limit);
  pb::ListReportsResponse response;
  grpc::Status status = stub_->ListReports(&context, request, &response);
  if (!status.ok()) return wire::ToAbslStatus(status);
  return std::vector<pb::PublicationReport>(response.reports().begin(), response.reports().end());
}

absl::StatusOr<pb::ConnectEnginesResponse> PublisherClient::ConnectEngines(
    const pb::ConnectEnginesRequest& request, absl::Duration rpc_timeout) {
  grpc::ClientContext context;
  Authorize(&context);
  context.set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout));
  pb::ConnectEnginesResponse response;
  grpc::Status status = stub_->ConnectEngines(&context, request, &response);
  if (!status.ok()) return wire::ToAbslStatus(status);
  return response;
}

absl::StatusOr<pb::ReplayReport> PublisherClient::Restore(const std::string& reason,
                                                          absl::Duration rpc_timeout) {
  grpc::ClientContext context;
  Authorize(&context);
  context.set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout));
  pb::RestoreRequest request;
  request.set_reason(reason);
  pb::ReplayReport response;
  grpc::Status status = stub_->Restore(&context, request, &response);
  if (!status.ok()) return wire::ToAbslStatus(status);
  return response;
}

}  // namespace wpub::client
