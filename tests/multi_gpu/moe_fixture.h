// Shared pieces of the multi-GPU tests and the GPU-path benchmark: a synthetic MoE laid out in
// one allocation (Qwen3-MoE names: attention and norms in BF16, routed experts quantized with
// gate/up pairs), deterministic values, the execution plan the engine would build for it, one
// publication driven through a Backend and a Transport as the engine's session does, and
// child processes (the SGLang emulator, the CUDA IPC trainer) with pipes.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/backend.h"
#include "core/transport/transport.h"

namespace wpub::testing {

struct MoeShape {
  int layers = 2;
  int experts = 8;
  int64_t hidden = 256;
  int64_t inter = 128;  // per expert
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 64;
  bool embeddings = false;  // embed_tokens/lm_head of vocab x hidden (benchmark: off)
  int64_t vocab = 1024;
};

struct ModelTensor {
  std::string name;
  DType dtype = DType::kBFloat16;
  Shape shape;
  uint64_t offset = 0;  // in the model's allocation (256-byte aligned)
  uint64_t nbytes = 0;
  bool quantize = false;  // routed-expert weight
  int pair = -1;          // for up_proj: the index of its gate_proj
};

struct ModelLayout {
  std::vector<ModelTensor> tensors;
  uint64_t total_bytes = 0;
  uint64_t expert_bytes = 0;
};

ModelLayout LayoutModel(const MoeShape& shape);

// The benchmarks' model: shaped like Qwen3-30B-A3B (48 layers, 128 routed experts of
// [768, 2048], hidden 2048, 32 heads, 4 KV heads of 128).
MoeShape Qwen3MoeShape();

// Deterministic bf16 values for `seed` (a function of seed, tensor and element index).
void FillHost(const ModelLayout& layout, uint64_t seed, uint8_t* base);

// The plan the engine builds for these inputs: NVFP4 (standard) for expert weights when
// `nvfp4`, everything else (or everything) passed through; buckets by transport::PlanBuckets.
// `inputs` (one part per tensor at base + offset) must outlive the plan.
struct BuiltPlan {
  engine::ExecutionPlan plan;
  transport::PublicationManifest manifest;
  uint64_t bytes_out = 0;
};
// `memory` is what ingestion would know about `base` (kDevice: as CUDA IPC parts are); the
// default leaves the GPU backend to query every part.
absl::StatusOr<BuiltPlan> BuildPlan(const ModelLayout& layout, const uint8_t* base, bool nvfp4,
                                    uint64_t bucket_bytes, uint64_t version,
                                    std::vector<engine::InputTensor>* inputs,
                                    engine::PartMemory memory = engine::PartMemory::kUnknown);

// One publication as core/engine/session.cc drives it: Begin, Execute (emit -> Send),
// WaitAcknowledged, Commit (through a transport group of `transport` alone); Abort on any
// failure.
struct PublishResult {
  absl::Status status;
  double wall_seconds = 0;
  // Where the wall clock went: Transport::Begin, Backend::Execute, WaitAcknowledged, Commit.
  double begin_seconds = 0, execute_seconds = 0, acknowledge_seconds = 0, commit_seconds = 0;
  // std::chrono::steady_clock nanoseconds when Execute returned (every broadcast complete on this
  // side), to compare with a receiver's timestamps on the same host.
  int64_t executed_ns = 0;
  uint64_t host_syncs = 0;
  std::vector<transport::ReceiverOutcome> outcomes;
};
PublishResult Publish(engine::Backend& backend, transport::Transport& transport,
                      const BuiltPlan& built, absl::Duration ack_deadline);

// A child process with stdin/stdout pipes (stderr inherited, or to `log_path`), in this
// process's environment with the "NAME=value" entries of `env` set or replaced.
class Child {
 public:
  static absl::StatusOr<std::unique_ptr<Child>> Spawn(const std::vector<std::string>& argv,
                                                      const std::string& log_path, bool pipes,
                                                      const std::vector<std::string>& env = {});
  ~Child();  // SIGKILL if still running, then reaps
  pid_t pid() const { return pid_; }
  absl::Status WriteLine(const std::string& line);
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  bool Running();
  void Kill();

 private:
  Child() = default;
  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  std::string buffer_;
  bool reaped_ = false;
};

// Paths: WPUB_SOURCE_DIR (the repository root), WPUB_PYTHON (default python3), sibling
// binaries of the running test.
std::string SourceDir();
std::string Python();
std::string SiblingBinary(const std::string& name);
int FreePort();
// A fresh folder for the running test's files: under WPUB_TEST_LOG_DIR (kept, named after the
// test) when set, else a new /tmp/<prefix>XXXXXX. Empty when it cannot be made.
std::string TestWorkDir(const std::string& prefix, const std::string& test_name);

// Polls `port`'s /health until it answers (OK), `child` exits first (FAILED_PRECONDITION naming
// `what` and `log_path`) or `timeout` passes (DEADLINE_EXCEEDED naming `what`).
absl::Status WaitForHealth(Child& child, int port, absl::Duration timeout, const std::string& what,
                           const std::string& log_path);

// Spawns tests/multi_gpu/cpp_receiver.cc's binary (`binary`, or multi_gpu_cpp_receiver next to
// the running one when empty) serving `port` with one group rank per GPU of `gpus`, `args` after
// them (checksum mode, die_after_buckets, nccl_ctas), with the "NAME=value" entries of `env` in
// its environment (OwnNcclHostEnv when it shares the publisher's GPU). Returns at once, so
// several engines start together: wait for each with WaitForHealth.
absl::StatusOr<std::unique_ptr<Child>> SpawnCppReceiver(int port, const std::vector<int>& gpus,
                                                        const std::vector<std::string>& args,
                                                        const std::string& log_path,
                                                        const std::string& binary = "",
                                                        const std::vector<std::string>& env = {});

// Starts tests/multi_gpu/sglang_emulator.py on `gpu` (with `extra` arguments and the "NAME=value"
// entries of `env` in its environment) and waits for /health.
absl::StatusOr<std::unique_ptr<Child>> StartEmulator(int port, int gpu,
                                                     const std::vector<std::string>& extra,
                                                     const std::string& log_path,
                                                     const std::vector<std::string>& env = {});
// GET `path` on 127.0.0.1:port; the body.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);
// POST a JSON body; the response body (any HTTP status; OK only for 200).
absl::StatusOr<std::string> HttpPost(int port, const std::string& path, const std::string& body,
                                     absl::Duration timeout);

}  // namespace wpub::testing
