// What `wpubctl publish-synthetic`, `status` and `demo` share: the daemon connection flags
// (--target, --auth_token_file), the payload streaming flags (--chunk_bytes, --payload, ...),
// turning policy settings into a publication header, and the per-publication report table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/policy/settings.h"
#include "core/synthetic/synthetic.h"
#include "server/client/publisher_client.h"
#include "wpub/v1/publisher.pb.h"

namespace wpub::wpubctl {

// --target and --auth_token_file.
absl::StatusOr<client::ClientOptions> ClientOptionsFromFlags();

// --chunk_bytes, --payload (inline|shm), --parts, --concat_dim.
absl::StatusOr<client::StreamOptions> StreamOptionsFromFlags();

// --seed: the data of version v is synthetic::FillTensor(seed + v), so every version differs
// and any version can be recomputed.
uint64_t DataSeed(uint64_t version);

// The `quantization_config` JSON engines would read for `settings` (quant_algo, quant_method,
// ignore); empty when the settings carry none.
std::string QuantizationConfigJson(const policy::QuantizationConfig& config);

// A header for `version` of `model` under `settings` (recipe, quantization config, precision
// exceptions with num_layers = the model's decoder layers). --model_id, --bucket_bytes and
// --allow_non_finite are applied.
wpub::v1::PublicationHeader HeaderFromSettings(const synthetic::SyntheticModel& model,
                                               const policy::PolicySettings& settings,
                                               uint64_t version);

// A fixed-width table of reports: version, status, wall clock, phases, bytes, tensors
// quantized/passed, host syncs, receivers committed.
std::string ReportTableHeader();
std::string ReportTableRow(const wpub::v1::PublicationReport& report);

// "1.23 GiB" style.
std::string HumanBytes(uint64_t bytes);

}  // namespace wpub::wpubctl
