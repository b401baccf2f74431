// Ignore-rule evaluation for one publication: 1,888 literal rules x 96,000 GLM-like weight names
// (the figures of the production GLM publication the snapshot was made for), literal snapshot vs
// the ordered scan, in one run. Prints ns/lookup, the whole-pass time and the ratio; both paths
// must agree on every name (checked before timing; the matched count is reported per row).
// Also: the cost of planning a whole GLM-4.5-like publication through the policy.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "absl/strings/str_cat.h"
#include "core/policy/policy.h"
#include "core/synthetic/synthetic.h"

namespace wpub::policy {
namespace {

constexpr size_t kNumRules = 1888;
constexpr size_t kNumNames = 96000;

struct Workload {
  std::vector<std::string> names;
  std::vector<std::string> rules;
};

// The first 96,000 HF names of a GLM-like model (256 routed experts per layer, enough layers),
// in publication order; and a modelopt-style ignore list: every module that is not a routed
// expert, then DSA indexer modules per layer, up to 1,888 literal rules.
const Workload& GetWorkload() {
  static const Workload* const w = [] {
    auto* out = new Workload;
    synthetic::ModelShape shape = synthetic::ModelShape::GlmLike();
    shape.num_experts = 256;
    shape.num_layers = 128;
    auto model = synthetic::SyntheticModel::Create(shape);
    if (!model.ok()) std::abort();
    for (const synthetic::ConversionBatch& b : model->batches()) {
      for (const TensorDesc& t : b.tensors) {
        if (out->names.size() < kNumNames) out->names.push_back(t.name);
      }
    }
    out->rules = synthetic::HighPrecisionModules(*model);
    if (out->rules.size() > kNumRules) out->rules.resize(kNumRules);
    for (int layer = 0; out->rules.size() < kNumRules; ++layer) {
      for (const char* m : {"wq_b", "wk", "k_norm", "weights_proj"}) {
        if (out->rules.size() < kNumRules) {
          out->rules.push_back(absl::StrCat("model.layers.", layer, ".self_attn.indexer.", m));
        }
      }
    }
    if (out->names.size() != kNumNames || out->rules.size() != kNumRules) std::abort();
    return out;
  }();
  return *w;
}

template <typename Matcher>
int64_t Pass(const Matcher& m, const std::vector<std::string>& names) {
  int64_t matched = 0;
  for (const std::string& n : names) matched += m.Matches(n);
  return matched;
}

template <typename Matcher>
void RunPasses(benchmark::State& state, const Matcher& m) {
  const Workload& w = GetWorkload();
  int64_t matched = 0;
  for (auto _ : state) {
    matched = Pass(m, w.names);
    benchmark::DoNotOptimize(matched);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * w.names.size()));
  state.counters["matched"] = static_cast<double>(matched);
  state.counters["rules"] = static_cast<double>(w.rules.size());
}

void BM_SnapshotPass(benchmark::State& state) {
  const Workload& w = GetWorkload();
  auto literal = LiteralRuleList::Create(w.rules);
  const LiteralIgnoreSnapshot snapshot(*literal);
  RunPasses(state, snapshot);
}

void BM_OrderedScanPass(benchmark::State& state) {
  const Workload& w = GetWorkload();
  auto scan = RegexIgnoreRules::Create(w.rules);
  RunPasses(state, *scan);
}

// Building the snapshot once per rule list (what a cache miss costs).
void BM_SnapshotBuild(benchmark::State& state) {
  const Workload& w = GetWorkload();
  for (auto _ : state) {
    auto literal = LiteralRuleList::Create(w.rules);
    LiteralIgnoreSnapshot snapshot(*literal);
    benchmark::DoNotOptimize(snapshot);
  }
}

// Planning a whole GLM-4.5-like publication (29,638 batches, 44,503 tensors) with its default
// modelopt ignore list: what the daemon spends in the policy per publication.
void BM_PlanGlmPublication(benchmark::State& state) {
  auto model = synthetic::SyntheticModel::Create(synthetic::ModelShape::GlmLike());
  PolicySettings settings;
  settings.quantization.quant_algo = "NVFP4";
  settings.quantization.ignore_rules = synthetic::HighPrecisionModules(*model);
  auto policy = Policy::Create(settings);
  if (!model.ok() || !policy.ok()) std::abort();
  int64_t outputs = 0;
  for (auto _ : state) {
    outputs = 0;
    for (const synthetic::ConversionBatch& b : model->batches()) {
      auto plan = (*policy)->PlanBatch(b.megatron_name, b.tensors);
      outputs += static_cast<int64_t>(plan->outputs.size());
    }
    benchmark::DoNotOptimize(outputs);
  }
  state.SetItemsProcessed(state.iterations() * model->num_tensors());
  state.counters["outputs"] = static_cast<double>(outputs);
}

BENCHMARK(BM_SnapshotPass)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_OrderedScanPass)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SnapshotBuild)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PlanGlmPublication)->Unit(benchmark::kMillisecond);

// Console output plus a closing summary: the ratio of the two passes measured in this run.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Iteration && r.iterations > 0) {
        pass_ms_[r.benchmark_name()] = r.real_accumulated_time * 1e3 / r.iterations;
        cpu_ms_[r.benchmark_name()] = r.cpu_accumulated_time * 1e3 / r.iterations;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
  void Summarize() const {
    auto snap = pass_ms_.find("BM_SnapshotPass");
    auto scan = pass_ms_.find("BM_OrderedScanPass");
    if (snap == pass_ms_.end() || scan == pass_ms_.end()) return;
    const double snap_cpu = cpu_ms_.at("BM_SnapshotPass");
    const double scan_cpu = cpu_ms_.at("BM_OrderedScanPass");
    std::printf(
        "\nsummary: %zu literal rules x %zu names, one pass each (wall; CPU in parentheses)\n"
        "  snapshot:     %8.3f ms/pass (%.3f)  %8.1f ns/lookup (%.1f)\n"
        "  ordered scan: %8.1f ms/pass (%.1f)  %8.1f ns/lookup (%.1f)\n"
        "  speed-up: %.0fx wall, %.0fx CPU; goal (pass < 50 ms, >= 100x): %s\n",
        kNumRules, kNumNames, snap->second, snap_cpu, snap->second * 1e6 / kNumNames,
        snap_cpu * 1e6 / kNumNames, scan->second, scan_cpu, scan->second * 1e6 / kNumNames,
        scan_cpu * 1e6 / kNumNames, scan->second / snap->second, scan_cpu / snap_cpu,
        snap->second < 50.0 && scan->second / snap->second >= 100.0 ? "met" : "NOT met");
  }

 private:
  std::map<std::string, double> pass_ms_;
  std::map<std::string, double> cpu_ms_;
};

}  // namespace
}  // namespace wpub::policy

int main(int argc, char** argv) {
  using namespace wpub::policy;
  benchmark::Initialize(&argc, argv);
  // Equivalence on this very workload before anything is timed.
  const Workload& w = GetWorkload();
  auto literal = LiteralRuleList::Create(w.rules);
  const LiteralIgnoreSnapshot snapshot(*literal);
  auto scan = RegexIgnoreRules::Create(w.rules);
  for (const std::string& n : w.names) {
    if (snapshot.Matches(n) != scan->Matches(n)) {
      std::fprintf(stderr, "snapshot and ordered scan disagree on %s\n", n.c_str());
      return 1;
    }
  }
  SummaryReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.Summarize();
  benchmark::Shutdown();
  return 0;
}
