// Subscribe / PullBucket / Ack reactors over transport::PullTransport.
#include "server/service/receivers_service.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "wire/convert.h"
#include "wire/status_map.h"

namespace wpub::server {
namespace {

namespace pb = ::wpub::v1;

// A client-supplied string as it may appear in a log line or an error message: cut to `max`
// bytes and, unless it is plain printable ASCII, escaped (a newline cannot forge a log line).
std::string Printable(absl::string_view s, size_t max = transport::kMaxReceiverNameBytes) {
  const absl::string_view cut = s.substr(0, max);
  const bool plain = std::all_of(cut.begin(), cut.end(), [](char c) {
    return absl::ascii_isprint(static_cast<unsigned char>(c));
  });
  std::string out = plain ? std::string(cut) : absl::CHexEscape(cut);
  if (s.size() > max) absl::StrAppend(&out, "... (", s.size(), " bytes)");
  return out;
}

// Logs a refused receiver RPC (who asked, from where, why) and returns its status.
grpc::Status Refuse(absl::string_view rpc, absl::string_view name,
                    const grpc::CallbackServerContext& context, const absl::Status& why) {
  spdlog::warn("refused {} for receiver '{}' from {}: {}", std::string(rpc), Printable(name),
               Printable(context.peer()), Printable(why.message(), 1024));
  return wire::ToGrpcStatus(why);
}

// The subscription a PullBucket or Ack names, after validating the name: INVALID_ARGUMENT for a
// bad name, FAILED_PRECONDITION when no such receiver is subscribed.
absl::StatusOr<std::shared_ptr<transport::Subscription>> FindNamed(const ReceiversService& service,
                                                                   const std::string& name) {
  if (absl::Status s = transport::ValidateReceiverName(name); !s.ok()) return s;
  std::shared_ptr<transport::Subscription> sub = service.Find(name);
  if (sub == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("receiver '", name, "' is not subscribed"));
  }
  return sub;
}

// A write reactor that only reports an error status.
template <typename T>
class RejectReactor final : public grpc::ServerWriteReactor<T> {
 public:
  explicit RejectReactor(grpc::Status status) { this->Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

// One Subscribe RPC: the subscription's sink. The core hands it one event at a time (Deliver,
// on the thread that produced it) and it writes that event; when the write is done it takes
// the next (Subscription::Take) or goes idle -- no thread waits for a receiver's events. The
// RPC ending (client gone, server shutdown) closes the subscription, which the core counts as
// the receiver leaving; the end the core then hands over finishes the stream.
class SubscribeReactor final : public grpc::ServerWriteReactor<pb::ReceiverEvent>,
                               public transport::SubscriptionSink {
 public:
  SubscribeReactor(ReceiversService* service, std::shared_ptr<transport::Subscription> sub)
      : service_(service), sub_(std::move(sub)) {
    sub_->Attach(this);  // its group info is written at once
  }

  void Deliver(absl::StatusOr<transport::ReceiverEvent> item) override {
    std::lock_guard lock(mu_);
    WriteLocked(std::move(item));
  }

  void OnWriteDone(bool ok) override {
    // The stream broke: the receiver is gone (the end comes back from Take).
    if (!ok) sub_->Close();
    std::optional<absl::StatusOr<transport::ReceiverEvent>> next = sub_->Take();
    if (!next.has_value()) return;  // idle: the core delivers the next event
    std::lock_guard lock(mu_);
    WriteLocked(*std::move(next));
  }

  // An idle sink is handed the end at once, a busy one takes it after its write.
  void OnCancel() override { sub_->Close(); }

  void OnDone() override {
    sub_->Detach();
    sub_->Close();
    service_->Unregister(sub_->name(), sub_.get());
    spdlog::info("receiver '{}' left", Printable(sub_->name()));
    delete this;
  }

 private:
  // Writes `item`, or finishes the stream with the end it carries. One item at a time (the
  // sink's handoff), so a write is never in flight here.
  void WriteLocked(absl::StatusOr<transport::ReceiverEvent> item) {
    if (finished_) return;
    if (!item.ok()) {
      // CANCELLED: closed or the daemon is shutting down; RESOURCE_EXHAUSTED: dropped for
      // falling behind.
      finished_ = true;
      Finish(wire::ToGrpcStatus(item.status()));
      return;
    }
    event_.Clear();
    wire::ToProto(*item, &event_);
    if (event_.has_group_info()) {
      event_.mutable_group_info()->set_max_chunk_bytes(service_->options().max_chunk_bytes);
    }
    StartWrite(&event_);
  }

  ReceiversService* const service_;
  const std::shared_ptr<transport::Subscription> sub_;
  std::mutex mu_;
  pb::ReceiverEvent event_;  // being written
  bool finished_ = false;
};

// One PullBucket RPC: writes an immutable staged bucket in chunks, from reactor callbacks only.
class PullReactor final : public grpc::ServerWriteReactor<pb::BucketChunk> {
 public:
  PullReactor(std::shared_ptr<const transport::Bucket> bucket, uint64_t chunk_bytes)
      : bucket_(std::move(bucket)), chunk_bytes_(chunk_bytes) {
    WriteNext();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "PullBucket stream broken"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    const std::vector<uint8_t>& bytes = bucket_->bytes;
    if (offset_ >= bytes.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    const uint64_t n = std::min<uint64_t>(chunk_bytes_, bytes.size() - offset_);
    chunk_.set_offset(offset_);
    chunk_.set_data(reinterpret_cast<const char*>(bytes.data() + offset_), n);
    if (offset_ == 0) {
      // Of a patch: the whole bucket's checksum, the patch's size and its base.
      chunk_.set_checksum(bucket_->manifest.checksum);
      chunk_.set_nbytes(bytes.size());
      chunk_.set_patch_base(bucket_->patch_base);
    } else {
      chunk_.clear_checksum();
      chunk_.clear_nbytes();
      chunk_.clear_patch_base();
    }
    offset_ += n;
    StartWrite(&chunk_);
  }

  const std::shared_ptr<const transport::Bucket> bucket_;
  const uint64_t chunk_bytes_;
  uint64_t offset_ = 0;
  pb::BucketChunk chunk_;
};

}  // namespace

ReceiversService::ReceiversService(transport::PullTransport* transport, ServiceOptions options)
    : transport_(transport), options_(std::move(options)) {}

ReceiversService::~ReceiversService() = default;

bool ReceiversService::Register(const std::string& name,
                                std::shared_ptr<transport::Subscription> subscription) {
  std::lock_guard lock(mu_);
  if (!subscriptions_.contains(name) && subscriptions_.size() >= options_.max_subscriptions) {
    return false;
  }
  subscriptions_[name] = std::move(subscription);
  return true;
}

void ReceiversService::Unregister(const std::string& name,
                                  const transport::Subscription* subscription) {
  std::lock_guard lock(mu_);
  auto it = subscriptions_.find(name);
  if (it != subscriptions_.end() && it->second.get() == subscription) subscriptions_.erase(it);
}

size_t ReceiversService::Count() const {
  std::lock_guard lock(mu_);
  return subscriptions_.size();
}

std::shared_ptr<transport::Subscription> ReceiversService::Find(const std::string& name) const {
  std::lock_guard lock(mu_);
  auto it = subscriptions_.find(name);
  return it == subscriptions_.end() ? nullptr : it->second;
}

grpc::ServerWriteReactor<pb::ReceiverEvent>* ReceiversService::Subscribe(
    grpc::CallbackServerContext* context, const pb::SubscribeRequest* request) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) {
    return new RejectReactor<pb::ReceiverEvent>(std::move(auth));
  }
  const std::string& name = request->receiver_name();
  // Validated before the name reaches the core, a log line or a message.
  if (absl::Status s = transport::ValidateReceiverName(name); !s.ok()) {
    return new RejectReactor<pb::ReceiverEvent>(Refuse("Subscribe", name, *context, s));
  }
  const auto full = [&] {
    return new RejectReactor<pb::ReceiverEvent>(
        Refuse("Subscribe", name, *context,
               absl::ResourceExhaustedError(absl::StrCat(options_.max_subscriptions,
                                                         " receivers are subscribed, the most this "
                                                         "daemon takes"))));
  };
  // Refused before the core sees it (a subscription taken and closed again would join and leave
  // a publication beginning in between); Register checks the bound again with its insert, for
  // subscribers racing at the bound.
  if (Count() >= options_.max_subscriptions) return full();
  absl::StatusOr<std::unique_ptr<transport::Subscription>> sub =
      transport_->Subscribe(name, request->held_version(), request->instance(),
                            request->staged_version(), request->accepts_patches());
  if (!sub.ok()) {
    return new RejectReactor<pb::ReceiverEvent>(Refuse("Subscribe", name, *context, sub.status()));
  }
  std::shared_ptr<transport::Subscription> shared = std::move(*sub);
  // Registered before the first event goes out, so the receiver can pull as soon as it hears
  // of a bucket; the count of registered subscriptions is the bound (checked with the insert).
  if (!Register(name, shared)) {
    shared->Close();
    return full();
  }
  spdlog::info("receiver '{}' subscribed from {} (holds version {}{})", Printable(name),
               Printable(context->peer()), request->held_version(),
               request->staged_version() == 0
                   ? std::string()
                   : absl::StrCat(", version ", request->staged_version(), " staged"));
  return new SubscribeReactor(this, std::move(shared));
}

grpc::ServerWriteReactor<pb::BucketChunk>* ReceiversService::PullBucket(
    grpc::CallbackServerContext* context, const pb::PullBucketRequest* request) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) {
    return new RejectReactor<pb::BucketChunk>(std::move(auth));
  }
  const std::string& name = request->receiver_name();
  absl::StatusOr<std::shared_ptr<transport::Subscription>> sub = FindNamed(*this, name);
  if (!sub.ok()) {
    return new RejectReactor<pb::BucketChunk>(Refuse("PullBucket", name, *context, sub.status()));
  }
  absl::StatusOr<std::shared_ptr<const transport::Bucket>> bucket =
      (*sub)->ReadBucket(request->subscription_token(), request->version(), request->index(),
                         request->attempt(), request->patch());
  if (absl::IsPermissionDenied(bucket.status())) {
    return new RejectReactor<pb::BucketChunk>(
        Refuse("PullBucket", name, *context, bucket.status()));
  }
  if (!bucket.ok()) return new RejectReactor<pb::BucketChunk>(wire::ToGrpcStatus(bucket.status()));
  // Clamped from both sides: at most the daemon's limit, at least kMinPullChunkBytes.
  const uint64_t limit = options_.max_chunk_bytes;
  uint64_t chunk = request->chunk_bytes() == 0 ? limit : request->chunk_bytes();
  chunk = std::min(std::max(chunk, kMinPullChunkBytes), limit);
  return new PullReactor(std::move(*bucket), chunk);
}

grpc::ServerUnaryReactor* ReceiversService::Ack(grpc::CallbackServerContext* context,
                                                const pb::AckRequest* request,
                                                pb::AckResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) {
    reactor->Finish(std::move(auth));
    return reactor;
  }
  const std::string& name = request->receiver_name();
  absl::StatusOr<std::shared_ptr<transport::Subscription>> sub = FindNamed(*this, name);
  if (!sub.ok()) {
    reactor->Finish(Refuse("Ack", name, *context, sub.status()));
    return reactor;
  }
  const absl::Status acked = (*sub)->Ack(request->subscription_token(), request->version(),
                                         request->index(), request->checksum(), request->attempt());
  reactor->Finish(absl::IsPermissionDenied(acked) ? Refuse("Ack", name, *context, acked)
                                                  : wire::ToGrpcStatus(acked));
  return reactor;
}

}  // namespace wpub::server
