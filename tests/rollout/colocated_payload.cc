// Prints what wpubd sends a colocated SGLang engine (TensorUpdateBody) and a colocated vLLM
// engine (VllmIpcUpdateBody) for one bucket, with the
// bucket's layout and bytes, for tests/python/test_colocated_wire.py to load with torch's and
// SGLang's own code: {"body": "...", "tp": N, "nbytes": n, "bucket_hex": "...",
// "tensors": [{name, dtype, shape, offset, nbytes}], "shared": {...}}.
#include <cstdio>
#include <string>

#include "absl/strings/escaping.h"
#include "core/rollout/sglang_driver.h"
#include "core/rollout/torch_ipc.h"
#include "core/rollout/vllm_driver.h"
#include "nlohmann/json.hpp"

int main() {
  using wpub::DType;
  wpub::transport::BucketManifest m;
  m.index = 2;
  // Mixed dtypes as the planner lays them out (back to back, the largest element size first),
  // a 0-d scale among them.
  m.tensors.push_back(
      {"model.layers.0.mlp.experts.0.down_proj.weight_scale_2", DType::kFloat32, {}, 0, 4});
  m.tensors.push_back({"model.layers.0.self_attn.o_proj.weight", DType::kBFloat16, {4, 6}, 4, 48});
  m.tensors.push_back(
      {"model.layers.0.mlp.experts.0.down_proj.weight", DType::kUInt8, {8, 16}, 52, 128});
  m.tensors.push_back(
      {"model.layers.0.mlp.experts.0.down_proj.weight_scale", DType::kFloat8E4M3, {8, 2}, 180, 16});
  m.nbytes = 196;
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
