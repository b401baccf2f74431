// Building, serving and shutting down wpubd's gRPC server.
#include "server/service/daemon_server.h"

#include <chrono>
#include <fstream>
#include <sstream>
#include <utility>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/common/status.h"

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

namespace {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  if (in) ss << in.rdbuf();
  if (!in || ss.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", path, "' cannot be read"));
  }
  return ss.str();
}

// TLS credentials when configured, plaintext otherwise.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(
    const TlsServerOptions& tls) {
  if (!tls.enabled() && tls.key_file.empty() && tls.client_ca_file.empty()) {
    return grpc::InsecureServerCredentials();
  }
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both a certificate (--tls_cert_file) and its key (--tls_key_file)");
  }
  grpc::SslServerCredentialsOptions ssl;
  WPUB_ASSIGN_OR_RETURN(std::string cert, ReadPemFile(tls.cert_file, "--tls_cert_file"));
  WPUB_ASSIGN_OR_RETURN(std::string key, ReadPemFile(tls.key_file, "--tls_key_file"));
  ssl.pem_key_cert_pairs.push_back({std::move(key), std::move(cert)});
  if (!tls.client_ca_file.empty()) {
    WPUB_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                          ReadPemFile(tls.client_ca_file, "--tls_client_ca_file"));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonServer>> DaemonServer::Create(
    const DaemonServerOptions& options, engine::Engine* engine) {
  const bool loopback = IsLoopbackAddress(options.listen);
  if (!loopback && !options.tls.enabled() && !options.insecure_listen) {
    return absl::PermissionDeniedError(absl::StrCat(
        "refusing to listen on non-loopback address '", options.listen,
        "' without TLS: give --tls_cert_file and --tls_key_file, or pass --insecure_listen to "
        "accept that anyone who can reach it may publish and pull weights in plaintext"));
  }
  if (!loopback && !options.tls.enabled()) {
    spdlog::warn(
        "INSECURE: gRPC listener '{}' is reachable from other hosts WITHOUT TLS "
        "(--insecure_listen); weights and bearer tokens travel in plaintext",
        options.listen);
  }
  if (options.max_concurrent_streams < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_concurrent_streams (", options.max_concurrent_streams, ") must be >= 1"));
  }
  WPUB_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                        MakeCredentials(options.tls));
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
  builder.AddListeningPort(options.listen, credentials, &server->port_);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
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
