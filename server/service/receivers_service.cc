// Subscribe / PullBucket / Ack reactors over engine::PullTransport.
#include "server/service/receivers_service.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "server/wire/convert.h"
#include "server/wire/status_map.h"

namespace wpub::server {
namespace {

namespace pb = ::wpub::v1;

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
    spdlog::info("receiver '{}' left", sub_->name());
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

void ReceiversService::Register(const std::string& name,
                                std::shared_ptr<engine::Subscription> subscription) {
  std::lock_guard lock(mu_);
  subscriptions_[name] = std::move(subscription);
}

void ReceiversService::Unregister(const std::string& name,
                                  const engine::Subscription* subscription) {
  std::lock_guard lock(mu_);
  auto it = subscriptions_.find(name);
  if (it != subscriptions_.end() && it->second.get() == subscription) subscriptions_.erase(it);
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
  if (request->receiver_name().empty()) {
    return new RejectReactor<pb::ReceiverEvent>(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "receiver_name must not be empty"));
  }
  absl::StatusOr<std::unique_ptr<engine::Subscription>> sub =
      transport_->Subscribe(request->receiver_name());
  if (!sub.ok()) return new RejectReactor<pb::ReceiverEvent>(ToGrpcStatus(sub.status()));
  std::shared_ptr<engine::Subscription> shared = std::move(*sub);
  // Registered before the first event goes out, so the receiver can pull as soon as it hears
  // of a bucket.
  Register(request->receiver_name(), shared);
  spdlog::info("receiver '{}' subscribed from {}", request->receiver_name(), context->peer());
  return new SubscribeReactor(this, std::move(shared));
}

grpc::ServerWriteReactor<pb::BucketChunk>* ReceiversService::PullBucket(
    grpc::CallbackServerContext* context, const pb::PullBucketRequest* request) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) {
    return new RejectReactor<pb::BucketChunk>(std::move(auth));
  }
  std::shared_ptr<engine::Subscription> sub = Find(request->receiver_name());
  if (sub == nullptr) {
    return new RejectReactor<pb::BucketChunk>(
        grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                     absl::StrCat("receiver '", request->receiver_name(), "' is not subscribed")));
  }
  absl::StatusOr<std::shared_ptr<const engine::Bucket>> bucket =
      sub->ReadBucket(request->version(), request->index());
  if (!bucket.ok()) return new RejectReactor<pb::BucketChunk>(ToGrpcStatus(bucket.status()));
  uint64_t chunk = options_.max_chunk_bytes;
  if (request->chunk_bytes() != 0) chunk = std::min<uint64_t>(chunk, request->chunk_bytes());
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
  std::shared_ptr<engine::Subscription> sub = Find(request->receiver_name());
  if (sub == nullptr) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                     absl::StrCat("receiver '", request->receiver_name(), "' is not subscribed")));
    return reactor;
  }
  reactor->Finish(
      ToGrpcStatus(sub->Ack(request->version(), request->index(), request->checksum())));
  return reactor;
}

}  // namespace wpub::server
