// Subscribe / PullBucket / Ack reactors over engine::PullTransport.
#include "server/service/receivers_service.h"

#include <system_error>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <system_error>
#include <thread>
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
std::string Printable(absl::string_view s, size_t max = engine::kMaxReceiverNameBytes) {
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
  return ToGrpcStatus(why);
}

// The subscription a PullBucket or Ack names, after validating the name: INVALID_ARGUMENT for a
// bad name, FAILED_PRECONDITION when no such receiver is subscribed.
absl::StatusOr<std::shared_ptr<engine::Subscription>> FindNamed(const ReceiversService& service,
                                                                const std::string& name) {
  if (absl::Status s = engine::ValidateReceiverName(name); !s.ok()) return s;
  std::shared_ptr<engine::Subscription> sub = service.Find(name);
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

// One Subscribe RPC. The pump thread moves core events into `queue_`; the reactor writes the
// queue's front, one write in flight at a time. The RPC ending (client gone, server shutdown)
// closes the subscription, which the core counts as the receiver leaving.
class SubscribeReactor final : public grpc::ServerWriteReactor<pb::ReceiverEvent> {
 public:
  SubscribeReactor(ReceiversService* service, std::shared_ptr<engine::Subscription> sub)
      : service_(service), sub_(std::move(sub)) {
    pump_ = std::thread([this] { Pump(); });
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard lock(mu_);
    queue_.pop_front();
    if (!ok) {
      // The stream broke: the receiver is gone.
      stop_ = true;
      sub_->Close();
    }
    if (ok && !queue_.empty()) {
      StartWrite(&queue_.front());
    } else {
      writing_ = false;
      MaybeFinishLocked();
    }
    cv_.notify_all();
  }

  void OnCancel() override {
    std::lock_guard lock(mu_);
    stop_ = true;
    sub_->Close();
    cv_.notify_all();
  }

  void OnDone() override {
    sub_->Close();
    pump_.join();  // already returned or about to: Close woke it
    service_->Unregister(sub_->name(), sub_.get());
    spdlog::info("receiver '{}' left", Printable(sub_->name()));
    delete this;
  }

 private:
  void Pump() {
    const ServiceOptions& options = service_->options();
    grpc::Status final_status = grpc::Status::OK;
    while (true) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || queue_.size() < options.max_buffered_events; });
        if (stop_) break;
      }
      absl::StatusOr<engine::ReceiverEvent> event = sub_->Next(options.subscribe_poll);
      if (!event.ok()) {
        if (absl::IsDeadlineExceeded(event.status())) continue;
        // CANCELLED: closed or the daemon is shutting down; RESOURCE_EXHAUSTED: dropped for
        // falling behind. Either way the stream ends with that status.
        final_status = ToGrpcStatus(event.status());
        break;
      }
      std::lock_guard lock(mu_);
      if (stop_) break;
      queue_.emplace_back();
      ToProto(*event, &queue_.back());
      if (queue_.back().has_group_info()) {
        queue_.back().mutable_group_info()->set_max_chunk_bytes(options.max_chunk_bytes);
      }
      if (!writing_) {
        writing_ = true;
        StartWrite(&queue_.front());
      }
    }
    std::lock_guard lock(mu_);
    pump_done_ = true;
    final_status_ = std::move(final_status);
    MaybeFinishLocked();
  }

  // Finish once the pump stopped and no write is in flight (Finish may not overlap a write).
  void MaybeFinishLocked() {
    if (pump_done_ && !writing_ && !finished_) {
      finished_ = true;
      Finish(final_status_);
    }
  }

  ReceiversService* const service_;
  const std::shared_ptr<engine::Subscription> sub_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<pb::ReceiverEvent> queue_;  // front() is being written while writing_
  bool writing_ = false;
  bool stop_ = false;
  bool pump_done_ = false;
  bool finished_ = false;
  grpc::Status final_status_;
  std::thread pump_;  // last member: started after everything it touches exists
};

// One PullBucket RPC: writes an immutable staged bucket in chunks, from reactor callbacks only.
class PullReactor final : public grpc::ServerWriteReactor<pb::BucketChunk> {
 public:
  PullReactor(std::shared_ptr<const engine::Bucket> bucket, uint64_t chunk_bytes)
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
      chunk_.set_checksum(bucket_->manifest.checksum);
      chunk_.set_nbytes(bytes.size());
    } else {
      chunk_.clear_checksum();
      chunk_.clear_nbytes();
    }
    offset_ += n;
    StartWrite(&chunk_);
  }

  const std::shared_ptr<const engine::Bucket> bucket_;
  const uint64_t chunk_bytes_;
  uint64_t offset_ = 0;
  pb::BucketChunk chunk_;
};

}  // namespace

