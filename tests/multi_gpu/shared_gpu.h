// Where the engine ranks of a multi-GPU test run, and what lets them share the publisher's GPU.
//
// The publisher (wpub's GPU backend and NCCL rank) always runs on GPU 0. Engines run on
// EngineGpu(): WPUB_TEST_ENGINE_GPU when set, else GPU 1 when the machine has two GPUs, else
// GPU 0 -- the publisher's own. NCCL (2.28) refuses two ranks of one communicator on one device
// only when they report the same host ("Duplicate GPU detected"), and it reads the host identity
// once per process from NCCL_HOSTID. So on a shared GPU every process of a test takes a host
// identity of its own, and NCCL connects the ranks over its socket transport on loopback
// (NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1): the bytes and the protocol are the real ones, the
// bandwidth is a socket's (a few GB/s), never NVLink's. Two ranks inside ONE process cannot
// share a device this way (the identity is per process): a TP engine on a shared GPU runs one
// process per rank (multi_gpu_cpp_receiver does so when its GPU list repeats a device).
//
// Nothing here touches wpubd's production path: the tests set these variables for the processes
// they start (and for themselves, before their first NCCL communicator).
#pragma once

#include <string>
#include <vector>

namespace wpub::testing {

// The GPU the publisher's rank uses.
inline constexpr int kPublisherGpu = 0;

// The GPU engine ranks use (see above); -1 when no CUDA device is visible. A
// WPUB_TEST_ENGINE_GPU naming a device that does not exist is reported on stderr and ignored.
int EngineGpu();

// true when engines on `engine_gpu` share the publisher's GPU.
inline bool SharesPublisherGpu(int engine_gpu) { return engine_gpu == kPublisherGpu; }

// The "NAME=value" entries that give a child process a host identity of its own (a new
// NCCL_HOSTID each call) and NCCL's loopback socket settings; empty when `shared` is false (the
// ranks are on different GPUs and keep NCCL's own transports: P2P, NVLink).
std::vector<std::string> OwnNcclHostEnv(bool shared);

// Gives THIS process a host identity of its own and the loopback socket settings, when
// `shared`. Must run before this process creates its first NCCL communicator (NCCL reads the
// identity once); an NCCL_HOSTID already in the environment is kept.
void AdoptOwnNcclHost(bool shared);

}  // namespace wpub::testing
