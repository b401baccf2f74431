// The bytes' side of a weight-update group, as the rollout group (core/rollout/rollout_group.h)
// drives it:
// rank 0 of a group of engine ranks, one publication at a time, each bucket broadcast to every
// rank, and a watchdog that ends the publication on the first failure (its own, a peer's, or the
// deadline). NCCL is the one used in production (core/nccl/nccl_transport.h: NcclTransport);
// CPU tests give the group a channel of their own, so the group's formation, publication,
// abort, re-formation and dirty-engine logic runs against engine fakes without a GPU.
//
// Thread-safety: Fail, failure and usable are safe from any thread; the rest is called by the
// publication thread (or a group formation, which the rollout group serializes with
// publications).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/transport/bucket.h"

namespace wpub::transport {

// What one publication's watchdog watches besides the channel itself.
struct PublicationWatch {
  absl::Time deadline = absl::InfiniteFuture();
  std::string deadline_message;  // the failure's message when the deadline passes
  // Polled by the watchdog: a non-OK status (a peer failed, e.g. an engine's HTTP answer) fails
  // the publication with it. May be null.
  std::function<absl::Status()> peer_failure;
  // Appended to the error when the group is not ready before the first broadcast (e.g. the
  // rendezvous keys peers asked for). May be null.
  std::function<std::string()> not_ready_detail;
  // The bucket update requests every engine answered so far in this publication (the fewest of
  // any engine): a colocated channel whose engines copy a bucket before they answer its request
  // releases bucket k once this exceeds k. May be null.
  std::function<uint64_t()> updates_answered;
};

using GroupId = std::array<uint8_t, 128>;  // NCCL's ncclUniqueId bytes

// A device bucket handed over in GPU memory to receivers on the same node (a colocated channel:
// GroupChannel::Share), described as torch describes a CUDA tensor it shares between processes
// (torch/multiprocessing/reductions.py, reduce_tensor; docs/specs/engines.md, "Colocated
// engines"): the receiver opens the allocation with cudaIpcOpenMemHandle, waits on the event
// before reading, and, once it no longer reads the bytes, decrements its slot of the shared
// reference counter. No CUDA types: the handles are their bytes.
struct SharedDeviceBytes {
  std::string mem_handle;         // cudaIpcMemHandle_t (64 bytes) of the allocation
  uint64_t allocation_bytes = 0;  // the allocation's size
  uint64_t offset_bytes = 0;      // where the bucket starts in it
  uint64_t nbytes = 0;            // the bucket's size
  int device = 0;                 // the device's index in the daemon's process
  std::string device_uuid;        // "GPU-8-4-4-4-12 hex" (receivers see other device indices)
  // Every GPU the daemon's process sees, "GPU-..." (vLLM's receivers pick the handle keyed by
  // their own device's UUID; each maps the same allocation, peer to peer on another GPU).
  std::vector<std::string> node_device_uuids;
  std::string event_handle;  // cudaIpcEventHandle_t (64 bytes), recorded once the bytes are final
  std::string ref_counter;   // the shared-memory file of the reference counters ("/name")
  uint64_t ref_counter_offset = 0;  // this bucket's int64 slot in it
};

class GroupChannel {
 public:
  virtual ~GroupChannel() = default;
  // A new group identity for the rendezvous (rank 0's ncclGetUniqueId).
  virtual absl::StatusOr<GroupId> NewId() = 0;
  // Becomes rank 0 of a new group of `world_size` ranks under `id`, without waiting for the
  // other ranks (they join as the engines answer their join); any current group is aborted
  // first. `rank_name` names a rank in errors (e.g. the engine that holds it).
  virtual absl::Status Open(int world_size, const GroupId& id,
                            std::function<std::string(int rank)> rank_name) = 0;
  // Aborts and forgets the current group (none: no-op).
  virtual void Close() = 0;
  // A group is open and was not aborted.
  virtual bool usable() const = 0;
  // What carries the bytes, for the join's log line ("NCCL 2.28.9 (/path/libnccl.so.2)").
  virtual std::string Describe() const = 0;
  // Matches the one-element all-reduce every engine rank runs right after it joined (vLLM's
  // communicators), bounded by `deadline`.
  virtual absl::Status WarmUp(absl::Time deadline) = 0;
  // Starts a publication: forgets the previous one's failure and starts the watchdog.
  virtual void Begin(PublicationWatch watch) = 0;
  // A channel whose receivers read the bucket in place (colocated engines: CUDA IPC) describes
  // it for the update request that carries it (the driver's PostBucket), before Send; nullopt
  // for one that moves the bytes itself (NCCL). The description is valid until Send of the
  // bucket returned and the bucket is released (Send of a later bucket, WaitSent, Close).
  virtual absl::StatusOr<std::optional<SharedDeviceBytes>> Share(const Bucket& /*bucket*/) {
    return std::optional<SharedDeviceBytes>();
  }
  // Broadcasts one bucket as `chunks` (byte sizes in order summing to its size; empty: one
  // broadcast). ABORTED with the failure once the publication failed.
  virtual absl::Status Send(const Bucket& bucket, absl::Span<const uint64_t> chunks) = 0;
  // Waits until rank 0's side of every broadcast of the publication completed.
  virtual absl::Status WaitSent(absl::Time deadline) = 0;
  // Stops the watchdog (the publication ended).
  virtual void End() = 0;
  // Records the publication's first failure and aborts the group. Any thread.
  virtual void Fail(absl::Status why) = 0;
  virtual absl::Status failure() const = 0;
};

}  // namespace wpub::transport
