// An engine of several ranks whose GPUs repeat a device (a TP engine on one shared GPU, see
// shared_gpu.h): NCCL refuses two ranks of one process on one device, so every rank runs as a
// process of its own -- the receiver binary re-executed with that rank's single GPU, on an
// ephemeral port, with a host identity of its own -- and this process serves the engine's HTTP
// routes in front of them, as SGLang's server hands each request to the schedulers of all its
// TP ranks:
//   POST <route>   sent to every rank at once (an update's broadcast needs all of them);
//                  /init_weights_update_group's rank_offset becomes rank_offset + i for rank i.
//                  200 when every rank answers 200, else the first failing rank's status and
//                  body (a rank that cannot be reached: 502 naming it).
//   GET /health    200 when every rank answers it.
//   GET /stats     rank 0's record when every rank recorded the same buckets, bytes and
//                  checksums for every version; 500 naming the first difference otherwise.
//   GET <other>    rank 0's answer.
// A rank that exits takes the engine down (every other rank, then this process, SIGKILLed), as an
// SGLang server exits when a scheduler dies; ranks die with this process (PR_SET_PDEATHSIG).
#pragma once

#include <string>
#include <vector>

namespace wpub::testing {

// Serves `port` in front of one rank process per entry of `devices`: `self` (this binary) is
// run as `self 0 <device> <rank_args...>` and must print "... on :<port> ..." as its first line
// on stdout once serving. Returns only on a startup failure (its exit code); otherwise the
// process ends when a rank exits or it is killed.
int RunRankProcesses(const std::string& self, int port, const std::vector<int>& devices,
                     const std::vector<std::string>& rank_args);

}  // namespace wpub::testing
