// The trainer-facing Publisher service (proto/wpub/v1/publisher.proto) over the core Engine.
//
// Threading: this is a SYNC service on purpose. A Publish RPC is one publication, driven by one
// producer thread (the contract of engine::PublicationSession), and its Commit blocks for the
// whole quantize -> transfer -> acknowledge sequence. The sync server runs each RPC on its own
// thread, so that thread is the session's producer and may block in Commit without stalling
// anything else; the core allows one publication at a time, so at most one thread is held for
// long (a second Publish fails fast with FAILED_PRECONDITION, or waits when it asked to queue).
// ConnectEngines also blocks its thread, while the engines join (at most its timeout).
// Flow control of the client stream gives the trainer back-pressure for free. While the
// handler waits for the trainer's next message, a watchdog thread of the RPC cancels it after
// options.ingest_idle_timeout of silence (the publication is then reported ABORTED naming
// --ingest_idle_timeout; the trainer sees CANCELLED), so a stalled trainer cannot hold the
// one publication slot. The short unary
// calls (GetStatus, ListReports) never block on a publication in progress.
#pragma once

#include <mutex>
#include <string>

#include "core/engine/engine.h"
#include "core/group/coordinator.h"
#include "server/service/service_options.h"
#include "wpub/v1/publisher.grpc.pb.h"

namespace wpub::server {

class PublisherService final : public wpub::v1::Publisher::Service {
 public:
  // `engine` must outlive the service (the server is shut down before the engine).
  // `coordinator` (may be null) is the group coordinator whose last round GetStatus shows.
  PublisherService(engine::Engine* engine, ServiceOptions options,
                   group::Coordinator* coordinator = nullptr);
  // How this daemon names itself in a group when the trainer gave no publisher name
  // ("<hostname>:<port>"; set once the port is bound).
  void set_publisher_name(std::string name);

  grpc::Status Publish(grpc::ServerContext* context,
                       grpc::ServerReader<wpub::v1::PublishRequest>* reader,
                       wpub::v1::PublicationReport* reply) override;
  grpc::Status GetStatus(grpc::ServerContext* context, const wpub::v1::GetStatusRequest* request,
                         wpub::v1::GetStatusResponse* reply) override;
  grpc::Status ListReports(grpc::ServerContext* context,
                           const wpub::v1::ListReportsRequest* request,
                           wpub::v1::ListReportsResponse* reply) override;
  // Blocks this RPC's thread while the engines are probed and join (bounded by the request's
  // timeout); refused while a publication is active (engine::Engine::ConnectEngines).
  grpc::Status ConnectEngines(grpc::ServerContext* context,
                              const wpub::v1::ConnectEnginesRequest* request,
                              wpub::v1::ConnectEnginesResponse* reply) override;
  // Blocks this RPC's thread while the retained version is replayed (engine::Engine::Restore).
  grpc::Status Restore(grpc::ServerContext* context, const wpub::v1::RestoreRequest* request,
                       wpub::v1::ReplayReport* reply) override;

 private:
  std::string publisher_name() const;

  engine::Engine* const engine_;
  const ServiceOptions options_;
  group::Coordinator* const coordinator_;
  mutable std::mutex name_mu_;
  std::string publisher_name_;  // guarded by name_mu_
};

}  // namespace wpub::server
