// Channel credentials from PEM files (tls.h).
#include "wire/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace wpub::wire {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  if (!in || ss.str().empty()) {
    return absl::NotFoundError(absl::StrCat(what, " '", path, "' is unreadable or empty"));
  }
  return ss.str();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientTls& tls) {
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "the TLS client certificate and key go together: give both or neither");
  }
  if (tls.ca_file.empty()) {
    if (!tls.cert_file.empty()) {
      return absl::InvalidArgumentError(
          "a TLS client certificate needs the CA that signed the daemon's certificate");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions o;
  absl::StatusOr<std::string> ca = ReadPem(tls.ca_file, "TLS CA file");
  if (!ca.ok()) return ca.status();
  o.pem_root_certs = *std::move(ca);
  if (!tls.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPem(tls.cert_file, "TLS client certificate");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem(tls.key_file, "TLS client key");
    if (!key.ok()) return key.status();
    o.pem_cert_chain = *std::move(cert);
    o.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(o);
}

}  // namespace wpub::wire
