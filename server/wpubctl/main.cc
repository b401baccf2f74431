// wpubctl entry point: `wpubctl <subcommand> [--flags] [args]`. Dispatches over the table below;
// each subcommand takes only its own flags (cli/command_line.h parses them, --help lists
// them).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cli/build_info.h"
#include "cli/command_line.h"
#include "server/wpubctl/subcommand.h"

namespace wpub::wpubctl {
namespace {

// Flag sets several subcommands share.
const std::vector<std::string> kDaemonFlags = {
    "target", "auth_token_file", "tls_ca_file", "tls_cert_file", "tls_key_file", "connect_timeout"};
const std::vector<std::string> kModelFlags = {
    "model_style",        "num_layers",     "first_k_dense", "num_experts",
    "num_shared_experts", "num_mtp_layers", "hidden_size",   "moe_intermediate_size",
    "intermediate_size",  "vocab_size",     "model_dtype"};
const std::vector<std::string> kPolicyFlags = {"policy_settings",
                                               "recipe",
                                               "quantization_config",
                                               "extra_high_precision_layers_megatron",
                                               "extra_high_precision_layers_hf",
                                               "first_last_layers_bf16",
                                               "num_layers_at_start_in_bf16",
                                               "num_layers_at_end_in_bf16"};
const std::vector<std::string> kPublishFlags = {"chunk_bytes",
                                                "payload",
                                                "parts",
                                                "concat_dim",
                                                "seed",
                                                "model_id",
                                                "bucket_bytes",
                                                "allow_non_finite",
                                                "release_gpu_memory"};

std::vector<std::string> Join(std::initializer_list<std::vector<std::string>> sets) {
  std::vector<std::string> all;
  for (const auto& s : sets) all.insert(all.end(), s.begin(), s.end());
  return all;
}

// One row per subcommand (each implemented in its own file).
const std::vector<Subcommand>& Subcommands() {
  static const auto* table = new std::vector<Subcommand>{
      {"policy-report",
       "Plan a synthetic MoE model through the publication policy and print what is quantized, "
       "passed through or ignored, with tensor and byte totals.",
       &RunPolicyReport, Join({kModelFlags, kPolicyFlags, {"report_format"}})},
      {"publish-synthetic",
       "Publish a synthetic MoE model (deterministic data; model and policy flags) to a running "
       "wpubd and print each publication's report.",
       &RunPublishSynthetic,
       Join({kDaemonFlags, kPublishFlags, kModelFlags, kPolicyFlags, {"version", "count"}})},
      {"status", "Show a running wpubd's committed version, receivers and recent reports.",
       &RunStatus, Join({kDaemonFlags, {"reports"}})},
      {"restore",
       "Replay a running wpubd's retained committed version (--retain) to every engine, "
       "restoring the ones an abort left dirty, and to every receiver behind it.",
       &RunRestore, Join({kDaemonFlags, {"restore_timeout_seconds"}}), 1, 0, "[REASON]"},
      {"connect-engines",
       "Connect SGLang or vLLM engines to a running GPU-path wpubd "
       "(--engines=http://h:p=gpus,vllm+http://h:p,...): form its NCCL weight-update group and "
       "print the ranks.",
       &RunConnectEngines,
       Join({kDaemonFlags, {"engines", "group_name", "pause", "join_timeout"}})},
      {"demo",
       "The project's main job: start wpubd and two wpub-recv, publish several versions of a "
       "synthetic GLM-like MoE end to end, print a per-publication table, stop cleanly.",
       &RunDemo,
       Join({kModelFlags,
             {"demo_dir", "demo_receivers", "demo_versions", "wpubd_path", "recv_path"}})},
      {"convert",
       "Convert an HF safetensors checkpoint to NVFP4 (routed experts) for SGLang/vLLM.",
       &RunConvert,
       {"model_dir", "save_dir", "device", "four_over_six_metric", "four_over_six_e4m3_max",
        "four_over_six_error", "cpu_threads", "staging_mb", "progress", "recipe", "quant_algo",
        "extra_high_precision_layers_hf", "num_layers_at_start_in_bf16",
        "num_layers_at_end_in_bf16"}},
      {"inspect",
       "What a published version (a wpub-recv --output file) or a checkpoint directory holds: "
       "tensors, formats, bytes, checksums and a digest, which modules are NVFP4 and why the "
       "rest is not, and what an engine's NVFP4 loader would reject (exit code 1 then).",
       &RunInspect,
       {"output_format", "tensors", "cpu_threads"},
       1,
       1,
       "PATH"},
      {"diff",
       "The tensor-by-tensor difference of two published versions or checkpoints (files or "
       "directories, in any sharding): identical, changed bytes (how many elements, the largest "
       "difference of the values, dequantized for NVFP4), changed dtype or shape, one side only; "
       "metadata and quantization config changes. Exit code 0 when every tensor is identical "
       "(with --common_only: every tensor both sides hold).",
       &RunDiff,
       {"output_format", "max_rows", "cpu_threads", "common_only"},
       2,
       2,
       "A B"},
  };
  return *table;
}

std::string Usage() {
  std::string out = "usage: wpubctl <subcommand> [--flags] [args]\n\nsubcommands:\n";
  for (const Subcommand& s : Subcommands()) {
    absl::StrAppend(&out, "  ", s.name, "\n      ", s.summary, "\n");
  }
  absl::StrAppend(&out,
                  "\n`wpubctl <subcommand> --help` lists its flags; `wpubctl help` this text; "
                  "`wpubctl --version` the build's version.");
  return out;
}

// The safetensors files inspect, diff and convert read are mapped into memory: one truncated
// (or replaced) by another process while it is read makes the next access fault with SIGBUS.
// That is reported as what it is, and the command exits 1, instead of dying with a signal.
void ExplainBusErrors() {
  struct sigaction sa {};
  sa.sa_handler = [](int) {
    static constexpr char kWhy[] =
        "wpubctl: a file being read was truncated or replaced by another process while it was "
        "read (SIGBUS on its memory mapping), so what it reported or wrote is incomplete: run it "
        "again once the file is complete\n";
    ssize_t ignored = ::write(STDERR_FILENO, kWhy, sizeof(kWhy) - 1);
    (void)ignored;
    ::_exit(1);
  };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace
}  // namespace wpub::wpubctl

int main(int argc, char** argv) {
  using wpub::wpubctl::Subcommands;
  wpub::wpubctl::ExplainBusErrors();
  const std::string usage = wpub::wpubctl::Usage();
  if (argc < 2) {
    std::fprintf(stderr, "%s\n", usage.c_str());
    return 2;
  }
  const std::string name = argv[1];
  if (name == "help" || name == "-h" || name == "--help" || name == "--helpfull") {
    std::fprintf(stdout, "%s\n", usage.c_str());
    return 0;
  }
  if (name == "--version" || name == "version") {
    std::fprintf(stdout, "%s\n", wpub::cli::VersionLine("wpubctl").c_str());
    return 0;
  }
  const wpub::wpubctl::Subcommand* chosen = nullptr;
  for (const auto& s : Subcommands()) {
    if (s.name == name) chosen = &s;
  }
  if (chosen == nullptr) {
    std::fprintf(stderr, "wpubctl: unknown subcommand \"%s\"\n\n%s\n", argv[1], usage.c_str());
    return 2;
  }
  wpub::cli::Command command;
  command.program = "wpubctl";
  command.name = "wpubctl " + chosen->name;
  command.summary = chosen->summary;
  command.flags = chosen->flags;
  command.max_positional = chosen->max_positional;
  command.min_positional = chosen->min_positional;
  command.positional = chosen->positional;
  command.environment = wpub::cli::ClientEnvironment();  // as the Python client reads them
  // Dashes in flag names (`--model-dir`, the spelling of HF tools) read as underscores.
  const wpub::cli::Parsed parsed =
      wpub::cli::Parse(command, std::vector<std::string>(argv + 2, argv + argc));
  if (parsed.exit_code >= 0) return parsed.exit_code;
  return chosen->run(parsed.positional);
}
