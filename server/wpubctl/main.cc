// wpubctl entry point: `wpubctl <subcommand> [--flags] [args]`. Dispatches over the table below;
// flags of every subcommand are absl flags parsed once, after the subcommand name is removed.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/wpubctl/subcommand.h"

namespace wpub::wpubctl {
namespace {

// One row per subcommand (each implemented in its own file).
constexpr Subcommand kSubcommands[] = {
    {"policy-report",
     "Plan a synthetic MoE model through the publication policy and print what is quantized, "
     "passed through or ignored, with tensor and byte totals.",
     &RunPolicyReport},
    {"publish-synthetic",
     "Publish a synthetic MoE model (deterministic data; model and policy flags) to a running "
     "wpubd and print each publication's report.",
     &RunPublishSynthetic},
    {"status", "Show a running wpubd's committed version, receivers and recent reports.",
     &RunStatus},
    {"connect-engines",
     "Connect SGLang engines to a running GPU-path wpubd (--engines=http://h:p=gpus,...): form "
     "its NCCL weight-update group and print the ranks.",
     &RunConnectEngines},
    {"demo",
     "The project's main job: start wpubd and two wpub-recv, publish several versions of a "
     "synthetic GLM-like MoE end to end, print a per-publication table, stop cleanly.",
     &RunDemo},
    {"convert", "Convert an HF safetensors checkpoint to NVFP4 (routed experts) for SGLang/vLLM.",
     &RunConvert},
};

std::string Usage() {
  std::string out = "usage: wpubctl <subcommand> [--flags] [args]\n\nsubcommands:\n";
  for (const Subcommand& s : kSubcommands) {
    absl::StrAppend(&out, "  ", s.name, "\n      ", s.summary, "\n");
  }
  absl::StrAppend(&out,
                  "\n`wpubctl <subcommand> --help` lists the flags; `wpubctl help` this text.");
  return out;
}

}  // namespace
}  // namespace wpub::wpubctl

int main(int argc, char** argv) {
  using wpub::wpubctl::kSubcommands;
  const std::string usage = wpub::wpubctl::Usage();
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  // --help lists every flag this binary defines (they all live in server/wpubctl/ or core).
  config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "wpubctl/");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);

  if (argc < 2 || absl::string_view(argv[1]) == "help" || absl::string_view(argv[1]) == "-h") {
    std::fprintf(argc < 2 ? stderr : stdout, "%s\n", usage.c_str());
    return argc < 2 ? 2 : 0;
  }
  const absl::string_view name = argv[1];
  const wpub::wpubctl::Subcommand* chosen = nullptr;
  for (const auto& s : kSubcommands) {
    if (s.name == name) chosen = &s;
  }
  if (chosen == nullptr) {
    // Let `wpubctl --help` and friends reach absl's usage printer.
    if (absl::StartsWith(name, "-")) {
      absl::ParseCommandLine(argc, argv);
      std::fprintf(stderr, "%s\n", usage.c_str());
      return 2;
    }
    std::fprintf(stderr, "wpubctl: unknown subcommand \"%s\"\n\n%s\n", argv[1], usage.c_str());
    return 2;
  }
  // argv without the subcommand name, so absl sees only flags and positional arguments. Flag
  // names are accepted with dashes too (`--model-dir`), the spelling users of HF tools expect;
  // absl flags are declared with underscores.
  std::vector<std::string> storage;
  storage.reserve(argc);
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      for (; i < argc; ++i) storage.emplace_back(argv[i]);
      break;
    }
    if (absl::StartsWith(arg, "--")) {
      const size_t end = std::min(arg.find('='), arg.size());
      std::replace(arg.begin() + 2, arg.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
    }
    storage.push_back(std::move(arg));
  }
  std::vector<char*> rest = {argv[0]};
  for (std::string& a : storage) rest.push_back(a.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(rest.size()), rest.data());
  std::vector<std::string> args(positional.begin() + 1, positional.end());
  return chosen->run(args);
}
