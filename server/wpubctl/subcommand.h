// wpubctl's subcommand table entry and the subcommands this binary links. Each subcommand lives
// in its own file and is listed once in main.cc's table.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace wpub::wpubctl {

// Runs a subcommand after absl flags were parsed. `args` are the positional arguments that
// followed the subcommand name. Returns the process exit code.
using SubcommandFn = int (*)(const std::vector<std::string>& args);

struct Subcommand {
  std::string name;     // as typed: `wpubctl <name> [flags]`
  std::string summary;  // for `wpubctl help` and the subcommand's --help
  SubcommandFn run;
  std::vector<std::string> flags;  // the flags it takes (any other is refused)
  int max_positional = 0;          // -1: any number
  int min_positional = 0;
  std::string positional = "";  // its usage line's arguments, e.g. "PATH [PATH]"
};

// policy_report.cc: what the publication policy does to a (synthetic) model.
int RunPolicyReport(const std::vector<std::string>& args);
// demo.cc: the project's main job: wpubd + two wpub-recv, several publications, a report table.
int RunDemo(const std::vector<std::string>& args);
// publish_synthetic.cc: publish a synthetic MoE model to a running wpubd.
int RunPublishSynthetic(const std::vector<std::string>& args);
// status.cc: a running wpubd's status and recent reports.
int RunStatus(const std::vector<std::string>& args);
// status.cc: replay the retained committed version (args: [REASON]).
int RunRestore(const std::vector<std::string>& args);
// connect_engines.cc: ConnectEngines on a running GPU-path wpubd.
int RunConnectEngines(const std::vector<std::string>& args);
// convert.cc: offline HF checkpoint -> NVFP4 checkpoint conversion.
int RunConvert(const std::vector<std::string>& args);
// inspect.cc: what a receiver's file or a checkpoint directory holds (args: PATH).
int RunInspect(const std::vector<std::string>& args);
// inspect.cc: the tensor-by-tensor difference of two of them (args: A B).
int RunDiff(const std::vector<std::string>& args);

}  // namespace wpub::wpubctl
