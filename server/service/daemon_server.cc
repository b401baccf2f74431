// Building, serving and shutting down wpubd's gRPC server.
#include "server/service/daemon_server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/server_interceptor.h>
#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "server/common/log_escape.h"

namespace wpub::server {

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

// The socket path of a "unix:" address ("unix:/p" and "unix:///p" both name /p).
std::string UnixSocketPath(const std::string& listen) {
  std::string path = listen.substr(std::strlen("unix:"));
  if (absl::StartsWith(path, "//")) path = path.substr(2);
  return path;
}

// OK unless `listen` is a Unix socket some process still accepts connections on. gRPC removes
// an existing socket file before it binds, which would silently take the address from a
// running daemon; a stale file (nobody listening) is left to gRPC to replace.
absl::Status CheckUnixSocketFree(const std::string& listen) {
  if (!absl::StartsWith(listen, "unix:")) return absl::OkStatus();
  const std::string path = UnixSocketPath(listen);
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return absl::OkStatus();
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return absl::OkStatus();
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::OkStatus();
  const bool live = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  if (!live) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("cannot listen on '", listen,
                                             "': another process (another wpubd?) is "
                                             "listening on that socket"));
}

// Why gRPC could not bind `listen` (it only logs the reason): probed again here, after the
// failure, so the error the operator sees names the cause.
std::string ListenFailureReason(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:")) {
    const std::string path = UnixSocketPath(listen);
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
    struct stat st;
    if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::StrCat("directory '", dir, "' does not exist");
    }
    if (access(dir.c_str(), W_OK | X_OK) != 0) {
      return absl::StrCat("directory '", dir, "' is not writable");
    }
    return "the socket could not be created (see gRPC's log line above)";
  }
  std::string host = listen;
  std::string port;
  if (const size_t colon = listen.rfind(':'); colon != std::string::npos) {
    host = listen.substr(0, colon);
    port = listen.substr(colon + 1);
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
      rc != 0) {
    return absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc));
  }
  std::string reason = "gRPC refused the address (see its log line above)";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    const int rc = bind(fd, a->ai_addr, a->ai_addrlen);
    const int err = errno;
    close(fd);
    if (rc == 0) continue;
    reason = std::strerror(err);
    if (err == EADDRINUSE) {
      absl::StrAppend(&reason, ": another process (another wpubd?) listens on that port");
    } else if (err == EADDRNOTAVAIL) {
      absl::StrAppend(&reason, ": the address is not one of this host's");
    }
    break;
  }
  freeaddrinfo(found);
  return reason;
}

constexpr absl::string_view kReflectionPrefix = "/grpc.reflection.";

// Server reflection is registered by gRPC's plugin, so the services' own CheckAuth does not
// cover it: this interceptor cancels a reflection call without the bearer token before the
// reflection handler runs. (gRPC 1.51 server interceptors cannot answer with a status of their
// own; the client sees CANCELLED.) Created only for reflection calls, only with a token.
class ReflectionAuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  ReflectionAuthInterceptor(grpc::experimental::ServerRpcInfo* info, const ServiceOptions* options)
      : info_(info), options_(options) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      if (grpc::Status auth = CheckAuth(*options_, *info_->server_context()); !auth.ok()) {
        spdlog::warn("server reflection refused ({}): {}", LogEscape(info_->method()),
                     LogEscape(auth.error_message()));
        info_->server_context()->TryCancel();
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  const ServiceOptions* const options_;
};

class ReflectionAuthFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ReflectionAuthFactory(ServiceOptions options) : options_(std::move(options)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (!absl::StartsWith(info->method(), kReflectionPrefix)) return nullptr;
    return new ReflectionAuthInterceptor(info, &options_);
  }

 private:
  const ServiceOptions options_;
};

int ClampedMillis(absl::Duration d) {
  return static_cast<int>(
      std::min<int64_t>(absl::ToInt64Milliseconds(d), std::numeric_limits<int>::max()));
}

