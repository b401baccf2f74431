// `wpubctl policy-report`: plans every conversion batch of a synthetic model through the
// publication policy and prints, per (action, reason), the tensor count and bytes in/out.
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/status.h"
#include "core/policy/policy.h"
#include "core/synthetic/synthetic.h"
#include "nlohmann/json.hpp"
#include "server/wpubctl/model_flags.h"
#include "server/wpubctl/policy_flags.h"
#include "server/wpubctl/subcommand.h"

ABSL_FLAG(std::string, report_format, "table", "policy-report output: table or json.");

namespace wpub::wpubctl {
namespace {

struct Row {
  int64_t tensors = 0;
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
};

struct Report {
  std::map<std::pair<policy::Action, policy::Reason>, Row> rows;
  Row total;
  int64_t batches = 0;
  int64_t amax_groups = 0;
  double plan_ms = 0;
};

absl::StatusOr<Report> PlanModel(const synthetic::SyntheticModel& model,
                                 const policy::Policy& policy) {
  Report r;
  const auto start = std::chrono::steady_clock::now();
  for (const synthetic::ConversionBatch& b : model.batches()) {
    WPUB_ASSIGN_OR_RETURN(policy::BatchPlan plan, policy.PlanBatch(b.megatron_name, b.tensors));
    ++r.batches;
    r.amax_groups += static_cast<int64_t>(plan.amax_groups.size());
    for (size_t i = 0; i < b.tensors.size(); ++i) {
      const policy::TensorPlan& tp = plan.tensors[i];
      Row& row = r.rows[{tp.action, tp.reason}];
      int64_t out = 0;
      for (size_t o = tp.first_output; o < tp.first_output + tp.num_outputs; ++o) {
        out += plan.outputs[o].nbytes();
      }
      for (Row* x : {&row, &r.total}) {
        ++x->tensors;
        x->bytes_in += b.tensors[i].nbytes();
        x->bytes_out += out;
      }
    }
  }
  r.plan_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return r;
}

std::string Gb(int64_t bytes) { return absl::StrFormat("%.3f", static_cast<double>(bytes) / 1e9); }

void PrintTable(const synthetic::SyntheticModel& model, const policy::Policy& policy,
                const policy::IgnoreSnapshotCache& cache, const Report& r) {
  const synthetic::ModelShape& s = model.shape();
  const policy::PolicySettings& ps = policy.settings();
  absl::PrintF(
      "model: %s-like, %d layers (%d dense), %d MTP, %d routed experts, %d shared, hidden %d, "
      "expert intermediate %d, %s\n",
      synthetic::NamingStyleName(s.style), s.num_layers, s.first_k_dense, s.num_mtp_layers,
      s.num_experts, s.num_shared_experts, s.hidden_size, s.moe_intermediate_size,
      DTypeName(s.dtype));
  absl::PrintF("policy: recipe %s, quant_algo \"%s\", quant_method \"%s\", %d ignore rules (%s)",
               policy::RecipeName(ps.recipe), ps.quantization.quant_algo,
               ps.quantization.quant_method, ps.quantization.ignore_rules.size(),
               policy.ignore_matcher().uses_snapshot() ? "literal snapshot" : "ordered scan");
  if (ps.exceptions.first_last_layers_bf16) {
    absl::PrintF(", BF16 layers: first %d, last %d of %d",
                 ps.exceptions.num_layers_at_start_in_bf16, ps.exceptions.num_layers_at_end_in_bf16,
                 ps.exceptions.num_layers);
  }
  if (!ps.exceptions.extra_high_precision_layers_megatron.empty()) {
    absl::PrintF(", %d extra high-precision substrings",
                 ps.exceptions.extra_high_precision_layers_megatron.size());
  }
  absl::PrintF("\n\n%-14s %-22s %10s %14s %14s\n", "action", "reason", "tensors", "GB in",
               "GB out");
  for (const auto& [key, row] : r.rows) {
    absl::PrintF("%-14s %-22s %10d %14s %14s\n", policy::ActionName(key.first),
                 policy::ReasonName(key.second), row.tensors, Gb(row.bytes_in), Gb(row.bytes_out));
  }
  absl::PrintF("%-14s %-22s %10d %14s %14s\n", "total", "", r.total.tensors, Gb(r.total.bytes_in),
               Gb(r.total.bytes_out));
  absl::PrintF(
      "\n%d conversion batches, %d global-amax groups; bytes out / in = %.4f; planned in %.1f ms "
      "(ignore snapshot cache: %d hits, %d misses)\n",
      r.batches, r.amax_groups,
      r.total.bytes_in ? static_cast<double>(r.total.bytes_out) / r.total.bytes_in : 0.0, r.plan_ms,
      cache.hits(), cache.misses());
}

void PrintJson(const synthetic::SyntheticModel& model, const policy::Policy& policy,
               const Report& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& [key, row] : r.rows) {
    rows.push_back({{"action", std::string(policy::ActionName(key.first))},
                    {"reason", std::string(policy::ReasonName(key.second))},
                    {"tensors", row.tensors},
                    {"bytes_in", row.bytes_in},
                    {"bytes_out", row.bytes_out}});
  }
  const nlohmann::json doc = {
      {"model", std::string(synthetic::NamingStyleName(model.shape().style))},
      {"recipe", std::string(policy::RecipeName(policy.settings().recipe))},
      {"ignore_rules", policy.settings().quantization.ignore_rules.size()},
      {"ignore_snapshot", policy.ignore_matcher().uses_snapshot()},
      {"rows", rows},
      {"total",
       {{"tensors", r.total.tensors},
        {"bytes_in", r.total.bytes_in},
        {"bytes_out", r.total.bytes_out}}},
      {"batches", r.batches},
      {"amax_groups", r.amax_groups},
      {"plan_ms", r.plan_ms}};
  std::printf("%s\n", doc.dump(2).c_str());
}

absl::Status Run(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy-report takes no positional arguments, got \"", args[0], "\""));
  }
  const std::string format = absl::GetFlag(FLAGS_report_format);
  if (format != "table" && format != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("--report_format must be table or json, got \"", format, "\""));
  }
  WPUB_ASSIGN_OR_RETURN(synthetic::ModelShape shape, ModelShapeFromFlags());
  WPUB_ASSIGN_OR_RETURN(synthetic::SyntheticModel model, synthetic::SyntheticModel::Create(shape));
  WPUB_ASSIGN_OR_RETURN(policy::PolicySettings settings, PolicySettingsFromFlags(model));
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<policy::IgnoreSnapshotCache> cache,
                        policy::IgnoreSnapshotCache::Create({}));
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<policy::Policy> policy,
                        policy::Policy::Create(std::move(settings), cache.get()));
  WPUB_ASSIGN_OR_RETURN(Report report, PlanModel(model, *policy));
  if (format == "json") {
    PrintJson(model, *policy, report);
  } else {
    PrintTable(model, *policy, *cache, report);
  }
  return absl::OkStatus();
}

}  // namespace

int RunPolicyReport(const std::vector<std::string>& args) {
  absl::Status status = Run(args);
  if (!status.ok()) {
    std::fprintf(stderr, "wpubctl policy-report: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace wpub::wpubctl
