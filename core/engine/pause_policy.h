// What a rollout engine does with its requests and its cache while wpub updates its weights: the
// pause policy of an engine set, chosen by the operator (wpubd --pause, ConnectEngines'
// `pause`, connect_engines(pause=...)) and carried out by each engine family with its own pause
// routes (core/rollout: SGLang's /pause_generation + /flush_cache, vLLM's /pause?mode=&
// clear_cache=). docs/specs/engines.md, "Pause policies", says what each costs and guarantees.
#pragma once

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace wpub::engine {

struct PausePolicy {
  // What happens to the requests in flight when the engine pauses.
  enum class InFlight {
    // Ended with an abort (their callers see an aborted finish and may re-issue them); requests
    // arriving while paused wait and run wholly on the new weights. No request's tokens come
    // from two versions. SGLang /pause_generation mode "abort", vLLM /pause mode "abort".
    kAbort,
    // Run to completion on the old weights before the engine answers its pause (the answer
    // waits for the longest of them); then as kAbort. vLLM mode "wait"; SGLang has no such mode.
    kWait,
    // Taken off the GPU (their KV freed) and, after the resume, recomputed from their prompt and
    // the tokens generated so far on the new weights: tokens before the pause come from the old
    // version, after it from the new. SGLang mode "retract"; vLLM mode "keep" with
    // clear_cache=true (clearing its cache preempts the frozen requests).
    kRetract,
    // Frozen with their KV cache and continued on the new weights after the resume: new tokens
    // attend to KV computed with the old weights. The shortest resume. SGLang mode "in_place",
    // vLLM mode "keep" with clear_cache=false.
    kKeep,
  };
  // What happens to the prefix (KV) cache computed with the old weights.
  enum class Cache {
    // The in-flight mode's: kFlush after kAbort, kWait and kRetract, kKeep after kKeep -- as the
    // family can (EngineFamily::ResolvePause: SGLang keeps its cache after a retract, since it
    // refuses a flush while retracted requests wait).
    kDefault,
    kFlush,  // dropped: nothing computed with the old weights is reused after the resume
    kKeep,   // kept: later requests may reuse prefixes computed with the old weights
  };
  InFlight in_flight = InFlight::kAbort;
  Cache cache = Cache::kDefault;

  // The cache action (kDefault as the in-flight mode's, before a family resolved it).
  Cache cache_action() const;
  // Whether no request's tokens (nor the KV they attend to) come from two weight versions.
  bool never_mixes() const;
  bool operator==(const PausePolicy& o) const {
    return in_flight == o.in_flight && cache_action() == o.cache_action();
  }
};

// "abort", "wait", "retract", "keep"; "flush", "keep".
absl::string_view InFlightName(PausePolicy::InFlight in_flight);
absl::string_view CacheName(PausePolicy::Cache cache);  // kDefault: "default"
// "<in_flight>:<cache>" with the cache resolved ("abort:flush", "retract:keep").
std::string PausePolicyName(const PausePolicy& policy);

// "<in_flight>[:<cache>]" (wpubd --pause, wpubctl connect-engines --pause): in_flight one of
// abort, wait, retract, keep; cache one of flush, keep (omitted: the in-flight mode's default).
// "" is the default policy (abort:flush). INVALID_ARGUMENT naming the text otherwise.
absl::StatusOr<PausePolicy> ParsePausePolicy(absl::string_view text);
// The two halves as the RPC carries them (PausePolicy message): "" for either is its default.
absl::StatusOr<PausePolicy> PausePolicyOf(absl::string_view in_flight, absl::string_view cache);

}  // namespace wpub::engine
