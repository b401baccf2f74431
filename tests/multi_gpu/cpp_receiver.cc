// A C++ receiving engine for the multi-GPU tests: nccl::ReceiverEndpoint (SGLang's weight-update
// routes over nccl::GroupMember, the NCCL data path of a C++ receiver) plus GET /stats, so wpub is
// tested end to end without Python or SGLang. /stats returns
// {"<version>": {"buckets": n, "bytes": b, "checksums": [...], "decode_seconds": ..,
// "wait_seconds": .., "receive_seconds": .., "receive_device_seconds": ..}} (checksums:
// core/engine/checksum.h; the rest: nccl::ReceiverVersionStats).
// Usage: multi_gpu_cpp_receiver <port> <gpu>[,<gpu>...] [host|device] [die_after_buckets]
//                               [nccl_ctas]
//   several GPUs: one group rank each, as the TP ranks of one engine;
//   host|device: where checksums are computed (after a copy of every bucket to the host, the
//   default, or on the device with nothing copied);
//   die_after_buckets: SIGKILL itself after receiving that many buckets (fault tests; -1: never);
//   nccl_ctas: ReceiverEndpointOptions::nccl_ctas (0, the default: NCCL's choice).
#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_split.h"
#include "core/nccl/receiver_endpoint.h"
#include "nlohmann/json.hpp"

int main(int argc, char** argv) {
  if (argc < 3 || argc > 6) {
    std::fprintf(stderr,
                 "usage: %s port gpu[,gpu...] [host|device] [die_after_buckets] [nccl_ctas]\n",
                 argv[0]);
    return 2;
  }
  const std::string mode = argc >= 4 ? argv[3] : "host";
  // Fault injection: SIGKILL itself once this many buckets (all versions) were received.
  const long die_after = argc >= 5 ? std::atol(argv[4]) : -1;
  if (mode != "host" && mode != "device") {
    std::fprintf(stderr, "checksum mode must be host or device, not %s\n", mode.c_str());
    return 2;
  }
  const int port = std::atoi(argv[1]);
  wpub::nccl::ReceiverEndpointOptions o;
  o.port = 0;  // the routes; /stats is served on `port` below with them proxied there
  o.devices.clear();
  for (const absl::string_view d : absl::StrSplit(argv[2], ',')) {
    o.devices.push_back(std::atoi(std::string(d).c_str()));
  }
  o.join_timeout = absl::Seconds(60);
  o.copy_to_host = mode == "host";
  o.nccl_ctas = argc == 6 ? std::atoi(argv[5]) : 0;
  wpub::nccl::ReceiverEndpoint::Callbacks callbacks;
  long received = 0;
  callbacks.on_bucket = [&](const wpub::nccl::ReceivedBucket&) {
    if (++received == die_after) {
      std::printf("dying after %ld buckets\n", received);
      std::fflush(stdout);
      ::kill(::getpid(), SIGKILL);
    }
  };
  auto endpoint = wpub::nccl::ReceiverEndpoint::Start(o, std::move(callbacks));
  if (!endpoint.ok()) {
    std::fprintf(stderr, "%s\n", endpoint.status().ToString().c_str());
    return 3;
  }
  // One public port: /stats here, every other route forwarded to the endpoint.
  const int inner = (*endpoint)->port();
  httplib::Server srv;
  srv.Get("/stats", [&](const httplib::Request&, httplib::Response& res) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [v, s] : (*endpoint)->stats()) {
      j[v] = {{"buckets", s.buckets},
              {"bytes", s.bytes},
              {"checksums", s.checksums},
              {"decode_seconds", s.decode_seconds},
              {"wait_seconds", s.wait_seconds},
              {"receive_seconds", s.receive_seconds},
              {"receive_device_seconds", s.receive_device_seconds}};
    }
    res.set_content(j.dump(), "application/json");
  });
  auto forward = [inner](const httplib::Request& req, httplib::Response& res) {
    httplib::Client c("127.0.0.1", inner);
    c.set_tcp_nodelay(true);
    c.set_read_timeout(600, 0);
    httplib::Result r =
        req.method == "GET" ? c.Get(req.path) : c.Post(req.path, req.body, "application/json");
    if (!r) {
      res.status = 502;
      return;
    }
    res.status = r->status;
    res.set_content(r->body, "application/json");
  };
  srv.Get(R"(/(?!stats).*)", forward);
  srv.Post(R"(/.*)", forward);
  srv.set_tcp_nodelay(true);
  std::printf("cpp receiver on :%d (endpoint :%d) gpus %s, checksums on the %s\n", port, inner,
              argv[2], mode.c_str());
  std::fflush(stdout);
  srv.listen("127.0.0.1", port);
  return 0;
}
