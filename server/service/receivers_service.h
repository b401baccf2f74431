// The engine-facing Receivers service (proto/wpub/v1/receivers.proto) over the core's
// gRPC-pull transport (transport::PullTransport).
//
// Threading: a CALLBACK service, no thread per stream. Subscribe maps one RPC onto one
// transport::Subscription whose sink is the RPC's reactor: the core hands it each event as it is
// produced and the reactor writes them one at a time (transport::SubscriptionSink's handoff; a
// reactor callback never blocks on the core). PullBucket writes the chunks of an immutable,
// already-staged bucket from reactor callbacks; Ack is a non-blocking unary call. PullBucket and
// Ack find the subscription by the receiver's name and must present that subscription's token
// (GroupInfo.subscription_token): a receiver must be subscribed, on its own stream, to pull or
// acknowledge.
//
// Bounded work: receiver names are validated (transport::ValidateReceiverName) before anything
// else; PullBucket chunks are at least kMinPullChunkBytes; every client string in a log line
// or error message is escaped (absl::CHexEscape) and truncated.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "core/transport/pull_transport.h"
#include "server/service/service_options.h"
#include "wpub/v1/receivers.grpc.pb.h"

namespace wpub::server {

// PullBucket never sends chunks smaller than this (unless the bucket's tail is, or
// ServiceOptions::max_chunk_bytes is smaller): a request for 1-byte chunks would otherwise cost
// the daemon one message per byte.
inline constexpr uint64_t kMinPullChunkBytes = uint64_t{64} << 10;

class ReceiversService final : public wpub::v1::Receivers::CallbackService {
 public:
  // `transport` must outlive the service.
  ReceiversService(transport::PullTransport* transport, ServiceOptions options);
  ~ReceiversService() override;

  grpc::ServerWriteReactor<wpub::v1::ReceiverEvent>* Subscribe(
      grpc::CallbackServerContext* context, const wpub::v1::SubscribeRequest* request) override;
  grpc::ServerWriteReactor<wpub::v1::BucketChunk>* PullBucket(
      grpc::CallbackServerContext* context, const wpub::v1::PullBucketRequest* request) override;
  grpc::ServerUnaryReactor* Ack(grpc::CallbackServerContext* context,
                                const wpub::v1::AckRequest* request,
                                wpub::v1::AckResponse* response) override;

  // Thread-safe registry of live subscriptions by receiver name (used by the reactors).
  // False (nothing registered) when options.max_subscriptions are registered already.
  bool Register(const std::string& name, std::shared_ptr<transport::Subscription> subscription);
  void Unregister(const std::string& name, const transport::Subscription* subscription);
  std::shared_ptr<transport::Subscription> Find(const std::string& name) const;
  size_t Count() const;  // subscriptions registered

  const ServiceOptions& options() const { return options_; }

 private:
  transport::PullTransport* const transport_;
  const ServiceOptions options_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<transport::Subscription>> subscriptions_;
};

}  // namespace wpub::server
