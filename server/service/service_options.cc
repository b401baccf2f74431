// Bearer-token check for wpubd's RPCs.
#include "server/service/service_options.h"

#include <string_view>

namespace wpub::server {
namespace {

// Constant-time comparison so the token cannot be guessed byte by byte from timings.
bool SecureEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

grpc::Status CheckAuth(const ServiceOptions& options, const grpc::ServerContextBase& context) {
  if (options.auth_token.empty()) return grpc::Status::OK;
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing 'authorization: Bearer <token>' metadata");
  }
  std::string_view value(it->second.data(), it->second.size());
  constexpr std::string_view kPrefix = "Bearer ";
  if (value.substr(0, kPrefix.size()) != kPrefix ||
      !SecureEquals(value.substr(kPrefix.size()), options.auth_token)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
  }
  return grpc::Status::OK;
}

}  // namespace wpub::server
