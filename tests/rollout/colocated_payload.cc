// Prints what wpubd sends a colocated SGLang engine (TensorUpdateBody) and a colocated vLLM
// engine (VllmIpcUpdateBody) for one bucket, with the
// bucket's layout and bytes, for tests/python/test_colocated_wire.py to load with torch's and
// SGLang's own code: {"body": "...", "tp": N, "nbytes": n, "bucket_hex": "...",
// "tensors": [{name, dtype, shape, offset, nbytes}], "shared": {...}}.
// With --tensors=N the bucket holds N tensors laid out as routed experts' NVFP4 triples (packed
// weight, fp8 block scales, fp32 global scale; small shapes) instead, for
// bench/rollout/colocated_decode.py to time what an engine's decode costs per tensor.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/escaping.h"
#include "core/rollout/sglang_driver.h"
#include "core/rollout/torch_ipc.h"
#include "core/rollout/vllm_driver.h"
#include "nlohmann/json.hpp"

namespace {

// n tensors: expert e's weight [16, 8] uint8, weight_scale [16, 1] fp8, weight_scale_2 [] fp32.
void ExpertTriples(int n, wpub::transport::BucketManifest& m) {
  using wpub::DType;
  uint64_t at = 0;
  for (int i = 0; i < n; ++i) {
    const std::string base = "model.layers." + std::to_string(i / 1152) + ".mlp.experts." +
                             std::to_string(i / 9 % 128) + "." +
                             (i / 3 % 3 == 0   ? "gate_proj"
                              : i / 3 % 3 == 1 ? "up_proj"
                                               : "down_proj");
    switch (i % 3) {
      case 0:
        m.tensors.push_back({base + ".weight", DType::kUInt8, {16, 8}, at, 128});
        at += 128;
        break;
      case 1:
        m.tensors.push_back({base + ".weight_scale", DType::kFloat8E4M3, {16, 1}, at, 16});
        at += 16;
        break;
      default:
        m.tensors.push_back({base + ".weight_scale_2", DType::kFloat32, {}, at, 4});
        at += 4;
    }
  }
  m.nbytes = at;
}

}  // namespace

int main(int argc, char** argv) {
  using wpub::DType;
  wpub::transport::BucketManifest m;
  m.index = 2;
  int many = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--tensors=", 0) == 0) {
      many = std::atoi(a.c_str() + 10);
    } else {
      std::fprintf(stderr, "usage: %s [--tensors=N]\n", argv[0]);
      return 2;
    }
  }
  if (many > 0) {
    ExpertTriples(many, m);
  } else {
    // Mixed dtypes as the planner lays them out (back to back, the largest element size first),
    // a 0-d scale among them.
    m.tensors.push_back(
        {"model.layers.0.mlp.experts.0.down_proj.weight_scale_2", DType::kFloat32, {}, 0, 4});
    m.tensors.push_back(
        {"model.layers.0.self_attn.o_proj.weight", DType::kBFloat16, {4, 6}, 4, 48});
    m.tensors.push_back(
        {"model.layers.0.mlp.experts.0.down_proj.weight", DType::kUInt8, {8, 16}, 52, 128});
    m.tensors.push_back({"model.layers.0.mlp.experts.0.down_proj.weight_scale",
                         DType::kFloat8E4M3,
                         {8, 2},
                         180,
                         16});
    m.nbytes = 196;
  }
  std::string bucket(m.nbytes, '\0');
  for (size_t i = 0; i < bucket.size(); ++i) bucket[i] = static_cast<char>((i * 37 + 11) & 0xff);
  wpub::transport::SharedDeviceBytes s;
  s.mem_handle = std::string(64, '\0');
  for (int i = 0; i < 64; ++i) s.mem_handle[i] = static_cast<char>(i + 1);
  s.event_handle = std::string(64, '\x7f');
  s.allocation_bytes = 1 << 20;
  s.offset_bytes = 8192;
  s.nbytes = m.nbytes;
  s.device = 0;
  s.device_uuid = "GPU-0A1b2C3d-4e5f-6071-8293-a4b5c6d7e8f9";
  s.ref_counter = "/wpub_42_feedbeef";
  s.ref_counter_offset = 100;
  const int tp = 2;
  absl::StatusOr<std::string> body = wpub::rollout::TensorUpdateBody(m, s, tp, /*first_slot=*/3);
  if (!body.ok()) {
    std::fprintf(stderr, "%s\n", body.status().ToString().c_str());
    return 1;
  }
  s.node_device_uuids = {"GPU-0A1b2C3d-4e5f-6071-8293-a4b5c6d7e8f9",
                         "GPU-11111111-2222-3333-4444-555555555555"};
  absl::StatusOr<std::string> vllm_body =
      wpub::rollout::VllmIpcUpdateBody(m, s, s.ref_counter_offset, /*packed_per_update=*/false);
  if (!vllm_body.ok()) {
    std::fprintf(stderr, "%s\n", vllm_body.status().ToString().c_str());
    return 1;
  }
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : m.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", std::string(wpub::DTypeName(t.dtype))},
                       {"shape", t.shape},
                       {"offset", t.offset},
                       {"nbytes", t.nbytes}});
  }
  nlohmann::json out = {{"body", *body},
                        {"vllm_body", *vllm_body},
                        {"tp", tp},
                        {"first_slot", 3},
                        {"nbytes", m.nbytes},
                        {"bucket_hex", absl::BytesToHexString(bucket)},
                        {"tensors", tensors},
                        {"shared",
                         {{"mem_handle_hex", absl::BytesToHexString(s.mem_handle)},
                          {"event_handle_hex", absl::BytesToHexString(s.event_handle)},
                          {"offset_bytes", s.offset_bytes},
                          {"device_uuid", s.device_uuid},
                          {"ref_counter", s.ref_counter},
                          {"ref_counter_offset", s.ref_counter_offset}}}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
