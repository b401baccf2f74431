// The gRPC-pull receiver: one subscription stream, buckets pulled and acknowledged in order.
#include "clients/recv/receiver.h"

#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "clients/recv/safetensors.h"
#include "core/common/status.h"
#include "core/engine/checksum.h"
#include "server/wire/convert.h"
#include "server/wire/status_map.h"
#include "wpub/v1/receivers.grpc.pb.h"

namespace wpub::recv {
namespace {

namespace pb = ::wpub::v1;

// A publication being received.
struct Pending {
  engine::PublicationManifest manifest;
  std::vector<std::vector<uint8_t>> buckets;
  std::vector<bool> received;
};

}  // namespace

absl::Span<const uint8_t> CommittedModel::TensorBytes(const std::string& name) const {
  for (const engine::BucketManifest& b : manifest.buckets) {
    for (const engine::ManifestTensor& t : b.tensors) {
      if (t.name == name) return absl::MakeConstSpan(buckets[b.index]).subspan(t.offset, t.nbytes);
    }
  }
  return {};
}

std::vector<const engine::ManifestTensor*> CommittedModel::Tensors() const {
  std::vector<const engine::ManifestTensor*> out;
  for (const engine::BucketManifest& b : manifest.buckets) {
    for (const engine::ManifestTensor& t : b.tensors) out.push_back(&t);
  }
  return out;
}

absl::Status WriteCommittedSafetensors(const CommittedModel& model, const std::string& path) {
  std::vector<SafetensorsEntry> entries;
  for (const engine::BucketManifest& b : model.manifest.buckets) {
    for (const engine::ManifestTensor& t : b.tensors) {
      entries.push_back({TensorDesc{t.name, t.dtype, t.shape},
                         absl::MakeConstSpan(model.buckets[b.index]).subspan(t.offset, t.nbytes)});
    }
  }
  return WriteSafetensors(path, entries,
                          {{"version", std::to_string(model.manifest.version)},
                           {"model_id", model.manifest.model_id},
                           {"recipe", model.manifest.recipe}});
}

class Receiver::Impl {
 public:
  Impl(ReceiverOptions options, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : options_(std::move(options)) {
    grpc::ChannelArguments args;
    // Chunks are bounded by the daemon (4 MiB by default); leave ample room.
    args.SetMaxReceiveMessageSize(256 << 20);
    channel_ = grpc::CreateCustomChannel(options_.target, std::move(credentials), args);
    stub_ = pb::Receivers::NewStub(channel_);
  }

  absl::Status Run() {
    if (!channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + options_.connect_timeout))) {
      return absl::UnavailableError(absl::StrCat("cannot connect to wpubd at '", options_.target,
                                                 "' within ",
                                                 absl::FormatDuration(options_.connect_timeout)));
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return absl::OkStatus();
      context_ = std::make_unique<grpc::ClientContext>();
      Authorize(context_.get());
    }
    pb::SubscribeRequest request;
    request.set_receiver_name(options_.name);
    request.add_transports("pull");
    std::unique_ptr<grpc::ClientReader<pb::ReceiverEvent>> reader =
        stub_->Subscribe(context_.get(), request);
    pb::ReceiverEvent event;
    absl::Status outcome = absl::OkStatus();
    bool done = false;
    while (!done && reader->Read(&event)) {
      absl::StatusOr<bool> step = Handle(event);
      if (!step.ok()) {
        outcome = step.status();
        done = true;
      } else {
        done = *step;
      }
    }
    if (done) context_->TryCancel();
    grpc::Status finish = reader->Finish();
    absl::MutexLock lock(&mu_);
    if (!outcome.ok()) return outcome;
    if (done || stopped_) return absl::OkStatus();
    return finish.ok() ? absl::UnavailableError("the daemon ended the subscription")
                       : server::ToAbslStatus(finish);
  }

  void Stop() {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    if (context_) context_->TryCancel();
  }

  std::shared_ptr<const CommittedModel> committed() const {
    absl::MutexLock lock(&mu_);
    return committed_;
  }
  ReceiverStats stats() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

 private:
  void Authorize(grpc::ClientContext* context) const {
    if (!options_.auth_token.empty()) {
      context->AddMetadata("authorization", absl::StrCat("Bearer ", options_.auth_token));
    }
  }

