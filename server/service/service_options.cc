// Bearer-token check for wpubd's RPCs.
#include "server/service/service_options.h"

#include <memory>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/common/secure_compare.h"

namespace wpub::server {

bool BearerMatches(std::string_view authorization, std::string_view token) {
  constexpr std::string_view kPrefix = "Bearer ";
  return authorization.substr(0, kPrefix.size()) == kPrefix &&
         SecureEquals(authorization.substr(kPrefix.size()), token);
}

grpc::Status CheckAuth(const ServiceOptions& options, const grpc::ServerContextBase& context) {
  if (options.auth_token.empty()) return grpc::Status::OK;
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing 'authorization: Bearer <token>' metadata");
  }
  if (!BearerMatches(std::string_view(it->second.data(), it->second.size()), options.auth_token)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
  }
  return grpc::Status::OK;
}

bool IsLoopbackPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:")) return true;
  if (absl::ConsumePrefix(&peer, "ipv4:")) return absl::StartsWith(peer, "127.");
  if (absl::ConsumePrefix(&peer, "ipv6:")) {
    return absl::StartsWith(peer, "[::1]") || absl::StartsWith(peer, "[::ffff:127.");
  }
  return false;
}

bool IsLoopbackAddress(const std::string& address) {
  if (absl::StartsWith(address, "unix:")) return true;
  std::string host = address;
  if (!host.empty() && host.front() == '[') {
    host = host.substr(1, host.find(']') - 1);
  } else if (auto colon = host.rfind(':'); colon != std::string::npos) {
    host = host.substr(0, colon);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

grpc::Status CheckGroupPeer(const ServiceOptions& options, const grpc::ServerContextBase& context) {
  if (!options.auth_token.empty()) return grpc::Status::OK;  // CheckAuth verified it
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) return grpc::Status::OK;  // mutual TLS
  const std::string peer = context.peer();
  if (IsLoopbackPeer(peer)) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::PERMISSION_DENIED,
      absl::StrCat("group member ", peer,
                   " is not on this host and this daemon has no token: an unauthenticated "
                   "group forms on loopback only -- give every daemon of the group the same "
                   "--auth_token_file (or mutual TLS: --tls_client_ca_file)"));
}

}  // namespace wpub::server
