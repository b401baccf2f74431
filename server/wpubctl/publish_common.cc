// Shared flags and formatting of the daemon-facing wpubctl subcommands.
#include "server/wpubctl/publish_common.h"

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "cli/bytes.h"
#include "cli/secret_file.h"
#include "core/common/status.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50151", "wpubd gRPC address.");
ABSL_FLAG(std::string, auth_token_file, "", "File holding wpubd's bearer token, if it has one.");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA certificate the daemon's TLS certificate must chain to (TLS; empty: plaintext).");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM client certificate for a daemon that verifies clients (with --tls_key_file).");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(10), "How long to wait for wpubd.");
ABSL_FLAG(wpub::cli::Bytes, chunk_bytes, uint64_t{1} << 20,
          "Inline payload chunk size in bytes (the daemon accepts up to its --max_chunk_bytes).");
ABSL_FLAG(std::string, payload, "inline",
          "How tensor bytes reach wpubd: inline (chunks on the gRPC stream) or shm (one POSIX "
          "shared-memory segment per batch).");
ABSL_FLAG(int32_t, parts, 1,
          "Send each tensor as this many parts (TP-shard style) when its --concat_dim divides.");
ABSL_FLAG(int32_t, concat_dim, 0, "Dimension the parts are concatenated along (0 or 1).");
ABSL_FLAG(uint64_t, seed, 1, "Base seed of the synthetic data (version v uses seed + v).");
ABSL_FLAG(std::string, model_id, "synthetic-moe", "Model identifier put in the header.");
ABSL_FLAG(wpub::cli::Bytes, bucket_bytes, 0, "Bucket size for the publication (0: the daemon's).");
ABSL_FLAG(bool, allow_non_finite, false, "Ask the daemon to publish NaN/Inf weights.");
ABSL_FLAG(bool, release_gpu_memory, false,
          "Ask the daemon to free its GPU staging buffers once each publication ended "
          "(PublicationHeader.release_gpu_memory).");

namespace wpub::wpubctl {

absl::StatusOr<client::ClientOptions> ClientOptionsFromFlags() {
  client::ClientOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  o.connect_timeout = absl::GetFlag(FLAGS_connect_timeout);
  o.fail_fast = true;  // a command line answers at once when nothing listens there
  o.tls.ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  o.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  o.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    WPUB_ASSIGN_OR_RETURN(o.auth_token, cli::ReadSecretFile(path, "--auth_token_file"));
  }
  return o;
}

absl::StatusOr<client::StreamOptions> StreamOptionsFromFlags() {
  client::StreamOptions o;
  o.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes).value;
  if (o.chunk_bytes == 0) return absl::InvalidArgumentError("--chunk_bytes must be > 0");
  const std::string payload = absl::GetFlag(FLAGS_payload);
  if (payload == "inline") {
    o.source = client::PayloadSource::kInline;
  } else if (payload == "shm") {
    o.source = client::PayloadSource::kShm;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--payload must be 'inline' or 'shm', got '", payload, "'"));
  }
  o.parts = absl::GetFlag(FLAGS_parts);
  o.concat_dim = absl::GetFlag(FLAGS_concat_dim);
  if (o.parts < 1) return absl::InvalidArgumentError("--parts must be >= 1");
  if (o.concat_dim != 0 && o.concat_dim != 1) {
    return absl::InvalidArgumentError("--concat_dim must be 0 or 1");
  }
  return o;
}

uint64_t DataSeed(uint64_t version) { return absl::GetFlag(FLAGS_seed) + version; }

std::string QuantizationConfigJson(const policy::QuantizationConfig& config) {
  nlohmann::json j = nlohmann::json::object();
  if (!config.quant_algo.empty()) j["quant_algo"] = config.quant_algo;
  if (!config.quant_method.empty()) j["quant_method"] = config.quant_method;
  if (!config.ignore_rules.empty()) j["ignore"] = config.ignore_rules;
  return j.empty() ? std::string() : j.dump();
}

wpub::v1::PublicationHeader HeaderFromSettings(const synthetic::SyntheticModel& model,
                                               const policy::PolicySettings& settings,
                                               uint64_t version) {
  wpub::v1::PublicationHeader h;
  h.set_version(version);
  h.set_model_id(absl::GetFlag(FLAGS_model_id));
  h.set_recipe(std::string(policy::RecipeName(settings.recipe)));
  h.set_quantization_config_json(QuantizationConfigJson(settings.quantization));
  const policy::PrecisionExceptions& e = settings.exceptions;
  wpub::v1::PrecisionExceptions* pe = h.mutable_precision_exceptions();
  for (const std::string& s : e.extra_high_precision_layers_megatron) {
    pe->add_extra_high_precision_layers_megatron(s);
  }
  for (const std::string& s : e.extra_high_precision_layers_hf) {
    pe->add_extra_high_precision_layers_hf(s);
  }
  if (e.first_last_layers_bf16) {
    pe->set_first_last_layers_bf16(true);
    pe->set_num_layers(
        static_cast<uint32_t>(e.num_layers > 0 ? e.num_layers : model.shape().num_layers));
    pe->set_num_layers_at_start_in_bf16(static_cast<uint32_t>(e.num_layers_at_start_in_bf16));
    pe->set_num_layers_at_end_in_bf16(static_cast<uint32_t>(e.num_layers_at_end_in_bf16));
  }
  h.set_allow_non_finite(absl::GetFlag(FLAGS_allow_non_finite));
  h.set_bucket_bytes(absl::GetFlag(FLAGS_bucket_bytes).value);
  h.set_release_gpu_memory(absl::GetFlag(FLAGS_release_gpu_memory));
  return h;
}

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.2f %s", v, units[u]);
}

namespace {
const char* StatusName(wpub::v1::PublicationStatus s) {
  switch (s) {
    case wpub::v1::PUBLICATION_STATUS_COMMITTED:
      return "committed";
    case wpub::v1::PUBLICATION_STATUS_ABORTED:
      return "aborted";
    case wpub::v1::PUBLICATION_STATUS_FAILED:
      return "failed";
    default:
      return "?";
  }
}
}  // namespace

std::string ReportTableHeader() {
  return absl::StrFormat(
      "%-7s %-9s %8s | %7s %7s %8s %7s %8s %7s | %10s %10s | %5s %5s %5s | %5s %5s\n", "version",
      "status", "wall s", "ingest", "policy", "quantize", "pack", "transfer", "commit", "bytes in",
      "bytes out", "quant", "pass", "ign", "syncs", "recv");
}

std::string ReportTableRow(const wpub::v1::PublicationReport& r) {
  int committed = 0;
  for (const auto& o : r.receivers()) committed += o.committed() ? 1 : 0;
  std::string row = absl::StrFormat(
      "%-7d %-9s %8.3f | %7.3f %7.3f %8.3f %7.3f %8.3f %7.3f | %10s %10s | %5d %5d %5d | %5d "
      "%2d/%-2d\n",
      r.version(), StatusName(r.status()), r.wall_seconds(), r.phases().ingest(),
      r.phases().policy(), r.phases().quantize(), r.phases().pack(), r.phases().transfer(),
      r.phases().commit(), HumanBytes(r.bytes_in()), HumanBytes(r.bytes_out()),
      r.tensors().quantized(), r.tensors().passthrough(), r.tensors().ignored(), r.host_syncs(),
      committed, r.receivers_size());
  if (!r.error_message().empty()) absl::StrAppend(&row, "        error: ", r.error_message(), "\n");
  return row;
}

}  // namespace wpub::wpubctl
