// Value types that cross the boundary between the engine core and its callers (the gRPC server,
// tests, benchmarks): publication inputs and reports (manifests and receiver events are
// core/transport/types.h's). No protobuf
// here; the server maps these one to one onto proto/wpub/v1 messages. All types are plain values
// (copyable, no hidden sharing) and therefore thread-compatible.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/common/tensor.h"
#include "core/transport/types.h"

namespace wpub::engine {

// ---------------------------------------------------------------------------------------------
// Inputs of a publication.
// ---------------------------------------------------------------------------------------------

// The part's bytes follow in AppendInline calls (streamed in bounded chunks). The engine
// allocates a buffer of exactly the part's byte size when the batch is added.
struct InlineSource {};

// A region of a POSIX shared-memory segment, opened with shm_open(O_RDONLY) and mapped
// read-only for the duration of the publication. `name` is the segment name with or without
// one leading '/'; it may not contain any other '/' nor "..". [offset, offset + length) must lie
// inside the segment and `length` must equal the part's byte size.
struct ShmSource {
  std::string name;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A region of a trainer-owned CUDA allocation (cudaIpcMemHandle_t bytes). Served by the GPU
// backend only; the CPU path rejects it with UNIMPLEMENTED naming the tensor.
struct CudaIpcSource {
  std::array<uint8_t, 64> handle{};
  std::string device_uuid;  // "GPU-xxxxxxxx-..." as nvidia-smi prints it, or 16 raw bytes hex.
  uint64_t offset = 0;
  uint64_t length = 0;
};

using PartSource = std::variant<InlineSource, ShmSource, CudaIpcSource>;

// One contiguous, row-major piece of a tensor. Its dtype is the tensor's; its shape equals the
// tensor's full shape except along the tensor's concat_dim.
struct TensorPart {
  PartSource source;
  Shape shape;
};

// A tensor to publish (an HF tensor the trainer's converter produced). The parts, concatenated
// along concat_dim (0 or 1) in order, form `desc.shape`. A single part may use any concat_dim.
struct TensorInput {
  TensorDesc desc;
  std::vector<TensorPart> parts;
  int concat_dim = 0;
};

// One conversion batch: a Megatron parameter and the HF tensors it became, in order. The policy
// decides per batch (gate/up pairs must be complete within one batch).
struct BatchInput {
  std::string megatron_name;
  std::vector<TensorInput> tensors;
};

// A publication group (docs/DESIGN.md, "Publication groups"): `members` daemons publish one
// version together, each the parts its node holds; member 0 is the leader, which coordinates
// the version (core/group) and is the only one to call the engines' lifecycle. Checked by
// ValidateGroupMembership (core/engine/group_vote.h).
struct GroupMembership {
  std::string group;      // letters, digits, '_', '-', '.'; at most 100
  uint32_t members = 1;   // in [1, kMaxGroupMembers]
  uint32_t member = 0;    // this publisher's index, < members; 0 = the leader
  std::string leader;     // the leader's gRPC address ("host:port"); members > 0 need it
  std::string publisher;  // how this publisher is named in errors and reports (the daemon
                          // fills it: hostname and port, unless the trainer gave one)
  // How long the leader waits without progress (a member joining, staging, preparing) before
  // it aborts the version naming the members it waits for; 0: the daemon's default.
  absl::Duration timeout = absl::ZeroDuration();
};
inline constexpr uint32_t kMaxGroupMembers = 1024;

// Opens a publication.
struct PublicationHeader {
  // Strictly greater than the last committed version (0 = none yet). An aborted or failed
  // version may be retried.
  uint64_t version = 0;
  std::string model_id;
  // "bf16" (publish every tensor in its source precision), "nvfp4" (standard, E = 448), or
  // "nvfp4_4over6[:<mode>]" where mode lists, separated by '-' or '_', any of: the error metric
  // "mae" | "mse", the scale max "e448" | "e256" (or "448" | "256"), the error kind "exact" |
  // "fp16" (also "fp16err"); omitted parts take TE's defaults (mae, e256, exact), e.g.
  // "nvfp4_4over6:mse-e448-fp16". Anything else: INVALID_ARGUMENT naming `recipe`.
  std::string recipe = "nvfp4";
  // HF `quantization_config` JSON (quant_algo/quant_method, ignore, exclude_modules). May be
  // empty (no ignore rules).
  std::string quantization_config_json;
  // Precision exceptions (policy spec): extra_high_precision_layers_megatron,
  // first_last_layers_bf16, num_layers_at_start_in_bf16, num_layers_at_end_in_bf16, num_layers.
  // May be empty.
  std::string policy_json;
  // When false (default), a non-finite element in any floating-point tensor rejects the
  // publication before commit (INVALID_ARGUMENT naming the tensor).
  bool allow_non_finite = false;
  // 0 = EngineOptions::bucket_bytes.
  uint64_t bucket_bytes = 0;
  // Free the backend's memory once this publication ended (Backend::ReleaseMemory), as
  // EngineOptions::release_backend_memory does after every publication.
  bool release_backend_memory = false;
  // When another publication is active: false -> FAILED_PRECONDITION at once; true -> Open
  // blocks until it ends or `queue_timeout` passes (then DEADLINE_EXCEEDED).
  bool queue = false;
  absl::Duration queue_timeout = absl::Minutes(5);
  // Set when this publication is one member's part of a group version.
  std::optional<GroupMembership> group;
};

enum class PublicationStatus : uint8_t {
  kCommitted,  // every receiver has every bucket and was told to apply it
  kAborted,    // a receiver/transport failure, a cancellation, or shutdown; inputs were valid
  kFailed,     // bad input (the Status returned to the caller says which tensor/field)
};
// "committed", "aborted", "failed" (the wpub_publications_total{status} label values).
const char* PublicationStatusName(PublicationStatus status);

// Seconds per executor phase. On the CPU path the phases run one after another on the
// publishing thread (pull receivers read concurrently); the GPU backend overlaps quantize/pack
// with transfer, so there the sum may exceed the wall clock.
struct PhaseSeconds {
  double ingest = 0;    // Open .. Commit called, less policy time: batches, inline bytes, shm
  double policy = 0;    // per-batch policy plans (during ingest) and bucket planning
  double quantize = 0;  // amax, global scales, block quantization into buckets
  double pack = 0;      // non-finite scan of passed tensors, passthrough copies, checksums
  double transfer = 0;  // handing buckets to the transport, waiting for every acknowledgement
  double commit = 0;    // the commit broadcast and bookkeeping
  double group = 0;     // a group member waiting for its leader (the parts check, its transfer
                        // turn, the decision); 0 outside a group
};
// The phase label values, in pipeline order: ingest, policy, quantize, pack, transfer, commit,
// group.
inline constexpr std::array<const char*, 7> kPhaseNames = {"ingest",   "policy", "quantize", "pack",
                                                           "transfer", "commit", "group"};
// The value of `phase` (one of kPhaseNames), 0 for an unknown name.
double PhaseValue(const PhaseSeconds& seconds, std::string_view phase);

// One member of a group version, as the leader saw it.
struct GroupMemberSummary {
  uint32_t member = 0;
  std::string publisher;
  // "waiting" (not joined), "joined", "staged", "transferring", "prepared", "failed",
  // "committed", "aborted".
  std::string state = "waiting";
  uint64_t tensors = 0;    // input tensors it published
  uint64_t bytes_in = 0;   // their bytes
  uint64_t bytes_out = 0;  // its buckets' bytes
  uint32_t buckets = 0;
  bool engines = false;  // it sends to NCCL engines (its transfers are serialized)
  PhaseSeconds phases;   // its own phases (from its prepare)
  double seconds = 0;    // join .. prepared, on the leader's clock
  std::string error;     // why it failed
};

// A group version. On a member other than the leader, `members_detail` is empty.
struct GroupSummary {
  std::string group;
  uint64_t version = 0;
  uint32_t members = 1;
  uint32_t member = 0;  // the member whose report this is
  std::string leader;
  std::string outcome;  // "open", "committed", "aborted"
  std::string error;
  std::vector<GroupMemberSummary> members_detail;  // leader only, by member index
  int32_t slowest_member = -1;                     // the last to prepare (leader only)
  int32_t failed_member = -1;                      // the member whose failure aborted it
  // The leader's coordination cost: the barriers' bookkeeping between the last member's
  // staged/prepared message and the instruction that followed, summed (seconds).
  double coordination_seconds = 0;
};

struct PublicationReport {
  PublicationStatus status = PublicationStatus::kFailed;
  uint64_t version = 0;
  std::string model_id;
  std::string recipe;
  absl::StatusCode code = absl::StatusCode::kOk;  // why it did not commit (kOk when committed)
  std::string error;                              // the message of `code`
  absl::Time started_at = absl::InfinitePast();
  double wall_seconds = 0;
  PhaseSeconds phases;
  uint64_t host_syncs = 0;  // synchronizing device calls (0 on the CPU path)
  uint64_t bytes_in = 0;    // sum of input tensor bytes
  uint64_t bytes_out = 0;   // sum of bucket bytes
  // bytes_out by format: "nvfp4" for the three outputs of quantized tensors, the torch dtype
  // name ("bfloat16", "float32", ...) for passed-through tensors.
  std::map<std::string, uint64_t> bytes_out_by_format;
  // Input tensors by policy action (disjoint: the three add up to the inputs).
  uint64_t tensors_quantized = 0;    // quantized to NVFP4
  uint64_t tensors_passthrough = 0;  // published in source precision, no ignore rule involved
  uint64_t tensors_ignored = 0;      // published in source precision because a rule matched
  uint64_t non_finite = 0;           // non-finite input elements seen
  uint32_t buckets = 0;
  std::vector<transport::ReceiverOutcome> receivers;
  // Transfers of the version (1 unless an attempt that left receivers dirty was retried;
  // EngineOptions::max_attempts) and why each attempt before the last one failed.
  uint32_t attempts = 0;
  std::vector<std::string> retry_errors;
  // A group version: the group and, on the leader, every member's part.
  std::optional<struct GroupSummary> group;
};

// The active publication, as GetStatus shows it.
enum class PublicationState : uint8_t { kOpen, kStaged, kCommitted, kAborted };
const char* PublicationStateName(PublicationState state);  // "open", "staged", ...

struct ActivePublication {
  uint64_t version = 0;
  std::string model_id;
  PublicationState state = PublicationState::kOpen;
  absl::Time opened_at = absl::InfinitePast();
  uint64_t batches = 0;
  uint64_t tensors = 0;
  uint64_t bytes_ingested = 0;  // input tensor bytes taken so far
  uint64_t bytes_sent = 0;      // bucket bytes handed to the transports so far (this attempt)
  uint32_t buckets_sent = 0;
};

// A replay of the retained committed version (core/engine/replay.h).
enum class ReplayKind : uint8_t {
  kRestore,  // engines an abort left dirty, or an operator's request (wpubctl restore)
  kCatchUp,  // engines or receivers that joined holding an older version
};
const char* ReplayKindName(ReplayKind kind);  // "restore", "catch_up"

struct ReplayReport {
  ReplayKind kind = ReplayKind::kRestore;
  uint64_t version = 0;    // the committed version replayed
  std::string trigger;     // why it ran ("v8 aborted leaving engines dirty: ...", ...)
  bool completed = false;  // every participant holds the version and was told to apply it
  bool preempted = false;  // a trainer's publication or a ConnectEngines took the slot
  std::string error;       // why it did not complete ("" when it did)
  absl::Time started_at = absl::InfinitePast();
  double seconds = 0;  // slot taken .. the last commit call returned
  uint64_t bytes = 0;  // bucket bytes sent
  uint32_t buckets = 0;
  std::vector<transport::ReceiverOutcome> receivers;  // the participants' outcomes
};

struct EngineStatus {
  uint64_t committed_version = 0;  // 0 = nothing committed yet
  std::string committed_model_id;
  absl::Time committed_at = absl::InfinitePast();
  std::optional<ActivePublication> active;
  std::vector<transport::ReceiverInfo> receivers;
  std::vector<PublicationReport>
      last_reports;  // newest first, at most EngineOptions::status_reports
  bool shutting_down = false;
  std::string backend;                     // "cpu"
  uint64_t backend_held_bytes = 0;         // Backend::held_bytes: its buffers kept now
  transport::RetainedCopyInfo retained;    // the retained copy of the committed version
  std::vector<ReplayReport> last_replays;  // newest first, at most EngineOptions::status_reports
  int queued_publications = 0;             // Opens waiting for the active one (header.queue)
};

}  // namespace wpub::engine
