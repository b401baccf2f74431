// Client-side transport security for wpubd's gRPC API (what wpubctl, wpub-recv and the tests
// use; the Python client has the same options): TLS when a CA certificate is given -- the
// daemon's certificate (wpubd --tls_cert_file) must chain to it -- with a client certificate and
// key for mutual TLS (wpubd --tls_client_ca_file); plaintext otherwise. Files are PEM.
#pragma once

#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace wpub::wire {

struct ClientTls {
  std::string ca_file;    // empty: plaintext
  std::string cert_file;  // with key_file: presented to a daemon that verifies clients
  std::string key_file;
};

// INVALID_ARGUMENT when cert_file and key_file are not given together or are given without
// ca_file; NOT_FOUND naming the file when one cannot be read or is empty.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientTls& tls);

}  // namespace wpub::wire