ReceiversService::ReceiversService(engine::PullTransport* transport, ServiceOptions options)
    : transport_(transport), options_(std::move(options)) {}

ReceiversService::~ReceiversService() = default;

bool ReceiversService::Register(const std::string& name,
                                std::shared_ptr<engine::Subscription> subscription) {
  std::lock_guard lock(mu_);
  if (!subscriptions_.contains(name) && subscriptions_.size() >= options_.max_subscriptions) {
    return false;
  }
  subscriptions_[name] = std::move(subscription);
  return true;
}

void ReceiversService::Unregister(const std::string& name,
                                  const engine::Subscription* subscription) {
  std::lock_guard lock(mu_);
  auto it = subscriptions_.find(name);
  if (it != subscriptions_.end() && it->second.get() == subscription) subscriptions_.erase(it);
}

size_t ReceiversService::Count() const {
  std::lock_guard lock(mu_);
  return subscriptions_.size();
}

std::shared_ptr<engine::Subscription> ReceiversService::Find(const std::string& name) const {
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
  if (absl::Status s = engine::ValidateReceiverName(name); !s.ok()) {
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
  absl::StatusOr<std::unique_ptr<engine::Subscription>> sub = transport_->Subscribe(
      name, request->held_version(), request->instance(), request->staged_version());
  if (!sub.ok()) {
    return new RejectReactor<pb::ReceiverEvent>(Refuse("Subscribe", name, *context, sub.status()));
  }
  std::shared_ptr<engine::Subscription> shared = std::move(*sub);
  // Registered before the first event goes out, so the receiver can pull as soon as it hears
  // of a bucket; the count of registered subscriptions is the bound (checked with the insert).
  if (!Register(name, shared)) {
    shared->Close();
    return full();
  }
  try {
    SubscribeReactor* reactor = new SubscribeReactor(this, shared);
    spdlog::info("receiver '{}' subscribed from {} (holds version {}{})", Printable(name),
                 Printable(context->peer()), request->held_version(),
                 request->staged_version() == 0
                     ? std::string()
                     : absl::StrCat(", version ", request->staged_version(), " staged"));
    return reactor;
  } catch (const std::system_error& e) {
    // No thread for its pump (the process is at its thread limit): refused, and nothing of
    // it stays behind.
    shared->Close();
    Unregister(name, shared.get());
    return new RejectReactor<pb::ReceiverEvent>(
        Refuse("Subscribe", name, *context,
               absl::ResourceExhaustedError(absl::StrCat("no thread for its stream: ", e.what()))));
  }
}

grpc::ServerWriteReactor<pb::BucketChunk>* ReceiversService::PullBucket(
    grpc::CallbackServerContext* context, const pb::PullBucketRequest* request) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) {
    return new RejectReactor<pb::BucketChunk>(std::move(auth));
  }
  const std::string& name = request->receiver_name();
  absl::StatusOr<std::shared_ptr<engine::Subscription>> sub = FindNamed(*this, name);
  if (!sub.ok()) {
    return new RejectReactor<pb::BucketChunk>(Refuse("PullBucket", name, *context, sub.status()));
  }
  absl::StatusOr<std::shared_ptr<const engine::Bucket>> bucket = (*sub)->ReadBucket(
      request->subscription_token(), request->version(), request->index(), request->attempt());
  if (absl::IsPermissionDenied(bucket.status())) {
    return new RejectReactor<pb::BucketChunk>(
        Refuse("PullBucket", name, *context, bucket.status()));
  }
  if (!bucket.ok()) return new RejectReactor<pb::BucketChunk>(ToGrpcStatus(bucket.status()));
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
  absl::StatusOr<std::shared_ptr<engine::Subscription>> sub = FindNamed(*this, name);
  if (!sub.ok()) {
    reactor->Finish(Refuse("Ack", name, *context, sub.status()));
    return reactor;
  }
  const absl::Status acked = (*sub)->Ack(request->subscription_token(), request->version(),
                                         request->index(), request->checksum(), request->attempt());
  reactor->Finish(absl::IsPermissionDenied(acked) ? Refuse("Ack", name, *context, acked)
                                                  : ToGrpcStatus(acked));
  return reactor;
}

}  // namespace wpub::server
