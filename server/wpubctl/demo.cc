// `wpubctl demo`: the project's main job, run by `deploy/dev.sh demo`. Until the publication
// daemon exists it is the policy report on a GLM-like synthetic model; the daemon's end-to-end
// publication demo replaces it.
#include <cstdio>

#include "server/wpubctl/subcommand.h"

namespace wpub::wpubctl {

int RunDemo(const std::vector<std::string>& args) {
  std::printf(
      "wpub demo: publication policy report for a GLM-like synthetic MoE model\n"
      "(the end-to-end publication demo replaces this once the daemon lands)\n\n");
  return RunPolicyReport(args);
}

}  // namespace wpub::wpubctl
