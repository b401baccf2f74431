// The HTTP listener of every engine role wpub-recv plays -- SGLang's weight-update routes
// (nccl/receiver_endpoint.h) and vLLM's (vllm_engine.h) -- so both take the same request bound
// and serve a publisher's connections the same way.
#pragma once

#include <cstddef>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace httplib {
class Server;
}

namespace wpub::recv {

// Largest request body an engine route takes: an update request lists one bucket's names,
// dtypes and shapes (thousands of tensors); nothing legitimate is larger.
inline constexpr size_t kEngineMaxRequestBytes = size_t{64} << 20;

// Configures `server`, whose routes are added, binds host:port (port 0: a free one) and serves
// it on `*thread` until server.stop(). Settings: TCP_NODELAY; bodies up to
// kEngineMaxRequestBytes; keep-alive without a request limit (a publisher keeps one
// connection per request lane for a whole publication, and httplib's default of 5 requests
// made each reconnection delay the request behind it); 32 handler threads (httplib holds a
// thread per open connection until it idles out, and a publisher keeps up to 8 -- wpubd
// --engine_requests_in_flight -- beside probes and readers, whatever the host's cores).
// Returns the bound port; UNAVAILABLE naming `what` and the address when it cannot be bound.
// Answers GET and PUT on `path` (a POST route of `server`) as FastAPI answers a method a route
// does not take: 405 {"detail": "Method Not Allowed"} with an Allow header. Publishers probe an
// engine's routes this way (a route it lacks answers 404).
void AnswerOtherMethods(httplib::Server& server, const std::string& path);

absl::StatusOr<int> ServeEngineHttp(httplib::Server& server, const std::string& host, int port,
                                    absl::string_view what, std::thread* thread);

}  // namespace wpub::recv
