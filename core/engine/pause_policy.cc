#include "core/engine/pause_policy.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace wpub::engine {

PausePolicy::Cache PausePolicy::cache_action() const {
  if (cache != Cache::kDefault) return cache;
  return in_flight == InFlight::kKeep ? Cache::kKeep : Cache::kFlush;
}

bool PausePolicy::never_mixes() const {
  return (in_flight == InFlight::kAbort || in_flight == InFlight::kWait) &&
         cache_action() == Cache::kFlush;
}

absl::string_view InFlightName(PausePolicy::InFlight in_flight) {
  switch (in_flight) {
    case PausePolicy::InFlight::kAbort:
      return "abort";
    case PausePolicy::InFlight::kWait:
      return "wait";
    case PausePolicy::InFlight::kRetract:
      return "retract";
    case PausePolicy::InFlight::kKeep:
      return "keep";
  }
  return "abort";
}

absl::string_view CacheName(PausePolicy::Cache cache) {
  switch (cache) {
    case PausePolicy::Cache::kDefault:
      return "default";
    case PausePolicy::Cache::kFlush:
      return "flush";
    case PausePolicy::Cache::kKeep:
      return "keep";
  }
  return "default";
}

std::string PausePolicyName(const PausePolicy& policy) {
  return absl::StrCat(InFlightName(policy.in_flight), ":", CacheName(policy.cache_action()));
}

absl::StatusOr<PausePolicy> PausePolicyOf(absl::string_view in_flight, absl::string_view cache) {
  PausePolicy p;
  if (in_flight == "abort" || in_flight.empty()) {
    p.in_flight = PausePolicy::InFlight::kAbort;
  } else if (in_flight == "wait") {
    p.in_flight = PausePolicy::InFlight::kWait;
  } else if (in_flight == "retract") {
    p.in_flight = PausePolicy::InFlight::kRetract;
  } else if (in_flight == "keep") {
    p.in_flight = PausePolicy::InFlight::kKeep;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("pause in-flight mode '", in_flight,
                                                   "' is not one of abort, wait, retract, keep"));
  }
  if (cache.empty() || cache == "default") {
    p.cache = PausePolicy::Cache::kDefault;
  } else if (cache == "flush") {
    p.cache = PausePolicy::Cache::kFlush;
  } else if (cache == "keep") {
    p.cache = PausePolicy::Cache::kKeep;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("pause cache action '", cache, "' is not flush or keep"));
  }
  return p;
}

absl::StatusOr<PausePolicy> ParsePausePolicy(absl::string_view text) {
  const size_t colon = text.find(':');
  const absl::string_view in_flight = text.substr(0, colon);
  const absl::string_view cache =
      colon == absl::string_view::npos ? absl::string_view() : text.substr(colon + 1);
  if (!text.empty() && in_flight.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pause policy '", text, "': no in-flight mode before ':'"));
  }
  if (colon != absl::string_view::npos && cache.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pause policy '", text, "': nothing after ':' (flush or keep)"));
  }
  absl::StatusOr<PausePolicy> p = PausePolicyOf(in_flight, cache);
  if (!p.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pause policy '", text, "': ", p.status().message()));
  }
  return p;
}

}  // namespace wpub::engine
