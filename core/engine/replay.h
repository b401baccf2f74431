// Replays of the retained committed version (docs/DESIGN.md, "Convergence on the committed
// version"): a restore of engines an abort left dirty, a catch-up of engines and pull receivers
// that joined behind, an operator's restore. A replay is an internal publication: it holds the
// engine's one slot (PublicationLedger::BeginReplay) and sends the retained buckets -- bytes
// and checksums exactly as committed -- through the same transport group as every publication,
// with a manifest that says `replay`: every engine of a weight-update group takes part (a
// broadcast reaches every rank) with its family's whole lifecycle (pause, session, buckets,
// end, version, resume), pull receivers take part only when they hold less than the version,
// and the retained copy does not (it is the source). A replay that completes leaves every
// participant holding the committed version and resumed; one that fails leaves the engines it
// reached dirty and paused (reported), the others resumed.
//
// A trainer's publication (or a ConnectEngines) preempts a replay: the ledger calls its preempt,
// the replay aborts, and the new version -- which reaches every engine anyway -- wins. A
// replay's report is recorded before it frees the slot, so whoever takes the slot next sees it.
//
// Internal to core/engine (Engine::Impl owns one). Thread-safe: Run from any thread (one runs
// at a time: the slot); Request from any thread, never blocking; Stop once, from the engine's
// shutdown.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/engine.h"
#include "core/engine/types.h"

namespace wpub::engine {

class Replayer {
 public:
  // `engine` (which owns the Replayer) outlives it. `history`: reports kept for Recent.
  Replayer(Engine::Impl* engine, size_t history);
  ~Replayer();
  Replayer(const Replayer&) = delete;
  Replayer& operator=(const Replayer&) = delete;

  // Replays the retained version now, on the calling thread. Errors, before anything is sent:
  // FAILED_PRECONDITION naming why nothing is retained, when the retained version is not the
  // committed one, for a group version (replays of group versions are not built), or naming
  // what holds the slot; UNAVAILABLE once the engine shuts down. Otherwise the report, which
  // says whether the replay completed (and is recorded: Recent, the observer).
  absl::StatusOr<ReplayReport> Run(ReplayKind kind, std::string trigger);

  // Asks the replayer's thread to run a replay when something is behind the committed version
  // (a dirty engine, an engine or pull receiver holding less). Requests made while one waits
  // are merged (a restore wins over a catch-up). Never blocks.
  void Request(ReplayKind kind, std::string trigger);

  std::vector<ReplayReport> Recent(size_t n) const;  // newest first

  // Preempts the replay in progress, drops what was requested, ends the thread. Idempotent.
  void Stop();

 private:
  struct Current;
  void Loop();
  // Whether anything is behind the committed version (receivers and engines as the transports
  // report them), naming them in *who.
  bool SomethingBehind(std::string* who) const;
  void Record(const ReplayReport& report);

  Engine::Impl* const engine_;
  const size_t history_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Pending {
    ReplayKind kind;
    std::string trigger;
  };
  std::optional<Pending> pending_;    // guarded by mu_
  bool stopping_ = false;             // guarded by mu_
  std::shared_ptr<Current> current_;  // the replay in progress; guarded by mu_
  std::deque<ReplayReport> reports_;  // newest first; guarded by mu_
  std::thread thread_;
};

}  // namespace wpub::engine
