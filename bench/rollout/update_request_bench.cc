// One bucket's weight-update request (the flattened-bucket body of
// `/update_weights_from_distributed`): 3,300 tensors, what a 1 GiB NVFP4 bucket of a
// Qwen3-30B-A3B-like model carries (1,100 expert weights, each packed codes, block scales and
// weight_scale_2). Encoding on the publisher and decoding on a C++ engine with
// core/rollout/update_request.h, against building and reading an nlohmann::json document of the
// same request, in one run. Both decoders are checked to return the same tensors first. Also the
// colocated engine's body of the same bucket (BM_ColocatedTensorBody).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/rollout/sglang_driver.h"
#include "core/rollout/update_request.h"
#include "nlohmann/json.hpp"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

std::vector<transport::ManifestTensor> Bucket() {
  std::vector<transport::ManifestTensor> ts;
  for (int e = 0; e < 1100; ++e) {
    const std::string base = "model.layers." + std::to_string(17 + e / 384) + ".mlp.experts." +
                             std::to_string(e % 128) +
                             (e % 3 == 0   ? ".gate_proj."
                              : e % 3 == 1 ? ".up_proj."
                                           : ".down_proj.");
    ts.push_back({base + "weight", DType::kUInt8, {2048, 384}, 0, 0});
    ts.push_back({base + "weight_scale", DType::kFloat8E4M3, {2048, 48}, 0, 0});
    ts.push_back({base + "weight_scale_2", DType::kFloat32, {}, 0, 0});
  }
  uint64_t off = 0;
  for (auto& t : ts) {
    t.offset = off;
    t.nbytes = static_cast<uint64_t>(NumElements(t.shape) * DTypeSize(t.dtype));
    off += t.nbytes;
  }
  return ts;
}

UpdateRequestFields Fields() {
  UpdateRequestFields f;
  f.group_name = "wpub_weights_1";
  f.weight_version = "1234";
  f.sequence = 7;
  return f;
}

// The same body through a json document: what the driver and the engine did before.
std::string EncodeDom(const std::vector<transport::ManifestTensor>& ts,
                      const UpdateRequestFields& f) {
  json names = json::array(), dtypes = json::array(), shapes = json::array();
  for (const auto& t : ts) {
    names.push_back(t.name);
    dtypes.push_back(std::string(DTypeName(t.dtype)));
    shapes.push_back(t.shape);
  }
  json j = {{"names", std::move(names)},    {"dtypes", std::move(dtypes)},
            {"shapes", std::move(shapes)},  {"group_name", f.group_name},
            {"flush_cache", f.flush_cache}, {"weight_version", f.weight_version},
            {"load_format", f.load_format}, {"wpub_sequence", f.sequence}};
  return j.dump();
}

std::vector<transport::ManifestTensor> DecodeDom(const std::string& body) {
  const json j = json::parse(body);
  const json &n = j["names"], &d = j["dtypes"], &s = j["shapes"];
  std::vector<transport::ManifestTensor> out(n.size());
  uint64_t off = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    out[i].name = n[i].get<std::string>();
    out[i].dtype = *ParseDType(d[i].get<std::string>());
    for (const json& e : s[i]) out[i].shape.push_back(e.get<int64_t>());
    out[i].offset = off;
    out[i].nbytes = static_cast<uint64_t>(NumElements(out[i].shape) * DTypeSize(out[i].dtype));
    off += out[i].nbytes;
  }
  return out;
}

void BM_Encode(benchmark::State& state) {
  const auto ts = Bucket();
  const auto f = Fields();
  size_t bytes = 0;
  for (auto _ : state) {
    std::string body = EncodeUpdateRequest(ts, f);
    bytes = body.size();
    benchmark::DoNotOptimize(body);
  }
  state.counters["body_bytes"] = static_cast<double>(bytes);
}
BENCHMARK(BM_Encode)->Unit(benchmark::kMicrosecond);

void BM_EncodeJsonDocument(benchmark::State& state) {
  const auto ts = Bucket();
  const auto f = Fields();
  for (auto _ : state) benchmark::DoNotOptimize(EncodeDom(ts, f));
}
BENCHMARK(BM_EncodeJsonDocument)->Unit(benchmark::kMicrosecond);

void BM_Decode(benchmark::State& state) {
  const std::string body = EncodeUpdateRequest(Bucket(), Fields());
  for (auto _ : state) benchmark::DoNotOptimize(DecodeUpdateRequest(body));
}
BENCHMARK(BM_Decode)->Unit(benchmark::kMicrosecond);

void BM_DecodeJsonDocument(benchmark::State& state) {
  const std::string body = EncodeUpdateRequest(Bucket(), Fields());
  for (auto _ : state) benchmark::DoNotOptimize(DecodeDom(body));
}
BENCHMARK(BM_DecodeJsonDocument)->Unit(benchmark::kMicrosecond);

// The same bucket handed over in GPU memory to a colocated SGLang engine of TP=range(0): the
// /update_weights_from_tensor body (a pickle per rank, base64, JSON), built on the publication
// thread for every bucket.
void BM_ColocatedTensorBody(benchmark::State& state) {
  transport::BucketManifest m;
  m.tensors = Bucket();
  m.nbytes = m.tensors.back().offset + m.tensors.back().nbytes;
  transport::SharedDeviceBytes s;
  s.mem_handle = std::string(64, '\1');
  s.event_handle = std::string(64, '\2');
  s.nbytes = m.nbytes;
  s.device_uuid = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9";
  s.ref_counter = "/wpub_1_feedbeef";
  size_t bytes = 0;
  for (auto _ : state) {
    absl::StatusOr<std::string> body = TensorUpdateBody(m, s, static_cast<int>(state.range(0)), 0);
    bytes = body->size();
    benchmark::DoNotOptimize(body);
  }
  state.counters["body_bytes"] = static_cast<double>(bytes);
}
BENCHMARK(BM_ColocatedTensorBody)->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace wpub::rollout

int main(int argc, char** argv) {
  using namespace wpub::rollout;
  // Both paths agree before anything is timed: the document encoder's body decodes to the
  // bucket, and so does ours, through either decoder.
  const auto want = Bucket();
  const std::string body = EncodeUpdateRequest(want, Fields());
  absl::StatusOr<UpdateRequest> ours = DecodeUpdateRequest(body);
  absl::StatusOr<UpdateRequest> from_dom = DecodeUpdateRequest(EncodeDom(want, Fields()));
  if (!ours.ok() || !from_dom.ok() || ours->tensors != want || from_dom->tensors != want ||
      DecodeDom(body) != want || ours->fields.sequence != 7) {
    std::fprintf(stderr, "the encoders and decoders disagree\n");
    return 1;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