  // Processes one event; true when Run should return (exit_after_versions reached).
  absl::StatusOr<bool> Handle(const pb::ReceiverEvent& event) {
    switch (event.kind_case()) {
      case pb::ReceiverEvent::kGroupInfo:
        spdlog::info("[{}] joined wpubd at {} (transport {}, committed version {})", options_.name,
                     options_.target, event.group_info().transport(),
                     event.group_info().committed_version());
        return false;
      case pb::ReceiverEvent::kManifest: {
        WPUB_ASSIGN_OR_RETURN(engine::PublicationManifest manifest,
                              server::FromProto(event.manifest()));
        pending_ = std::make_unique<Pending>();
        pending_->buckets.resize(manifest.buckets.size());
        pending_->received.assign(manifest.buckets.size(), false);
        for (const engine::BucketManifest& b : manifest.buckets) {
          if (b.index >= manifest.buckets.size()) {
            return absl::InvalidArgumentError(absl::StrCat(
                "manifest of v", manifest.version, ": bucket index ", b.index, " out of range"));
          }
        }
        pending_->manifest = std::move(manifest);
        pulled_in_publication_ = 0;
        return false;
      }
      case pb::ReceiverEvent::kBucketReady: {
        const pb::BucketReady& ready = event.bucket_ready();
        if (pending_ == nullptr || pending_->manifest.version != ready.version()) {
          return absl::InternalError(
              absl::StrCat("bucket_ready for v", ready.version(), " without its manifest"));
        }
        if (options_.leave_after_buckets >= 0 &&
            pulled_in_publication_ >= options_.leave_after_buckets) {
          spdlog::warn("[{}] leaving mid-publication v{} (fault injection)", options_.name,
                       ready.version());
          return absl::AbortedError("left mid-publication (leave_after_buckets)");
        }
        WPUB_RETURN_IF_ERROR(PullAndAck(ready.version(), ready.index()));
        ++pulled_in_publication_;
        return false;
      }
      case pb::ReceiverEvent::kCommit:
        return OnCommit(event.commit().version());
      case pb::ReceiverEvent::kAbort: {
        spdlog::warn("[{}] v{} aborted: {}", options_.name, event.abort().version(),
                     event.abort().reason());
        pending_.reset();
        absl::MutexLock lock(&mu_);
        ++stats_.aborts;
        return false;
      }
      case pb::ReceiverEvent::KIND_NOT_SET:
        break;
    }
    return absl::InternalError("an event without a kind");
  }

