// The rollout side as the publication engine sees it: the engines a ConnectEngines request
// names, the weight-update group they form, and the connector that forms it (the GPU path's
// rollout group, core/rollout). "Rollout" names the engines that serve the weights (SGLang,
// vLLM); the publication engine is core/engine's Engine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/pause_policy.h"
#include "core/transport/types.h"

namespace wpub::engine {

// One rollout engine of a ConnectEngines request: its HTTP address and its GPUs (TP ranks).
struct RolloutEndpoint {
  std::string url;  // "http://host:port" or "https://host:port"
  int gpus = 1;
  // "sglang" | "vllm" (over NCCL) | "sglang-ipc" | "vllm-ipc" (colocated: the engine runs on
  // this node and reads the buckets in wpub's GPU memory through CUDA IPC); empty: sglang.
  std::string family = "";
};

// The engine families an engine may name (RolloutEndpoint::family).
inline constexpr std::string_view kEngineFamilies[] = {"sglang", "vllm", "sglang-ipc", "vllm-ipc"};
bool IsEngineFamily(std::string_view family);
// A family whose engines read the buckets through CUDA IPC on this node ("...-ipc").
bool IsColocatedFamily(std::string_view family);

struct RolloutConnectRequest {
  std::vector<RolloutEndpoint> engines;           // the new engine set, in rank order
  std::string group_name;                         // base group name; empty keeps the connector's
  absl::Duration timeout = absl::ZeroDuration();  // health probe + join; 0: connector default
  // What every engine of the set does with its requests and cache while paused; unset: the
  // connector's (wpubd --pause). A family that cannot carry it out refuses the request.
  std::optional<PausePolicy> pause;
};

// One engine of the weight-update group as laid out.
struct RolloutEngineInfo {
  std::string url;
  int gpus = 1;
  int rank_offset = 0;  // first rank; the publisher is rank 0
  transport::ReceiverState state = transport::ReceiverState::kIdle;
  // The weight version it reported serving when it joined (0: none or unknown).
  uint64_t weight_version = 0;
  PausePolicy pause;  // what it does while paused
};

// The weight-update group (GPU path).
struct RolloutGroupInfo {
  std::string group_name;  // "<base>_<incarnation>_<generation>"; empty before the first group
  int world_size = 0;      // 1 + sum of the engines' GPUs; 0 before the first group
  uint64_t generation = 0;
  bool healthy = false;  // formed, and no failure seen since
  std::vector<RolloutEngineInfo> engines;
  std::string store_address;  // "host:port" engines rendezvous at
  // The highest weight version any engine reported when it joined: Open refuses versions at
  // or below it (a restarted daemon must not publish backwards).
  uint64_t highest_engine_version = 0;
};

// INVALID_ARGUMENT naming the entry ("engines[2] 'ftp://x': ...") for: no engines, a URL that
// is not http(s)://host[:port] (or holds whitespace), a GPU count outside [1, 4096], a URL
// given twice, a group name with characters other than letters, digits, '_', '-', '.' (or
// longer than 100), a negative timeout. Pure; what Engine::ConnectEngines checks first.
absl::Status ValidateRolloutConnectRequest(const RolloutConnectRequest& request);

// The engine family an engine URL names by its scheme: "vllm+http://h:p" -> ("vllm",
// "http://h:p"), "sglang-ipc+https://..." -> ("sglang-ipc", "https://..."), a plain URL -> ("",
// url) (the caller's default). INVALID_ARGUMENT naming the URL for another "<x>+" prefix.
absl::StatusOr<std::pair<std::string, std::string>> SplitEngineFamily(std::string_view url);

// Forms the weight-update group with a given engine set (the GPU path's NCCL transport).
// Thread-safe: Connect may be called from any thread; it must refuse (FAILED_PRECONDITION)
// while a publication is in flight on its transport. Group never blocks on a Connect in
// progress (it returns the last snapshot).
class RolloutConnector {
 public:
  virtual ~RolloutConnector() = default;
  // Replaces the engine set and forms the group; blocks until every engine joined or one
  // failed. On failure nothing stays connected (see the implementation's contract).
  virtual absl::StatusOr<RolloutGroupInfo> Connect(const RolloutConnectRequest& request) = 0;
  virtual RolloutGroupInfo Group() const = 0;
};

}  // namespace wpub::engine