absl::Status ValidateBounds(const DaemonServerOptions& options) {
  if (options.max_concurrent_streams < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_concurrent_streams (", options.max_concurrent_streams, ") must be >= 1"));
  }
  if (options.max_message_bytes < 0 ||
      static_cast<uint64_t>(options.max_message_bytes) < options.service.max_chunk_bytes + 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes (", options.max_message_bytes, ") must exceed max_chunk_bytes (",
        options.service.max_chunk_bytes, ") plus framing"));
  }
  if (options.grpc_memory_bytes < 4 * static_cast<uint64_t>(options.max_message_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("grpc_memory_bytes (", options.grpc_memory_bytes,
                                                   ") must be at least 4 x max_message_bytes (",
                                                   options.max_message_bytes, ")"));
  }
  if (options.grpc_max_threads < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("grpc_max_threads (", options.grpc_max_threads, ") must be >= 8"));
  }
  for (const auto& [name, d] : {std::pair{"keepalive_time", options.keepalive_time},
                                {"keepalive_timeout", options.keepalive_timeout},
                                {"min_client_ping_interval", options.min_client_ping_interval},
                                {"handshake_timeout", options.handshake_timeout}}) {
    if (d < absl::Milliseconds(1)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " (", absl::FormatDuration(d), ") must be at least 1ms"));
    }
  }
  return absl::OkStatus();
}

// Every bound of the listener: message sizes, streams, the memory and thread quota,
// keepalive and ping policy, handshake timeout, no shared ports.
void ApplyBounds(const DaemonServerOptions& options, grpc::ResourceQuota* quota,
                 grpc::ServerBuilder* builder) {
  builder->SetMaxReceiveMessageSize(options.max_message_bytes);
  builder->SetMaxSendMessageSize(options.max_message_bytes);
  builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  quota->Resize(options.grpc_memory_bytes);
  quota->SetMaxThreads(options.grpc_max_threads);
  builder->SetResourceQuota(*quota);
  // gRPC sets SO_REUSEPORT by default: a second daemon would bind the same port and take half
  // of the connections.
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ClampedMillis(options.keepalive_time));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                              ClampedMillis(options.keepalive_timeout));
  // Receivers idle between publications have a stream open but no data moving: keep pinging
  // them (gRPC stops after 2 data-less pings by default, and spaces them 5 minutes apart).
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS,
                              ClampedMillis(options.keepalive_time));
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              ClampedMillis(options.min_client_ping_interval));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                              ClampedMillis(options.handshake_timeout));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonServer>> DaemonServer::Create(
    const DaemonServerOptions& options, engine::Engine* engine, group::Coordinator* coordinator) {
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
  WPUB_RETURN_IF_ERROR(ValidateBounds(options));
  WPUB_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                        MakeCredentials(options.tls));
  WPUB_RETURN_IF_ERROR(CheckUnixSocketFree(options.listen));
  std::unique_ptr<DaemonServer> server(new DaemonServer());
  server->publisher_ = std::make_unique<PublisherService>(engine, options.service, coordinator);
  if (coordinator != nullptr) {
    server->group_ = std::make_unique<GroupService>(coordinator, options.service);
  }
  server->receivers_ =
      std::make_unique<ReceiversService>(engine->pull_transport(), options.service);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, &server->port_);
  builder.RegisterService(server->publisher_.get());
  builder.RegisterService(server->receivers_.get());
  if (server->group_) builder.RegisterService(server->group_.get());
  grpc::ResourceQuota quota("wpubd");
  ApplyBounds(options, &quota, &builder);
  if (!options.service.auth_token.empty()) {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(std::make_unique<ReflectionAuthFactory>(options.service));
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on '", options.listen,
                                               "': ", ListenFailureReason(options.listen)));
  }
  if (absl::StartsWith(options.listen, "unix:")) server->port_ = 0;
  {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    server->publisher_->set_publisher_name(server->port_ != 0
                                               ? absl::StrCat(host, ":", server->port_)
                                               : absl::StrCat(host, ":", options.listen));
  }
  server->SetServing(true);
  return server;
}

DaemonServer::~DaemonServer() {
  if (!shut_down_) Shutdown(absl::Now());
}

void DaemonServer::SetServing(bool serving) {
  // A DaemonServer whose server never started (Create failed to listen) has nothing to mark.
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);
  health->SetServingStatus("wpub.v1.Publisher", serving);
  health->SetServingStatus("wpub.v1.Receivers", serving);
}

void DaemonServer::Shutdown(absl::Time deadline) {
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ == nullptr) return;
  SetServing(false);
  server_->Shutdown(absl::ToChronoTime(deadline));
  server_->Wait();
}

}  // namespace wpub::server
