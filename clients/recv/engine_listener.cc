// The engine roles' shared HTTP listener over cpp-httplib.
#include "clients/recv/engine_listener.h"

#include <httplib.h>

#include "absl/strings/str_cat.h"
#include "core/common/listen_socket.h"

namespace wpub::recv {
namespace {

constexpr size_t kKeepAliveRequests = size_t{1} << 20;
constexpr size_t kServerThreads = 32;

}  // namespace

void AnswerOtherMethods(httplib::Server& server, const std::string& path) {
  auto refuse = [](const httplib::Request&, httplib::Response& r) {
    r.status = 405;
    r.set_header("Allow", "POST");
    r.set_content(R"({"detail":"Method Not Allowed"})", "application/json");
  };
  server.Get(path, refuse);
  server.Put(path, refuse);
}

absl::StatusOr<int> ServeEngineHttp(httplib::Server& server, const std::string& host, int port,
                                    absl::string_view what, std::thread* thread) {
  server.set_tcp_nodelay(true);
  server.set_socket_options(ExclusiveListenSocketOptions);  // a second engine cannot share it
  server.set_payload_max_length(kEngineMaxRequestBytes);
  server.set_keep_alive_max_count(kKeepAliveRequests);
  server.new_task_queue = [] { return new httplib::ThreadPool(kServerThreads); };
  const int bound =
      port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat(what, ": cannot listen on ", host, ":", port,
                                               " (in use by another process?)"));
  }
  *thread = std::thread([&server] { server.listen_after_bind(); });
  return bound;
}

}  // namespace wpub::recv