  absl::Status PullAndAck(uint64_t version, uint32_t index) {
    if (index >= pending_->buckets.size()) {
      return absl::InternalError(absl::StrCat("bucket ", index, " of v", version, " unknown"));
    }
    const engine::BucketManifest& bm = pending_->manifest.buckets[index];
    std::vector<uint8_t>& bytes = pending_->buckets[index];
    bytes.assign(bm.nbytes, 0);
    grpc::ClientContext context;
    Authorize(&context);
    pb::PullBucketRequest request;
    request.set_receiver_name(options_.name);
    request.set_version(version);
    request.set_index(index);
    request.set_chunk_bytes(options_.chunk_bytes);
    std::unique_ptr<grpc::ClientReader<pb::BucketChunk>> reader =
        stub_->PullBucket(&context, request);
    pb::BucketChunk chunk;
    uint64_t received = 0;
    // The manifest is announced before packing; the daemon sends the packed bucket's checksum
    // with the first chunk.
    uint64_t expected_checksum = bm.checksum;
    while (reader->Read(&chunk)) {
      if (chunk.offset() == 0 && chunk.checksum() != 0) expected_checksum = chunk.checksum();
      if (chunk.offset() + chunk.data().size() > bytes.size()) {
        context.TryCancel();
        reader->Finish();
        return absl::DataLossError(absl::StrCat("bucket ", index, " of v", version,
                                                ": chunk beyond the manifest's ", bm.nbytes,
                                                " bytes"));
      }
      std::copy(chunk.data().begin(), chunk.data().end(), bytes.begin() + chunk.offset());
      received += chunk.data().size();
    }
    grpc::Status status = reader->Finish();
    if (!status.ok()) {
      // The publication may have been aborted meanwhile (the abort event follows); not fatal.
      spdlog::warn("[{}] pulling bucket {} of v{}: {}", options_.name, index, version,
                   status.error_message());
      return absl::OkStatus();
    }
    if (options_.corrupt_bucket == static_cast<int64_t>(index) && !bytes.empty()) {
      bytes[bytes.size() / 2] ^= 0x5A;
    }
    const uint64_t checksum = engine::Checksum(bytes.data(), bytes.size());
    const bool match = checksum == expected_checksum && received == bm.nbytes;
    {
      absl::MutexLock lock(&mu_);
      ++stats_.buckets;
      stats_.bytes += received;
      if (!match) ++stats_.checksum_mismatches;
    }
    if (!match) {
      spdlog::error("[{}] bucket {} of v{}: checksum {:016x} != daemon's {:016x} ({} of {} bytes)",
                    options_.name, index, version, checksum, expected_checksum, received,
                    bm.nbytes);
    }
    pending_->received[index] = true;
    // Acknowledge with what was computed: the daemon judges, and aborts on a mismatch.
    grpc::ClientContext ack_context;
    Authorize(&ack_context);
    pb::AckRequest ack;
    ack.set_receiver_name(options_.name);
    ack.set_version(version);
    ack.set_index(index);
    ack.set_checksum(checksum);
    pb::AckResponse ack_response;
    grpc::Status ack_status = stub_->Ack(&ack_context, ack, &ack_response);
    if (!ack_status.ok()) {
      spdlog::warn("[{}] ack of bucket {} of v{}: {}", options_.name, index, version,
                   ack_status.error_message());
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> OnCommit(uint64_t version) {
    if (pending_ == nullptr || pending_->manifest.version != version) {
      return absl::InternalError(absl::StrCat("commit of v", version, " without its manifest"));
    }
    for (size_t i = 0; i < pending_->received.size(); ++i) {
      if (!pending_->received[i]) {
        return absl::InternalError(
            absl::StrCat("commit of v", version, " but bucket ", i, " was never pulled"));
      }
    }
    auto model = std::make_shared<CommittedModel>();
    model->manifest = std::move(pending_->manifest);
    model->buckets = std::move(pending_->buckets);
    pending_.reset();
    if (!options_.output_path.empty()) {
      WPUB_RETURN_IF_ERROR(WriteCommittedSafetensors(*model, options_.output_path));
    }
    spdlog::info("[{}] committed v{} ({} buckets, {} bytes)", options_.name, version,
                 model->buckets.size(), model->manifest.total_bytes());
    absl::MutexLock lock(&mu_);
    committed_ = std::move(model);
    ++stats_.commits;
    stats_.last_committed_version = version;
    return options_.exit_after_versions != 0 && stats_.commits >= options_.exit_after_versions;
  }

  const ReceiverOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Receivers::Stub> stub_;
  std::unique_ptr<Pending> pending_;  // Run's thread only
  int64_t pulled_in_publication_ = 0;

  mutable absl::Mutex mu_;
  std::unique_ptr<grpc::ClientContext> context_;  // guarded for Stop's TryCancel
  bool stopped_ = false;
  std::shared_ptr<const CommittedModel> committed_;
  ReceiverStats stats_;
};

absl::StatusOr<std::unique_ptr<Receiver>> Receiver::Create(const ReceiverOptions& options) {
  if (options.name.empty()) return absl::InvalidArgumentError("receiver name must not be empty");
  if (options.target.empty()) return absl::InvalidArgumentError("target must not be empty");
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      client::ChannelCredentialsFor(options.tls);
  if (!credentials.ok()) return credentials.status();
  return std::unique_ptr<Receiver>(
      new Receiver(std::make_unique<Impl>(options, *std::move(credentials))));
}

Receiver::Receiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Receiver::~Receiver() = default;
absl::Status Receiver::Run() { return impl_->Run(); }
void Receiver::Stop() { impl_->Stop(); }
std::shared_ptr<const CommittedModel> Receiver::committed() const { return impl_->committed(); }
ReceiverStats Receiver::stats() const { return impl_->stats(); }

}  // namespace wpub::recv
