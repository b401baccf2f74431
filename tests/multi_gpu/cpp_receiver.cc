// A C++ receiving engine for the multi-GPU tests: wpub::recv::nccl::ReceiverEndpoint (SGLang's
// weight-update routes over wpub::recv::nccl::GroupMember, the NCCL data path of a C++ receiver,
// and GET /stats), so wpub is tested end to end without Python or SGLang. Usage:
// multi_gpu_cpp_receiver <port> <gpu>[,<gpu>...] [host|device] [die_after_buckets]
//                               [nccl_ctas]
//   several GPUs: one group rank each, as the TP ranks of one engine; a list that repeats a
//   device (a TP engine on one shared GPU) runs each rank as a process of its own behind this
//   one (rank_processes.h), since NCCL refuses two ranks of one process on one device;
//   host|device|kept: where checksums are computed (after a copy of every bucket to the host,
//   the default, or on the device with nothing copied), or kept: every bucket kept on the
//   device and bucket patches taken against it (ReceiverEndpointOptions::keep_weights, as
//   wpub-recv --engine_patches);
//   die_after_buckets: SIGKILL itself after receiving that many buckets (fault tests; -1: never);
//   nccl_ctas: ReceiverEndpointOptions::nccl_ctas (0, the default: NCCL's choice).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <algorithm>
#include <vector>

#include "absl/strings/str_split.h"
#include "clients/recv/nccl/receiver_endpoint.h"
#include "tests/multi_gpu/rank_processes.h"

int main(int argc, char** argv) {
  if (argc < 3 || argc > 6) {
    std::fprintf(stderr,
                 "usage: %s port gpu[,gpu...] [host|device|kept] [die_after_buckets] [nccl_ctas]\n",
                 argv[0]);
    return 2;
  }
  const std::string mode = argc >= 4 ? argv[3] : "host";
  // Fault injection: SIGKILL itself once this many buckets (all versions) were received.
  const long die_after = argc >= 5 ? std::atol(argv[4]) : -1;
  if (mode != "host" && mode != "device" && mode != "kept") {
    std::fprintf(stderr, "checksum mode must be host, device or kept, not %s\n", mode.c_str());
    return 2;
  }
  const int port = std::atoi(argv[1]);
  wpub::recv::nccl::ReceiverEndpointOptions o;
  o.port = port;
  o.devices.clear();
  for (const absl::string_view d : absl::StrSplit(argv[2], ',')) {
    o.devices.push_back(std::atoi(std::string(d).c_str()));
  }
  std::vector<int> sorted = o.devices;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    return wpub::testing::RunRankProcesses("/proc/self/exe", port, o.devices,
                                           std::vector<std::string>(argv + 3, argv + argc));
  }
  o.join_timeout = absl::Seconds(60);
  o.copy_to_host = mode == "host";
  o.keep_weights = mode == "kept";
  o.nccl_ctas = argc == 6 ? std::atoi(argv[5]) : 0;
  wpub::recv::nccl::ReceiverEndpoint::Callbacks callbacks;
  long received = 0;
  callbacks.on_bucket = [&](const wpub::recv::nccl::ReceivedBucket&) {
    if (++received == die_after) {
      std::printf("dying after %ld buckets\n", received);
      std::fflush(stdout);
      ::kill(::getpid(), SIGKILL);
    }
  };
  auto endpoint = wpub::recv::nccl::ReceiverEndpoint::Start(o, std::move(callbacks));
  if (!endpoint.ok()) {
    std::fprintf(stderr, "%s\n", endpoint.status().ToString().c_str());
    return 3;
  }
  std::printf("cpp receiver on :%d gpus %s, checksums on the %s\n", (*endpoint)->port(), argv[2],
              mode.c_str());
  std::fflush(stdout);
  for (;;) ::pause();  // serves until killed
}
