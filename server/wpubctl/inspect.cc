// `wpubctl inspect PATH` and `wpubctl diff A B`: what a published version (a receiver's
// --output file) or a checkpoint directory holds, and how two of them differ (core/inspect).
// Exit codes: inspect 0, or 1 when a check found something an engine would reject; diff 0 when
// every tensor is identical, 1 when any differs; both 2 for a usage error or unreadable input.
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "core/inspect/inspect.h"
#include "server/common/log_escape.h"
#include "server/wpubctl/subcommand.h"

ABSL_FLAG(std::string, output_format, "text", "inspect/diff output: text or json.");
ABSL_DECLARE_FLAG(int32_t, cpu_threads);  // convert.cc
ABSL_FLAG(bool, tensors, false, "inspect --output_format=text: also list every tensor.");
ABSL_FLAG(int64_t, max_rows, 50,
          "diff --output_format=text: tensors listed that are not identical (-1: all).");
ABSL_FLAG(bool, common_only, false,
          "diff: compare only the tensors both sides hold (one side's extra tensors are listed "
          "but do not count), e.g. an offline conversion with input_scale against a live "
          "publication of the same weights, which carries none.");

namespace wpub::wpubctl {
namespace {

bool FormatFlag(const char* sub, bool* json) {
  const std::string f = absl::GetFlag(FLAGS_output_format);
  if (f != "text" && f != "json") {
    std::fprintf(stderr, "wpubctl %s: --output_format must be text or json, got \"%s\"\n", sub,
                 f.c_str());
    return false;
  }
  *json = f == "json";
  return true;
}

std::unique_ptr<inspect::Snapshot> OpenOrPrint(const char* sub, const std::string& path) {
  absl::StatusOr<std::unique_ptr<inspect::Snapshot>> s = inspect::Snapshot::Open(path);
  if (!s.ok()) {
    std::fprintf(stderr, "wpubctl %s: %s\n", sub, server::LogEscape(s.status().ToString()).c_str());
    return nullptr;
  }
  return *std::move(s);
}

// The text reports are for a terminal and every string in them may come from the file (names,
// metadata, the problems that quote them): each is escaped as log lines are, so a name holding
// an escape sequence or a newline can neither drive the terminal nor forge a line. The JSON
// reports keep them exact.
void Escape(std::string& text) { text = server::LogEscape(text); }

void EscapeAll(std::vector<std::string>& texts) {
  for (std::string& t : texts) Escape(t);
}

std::map<std::string, std::string> Escaped(const std::map<std::string, std::string>& m) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : m) out.emplace(server::LogEscape(k), server::LogEscape(v));
  return out;
}

inspect::Inventory ForText(inspect::Inventory inv) {
  Escape(inv.path);
  inv.metadata = Escaped(inv.metadata);
  Escape(inv.quant_algo);
  if (inv.exclude_modules) EscapeAll(*inv.exclude_modules);
  EscapeAll(inv.files);
  for (inspect::TensorRow& t : inv.tensors) {
    for (std::string* f : {&t.name, &t.dtype, &t.module, &t.reason, &t.file}) Escape(*f);
  }
  for (inspect::Nvfp4Module& m : inv.modules) Escape(m.name);
  EscapeAll(inv.problems);
  return inv;
}

inspect::DiffReport ForText(inspect::DiffReport r) {
  Escape(r.path_a);
  Escape(r.path_b);
  for (inspect::TensorDiff& t : r.tensors) {
    for (std::string* f : {&t.name, &t.dtype_a, &t.dtype_b}) Escape(*f);
  }
  std::map<std::string, std::pair<std::string, std::string>> changes;
  for (const auto& [k, v] : r.config_changes) {
    changes.emplace(server::LogEscape(k),
                    std::make_pair(server::LogEscape(v.first), server::LogEscape(v.second)));
  }
  r.config_changes = std::move(changes);
  return r;
}

void WriteOut(const std::string& out) { std::fwrite(out.data(), 1, out.size(), stdout); }

}  // namespace

int RunInspect(const std::vector<std::string>& args) {
  bool json = false;
  if (!FormatFlag("inspect", &json)) return 2;
  std::unique_ptr<inspect::Snapshot> s = OpenOrPrint("inspect", args.at(0));
  if (s == nullptr) return 2;
  const inspect::Inventory inv = inspect::Inspect(*s, absl::GetFlag(FLAGS_cpu_threads));
  WriteOut(json ? inspect::InventoryJson(inv)
                : inspect::FormatInventory(ForText(inv), absl::GetFlag(FLAGS_tensors)));
  return inv.problems.empty() ? 0 : 1;
}

int RunDiff(const std::vector<std::string>& args) {
  bool json = false;
  if (!FormatFlag("diff", &json)) return 2;
  std::unique_ptr<inspect::Snapshot> a = OpenOrPrint("diff", args.at(0));
  if (a == nullptr) return 2;
  std::unique_ptr<inspect::Snapshot> b = OpenOrPrint("diff", args.at(1));
  if (b == nullptr) return 2;
  inspect::DiffReport r = inspect::Diff(*a, *b, absl::GetFlag(FLAGS_cpu_threads));
  r.common_only = absl::GetFlag(FLAGS_common_only);
  WriteOut(json ? inspect::DiffJson(r)
                : inspect::FormatDiff(ForText(r), absl::GetFlag(FLAGS_max_rows)));
  return r.identical() ? 0 : 1;
}

}  // namespace wpub::wpubctl
