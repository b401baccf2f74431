// Building, serving and shutting down wpubd's gRPC server.
#include "server/service/daemon_server.h"

#include <chrono>
#include <utility>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace wpub::server {

bool IsLoopbackAddress(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  std::string host = listen;
  if (!host.empty() && host.front() == '[') {
    host = host.substr(1, host.find(']') - 1);
  } else if (auto colon = host.rfind(':'); colon != std::string::npos) {
    host = host.substr(0, colon);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::StatusOr<std::unique_ptr<DaemonServer>> DaemonServer::Create(
    const DaemonServerOptions& options, engine::Engine* engine) {
  if (!options.insecure_listen && !IsLoopbackAddress(options.listen)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "listen address '", options.listen,
        "' is not loopback; this listener has no TLS: pass --insecure_listen to acknowledge"));
  }
  if (options.max_message_bytes < 0 ||
      static_cast<uint64_t>(options.max_message_bytes) < options.service.max_chunk_bytes + 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes (", options.max_message_bytes, ") must exceed max_chunk_bytes (",
        options.service.max_chunk_bytes, ") plus framing"));
  }
  std::unique_ptr<DaemonServer> server(new DaemonServer());
  server->publisher_ = std::make_unique<PublisherService>(engine, options.service);
  server->receivers_ =
      std::make_unique<ReceiversService>(engine->pull_transport(), options.service);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &server->port_);
  builder.RegisterService(server->publisher_.get());
  builder.RegisterService(server->receivers_.get());
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on '", options.listen, "'"));
  }
  if (absl::StartsWith(options.listen, "unix:")) server->port_ = 0;
  server->SetServing(true);
  return server;
}

DaemonServer::~DaemonServer() {
  if (!shut_down_) Shutdown(absl::Now());
}

void DaemonServer::SetServing(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);
  health->SetServingStatus("wpub.v1.Publisher", serving);
  health->SetServingStatus("wpub.v1.Receivers", serving);
}

void DaemonServer::Shutdown(absl::Time deadline) {
  if (shut_down_) return;
  shut_down_ = true;
  SetServing(false);
  server_->Shutdown(absl::ToChronoTime(deadline));
  server_->Wait();
}

}  // namespace wpub::server
