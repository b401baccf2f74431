// The rollout engines of the GPU path as one weight-update group: the transport::Transport the
// engine drives for them and the engine::RolloutConnector behind ConnectEngines. wpubd is rank 0:
// the group serves the TCPStore rendezvous (core/rendezvous), puts the group id (NCCL's unique
// id) under the keys torch.distributed reads, opens rank 0 on its channel (group_channel.h: the
// bytes; NCCL's in production, core/nccl/nccl_transport.h), probes every engine for what its
// release serves (EngineFamily::Profile) and asks every engine to join through the engine
// family's driver (engine_driver.h: the HTTP side; SGLang's by default). Per bucket it posts the
// engine's update request, then hands the bucket to the channel. No CUDA here: CPU tests run
// the group over a channel of their own against engine fakes.
//
// Failure handling: while a publication is in flight the channel's watchdog polls its own
// health (NCCL: the communicator's async error), the driver's outcomes (this group's peer
// check) and the publication deadline; on any failure it aborts the group and the publication
// fails with ABORTED naming the engines. The next Begin re-forms the group with the engines that
// pass their health check (a new group name generation, a new unique id), so wpubd keeps serving
// after a dead engine.
//
// Engine set: the initial set comes from the options (may be empty: a daemon started without
// engines); Connect replaces it. Connect first tears the current group down (its engines are
// asked to leave it), then probes every engine, lays out the group, publishes the unique id,
// starts the communicator and waits for every join answer. On any failure whatever joined is
// torn down too and the group is left with NO engines: never half-connected. Without engines
// the group has no participants (Begin returns none), so a publication reaches the other
// transports' receivers only. Connect and Begin are serialized by one mutex; Connect refuses
// while a publication is in flight. Group/Receivers read a snapshot and never block on Connect.
//
// Dirty engines: engines load each bucket into their live weights on receipt. When a
// publication aborts, the engines that were sent no bucket are resumed at once; the others are
// dirty: left paused, reported with state "dirty" (Receivers, Group, Outcomes) until a
// publication commits on them (the engine's retry of the same version, or the next one).
//
// Transport contract (core/transport/transport.h) with these specifics: participants are the
// engine URLs; buckets are taken in host or device memory; acknowledgements are the engines'
// HTTP answers (acknowledges_checksums is false); Commit sends the family's end calls.
// Thread-safety: as the interface says (Abort from any thread; the rest from the publication
// thread).
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/rendezvous/tcp_store_server.h"
#include "core/rollout/engine_driver.h"
#include "core/rollout/family_router.h"
#include "core/rollout/sglang_driver.h"
#include "core/rollout/vllm_driver.h"
#include "core/transport/group_channel.h"
#include "core/transport/retained_copy.h"
#include "core/transport/transport.h"

namespace wpub::rollout {

struct RolloutGroupOptions {
  int device = 0;
  // The TCPStore the engines rendezvous on (master_port = its port).
  rendezvous::TcpStoreServerOptions store;
  // The address engines use to reach this host's TCPStore.
  std::string advertise_address = "127.0.0.1";
  // The initial engines (may be empty) and the base group name: groups are named
  // "<base>_<incarnation>_<generation>" (RolloutGroup::incarnation).
  std::vector<EngineSpec> engines;
  std::string group_name = "wpub_weights";
  // The bearer token of every engine of this group, those of `engines` and of every
  // ConnectEngines request (EngineSpec::auth_token; an engine's own token wins); "": none.
  std::string engine_auth_token;
  // The pause policy of `engines` and of every ConnectEngines request that names none (wpubd
  // --pause; the request's own wins). Create refuses one the initial engines' family cannot
  // carry out.
  engine::PausePolicy pause;
  // The engines' protocols, chosen per engine set by EngineSpec::family (one family per group:
  // a ConnectEngines mixing them is INVALID_ARGUMENT). `family` null: SGLang with the settings
  // below; `vllm_family` null: vLLM with `vllm`'s.
  std::shared_ptr<const EngineFamily> family;
  SglangFamilyOptions sglang;
  std::shared_ptr<const EngineFamily> vllm_family;
  VllmFamilyOptions vllm;
  // The engines are colocated (families "sglang-ipc", "vllm-ipc": the channel is an IpcChannel,
  // core/rollout/ipc_channel.h); otherwise they take NCCL broadcasts ("sglang", "vllm"). A group
  // speaks only the families of its kind.
  bool colocated = false;
  // Keys the ncclUniqueId is stored under (each template as rendezvous::UniqueIdKey takes it):
  // torch 2.11's layout first, then the one of torch versions without the device-type layer.
  std::vector<std::string> unique_id_key_templates = {
      std::string(rendezvous::kDefaultUniqueIdKeyTemplate), "/{group}/{group}/{index}"};
  // Every engine joins (HTTP answer) within this; the communicator is ready at the latest when
  // the first bucket's broadcast starts, within the same budget.
  absl::Duration join_timeout = absl::Seconds(120);
  // Watchdog: from Begin, every bucket must be transferred and answered within this.
  absl::Duration publication_deadline = absl::Seconds(120);
  absl::Duration watchdog_interval = absl::Milliseconds(2);
  // NcclCommOptions::ctas of wpub's rank (0: NCCL's choice). The engines' communicators must have
  // the same bounds (NCCL_MIN_CTAS = NCCL_MAX_CTAS = nccl_ctas in their environment), else every
  // broadcast fails and the publication is aborted (see NcclCommOptions::ctas).
  int nccl_ctas = 0;
  // The engine watch: this often, while no publication or ConnectEngines runs, every engine of
  // the formed group is asked for its health and weight version; one that answers holding less
  // than the group last gave it came back from a restart (it left the NCCL group with its
  // process): the group re-forms at the next Begin and the behind listener is told, so the
  // engine is caught up from the retained copy. One that does not answer its health check makes
  // the next Begin re-form the group without it. Zero: no watch.
  absl::Duration engine_watch_interval = absl::Seconds(10);
};

// What the last publication sent the group's engines (RolloutGroup::last_patches).
struct EnginePatchStats {
  uint64_t base_version = 0;  // the version patches were made against; 0: none offered
  uint32_t patched_buckets = 0;
  uint32_t whole_buckets = 0;
  uint64_t patch_bytes = 0;           // broadcast as patches
  uint64_t whole_bytes = 0;           // broadcast whole
  uint64_t patched_bucket_bytes = 0;  // the whole size of the buckets sent as patches
};

class RolloutGroup final : public transport::Transport, public FamilyConnector {
 public:
  // Starts the TCPStore server and takes `channel` for the bytes; forms no group yet (the first
  // Begin or Connect does). INVALID_ARGUMENT for an initial engine set ConnectEngines would
  // refuse, an empty group name, no unique-id key template or no channel. (options.device and
  // options.nccl_ctas are the NCCL channel's, which the one-argument Create makes.)
  static absl::StatusOr<std::unique_ptr<RolloutGroup>> Create(
      const RolloutGroupOptions& options, std::unique_ptr<transport::GroupChannel> channel);
  // The same over NCCL: an nccl::NcclTransport on options.device with options.nccl_ctas
  // (INVALID_ARGUMENT outside [0, 64], before any device call). Defined in the NCCL build only
  // (wpub::rollout_group: rollout_group_nccl.cc).
  static absl::StatusOr<std::unique_ptr<RolloutGroup>> Create(const RolloutGroupOptions& options);
  ~RolloutGroup() override;

  // ConnectEngines (see the file comment). Blocks for the health probes (at most
  // min(family connect timeout, timeout)) and the joins (at most timeout = request.timeout, or
  // options.join_timeout when 0), plus, on failure, the teardown (leave requests, at most a few
  // seconds). Errors: INVALID_ARGUMENT (engine::ValidateRolloutConnectRequest);
  // FAILED_PRECONDITION while a publication is in flight; UNAVAILABLE naming an engine that
  // failed its health probe or its join; DEADLINE_EXCEEDED naming the engines that did not
  // answer in time.
  absl::StatusOr<engine::RolloutGroupInfo> Connect(
      const engine::RolloutConnectRequest& request) override;
  engine::RolloutGroupInfo Group() const override;
  // What Connect checks before anything changes, without side effects: the request is valid,
  // its engines are of one family this group speaks, and that family carries out the request's
  // pause policy (or the group's). The engines as Connect would take them, or INVALID_ARGUMENT.
  absl::StatusOr<std::vector<EngineSpec>> Check(const engine::RolloutConnectRequest& request) const;
  absl::Status CheckConnect(const engine::RolloutConnectRequest& request) const override {
    return Check(request).status();
  }
  uint16_t store_port() const { return store_->port(); }
  int generation() const { return generation_; }
  // 8 hex digits drawn when the group object is created: part of every group name, so a
  // restarted daemon never asks an engine to join a group under a name its previous
  // incarnation left there (SGLang refuses a name it already holds, and an engine keeps the
  // group of a daemon that died without leaving it).
  const std::string& incarnation() const { return incarnation_; }

  transport::TransportCapabilities capabilities() const override;
  absl::StatusOr<std::vector<std::string>> Begin(const transport::PublicationManifest& m) override;
  // The bucket's update request to every engine, then its broadcast (host or device bytes).
  absl::Status Send(std::shared_ptr<const transport::Bucket> bucket) override;
  absl::Status WaitAcknowledged(absl::Time deadline) override;
  absl::Status Commit() override;
  void Abort(absl::string_view reason) override;
  std::vector<transport::ReceiverOutcome> Outcomes() const override;
  std::vector<transport::ReceiverInfo> Receivers() const override;
  // FamilyConnector: tears the group down (the engines are asked to leave) and forgets the engine
  // set. FAILED_PRECONDITION while a publication is in flight.
  absl::Status Disconnect() override;
  // Every engine of the group becomes dirty (no resume at the abort that follows).
  void MarkParticipantsDirty() override;
  void SetBehindListener(BehindListener listener) override;
  // One round of the engine watch (RolloutGroupOptions::engine_watch_interval), on the caller's
  // thread: the URLs of the engines found back -- from a restart (in the group, reporting less
  // than it was given), or answering again after a re-formation left them out for not answering
  // their health check -- each also told to the behind listener, and the group marked for
  // re-formation; an engine found down marks it too, so the next Begin forms the group without
  // it. Nothing while a publication or a Connect runs, or no group is formed.
  std::vector<std::string> WatchEnginesOnce();

  // Offers the engines bucket patches (transport::EnginePatches); before the first publication. A
  // publication is patched when the driver says every engine takes patches
  // (EngineDriver::TakesPatches), every engine committed the retained version in the group as
  // formed now (its last publication there, not dirty: a (re-)formation makes every engine it
  // joins take a whole version first), the version is not a group version or a replay, and
  // full_every does not force a whole one. A bucket is sent as its patch when it is laid out as
  // the retained one's and the patch is within max_patch_fraction (a device bucket is diffed
  // in the retained memory, RetainedBytes::PatchOnDevice: one counted host wait for its checksum
  // and one for the patch's size; a host bucket on the host), else whole -- each engine applies
  // what it gets and verifies the whole bucket's checksum.
  void SetEnginePatches(transport::EnginePatches patches) override;
  EnginePatchStats last_patches() const;

  // Engines left paused by an aborted publication (see the file comment).
  std::vector<std::string> dirty_engines() const;
  // The bytes' side (NCCL's: nccl::NcclTransport, for its broadcast timings).
  const transport::GroupChannel& channel() const { return *channel_; }

 private:
  // A publication's stage on this group, every transition a compare-and-swap where another
  // thread may race it:
  //   Begin   kIdle -> kBegun (no engine asked anything yet) -> kPaused (the engines were asked to
  //           pause / open their session: an abort owes the clean ones their resume); a Begin
  //           that finds kBegun turned kAborted after asking the engines makes it kResumeOwed.
  //   Commit  kPaused -> kEnding (the end calls are the engines' last word: an abort from now on
  //           owes no resume) -> kIdle; it fails when an abort claimed kPaused first.
  //   Abort   (any thread) kBegun, kEnding -> kAborted; kPaused -> kResumeOwed. Then whichever
  //           abort takes connect_mu_ (never while Begin runs; the publication thread's own abort
  //           always follows one from another thread) ends it: kAborted -> kIdle, or
  //           kResumeOwed -> kResuming (the clean engines resumed, the others recorded dirty)
  //           -> kIdle.
  // kBegun, kPaused, kEnding and kResuming are in flight (Connect and Begin refuse; Group shows
  // the engines receiving; Send, WaitAcknowledged and Commit require it).
  enum class Stage : uint8_t { kIdle, kBegun, kPaused, kEnding, kAborted, kResumeOwed, kResuming };

  RolloutGroup(RolloutGroupOptions options,
               std::map<std::string, std::shared_ptr<const EngineFamily>> families);
  bool in_flight() const {
    const Stage s = stage_.load();
    return s == Stage::kBegun || s == Stage::kPaused || s == Stage::kEnding ||
           s == Stage::kResuming;
  }
  // Forms a group of `want` (requires connect_mu_). strict: every engine must pass the health
  // probe (ConnectEngines); otherwise the ones that fail it are left out (re-formation).
  absl::Status Form(const std::vector<EngineSpec>& want, const std::string& base_group,
                    absl::Duration timeout, bool strict);
  // The engines of `want` that pass the health probe (strict: all of them, or UNAVAILABLE).
  absl::StatusOr<std::vector<EngineSpec>> Alive(const std::vector<EngineSpec>& want,
                                                absl::Duration timeout, bool strict) const;
  void RecordWeightVersions(const std::vector<EngineSpec>& engines, absl::Duration timeout);
  void TearDownGroup();
  void PublishInfo();  // refreshes info_ from the group state (requires connect_mu_)
  // After an abort: resumes the engines that got no bucket, records the others as dirty.
  void ResumeCleanEngines();
  // The watchdog's peer check: ABORTED with every failed engine's error, or OK.
  absl::Status EngineFailure() const;

  // Bucket `bucket`'s patch against patch_base_ (null: it goes whole), with the whole bucket's
  // checksum; publication thread.
  struct PatchMade {
    std::shared_ptr<const transport::Bucket> patch;
    uint64_t target_checksum = 0;
  };
  absl::StatusOr<PatchMade> MakePatch(const transport::Bucket& bucket);

  const RolloutGroupOptions options_;
  transport::EnginePatches patches_;  // SetEnginePatches' (before the first publication)
  // The publication thread's: the version this publication is patched against (null: none), the
  // committed patched publications in a row, and what was sent.
  std::shared_ptr<const transport::RetainedVersion> patch_base_;
  uint32_t patched_in_a_row_ = 0;
  mutable std::mutex patch_mu_;
  EnginePatchStats patch_stats_;  // guarded by patch_mu_
  // The families this group speaks, by EngineSpec::family ("sglang", "vllm"): the options' or
  // the built-in ones, fixed in Create.
  const std::map<std::string, std::shared_ptr<const EngineFamily>> families_;
  // The family every engine of `engines` names (SGLang's for none); INVALID_ARGUMENT naming two
  // engines of different families or an unknown family.
  absl::StatusOr<std::shared_ptr<const EngineFamily>> FamilyOf(
      const std::vector<EngineSpec>& engines) const;
  // `engines` with `policy` as `family` carries it out, or INVALID_ARGUMENT naming the policy
  // and the family when it cannot.
  absl::StatusOr<std::vector<EngineSpec>> WithPause(std::vector<EngineSpec> engines,
                                                    const EngineFamily& family,
                                                    const engine::PausePolicy& policy) const;
  // Serializes Connect and Begin; guards engines_, family_ and base_group_.
  std::mutex connect_mu_;
  std::vector<EngineSpec> engines_;  // the engine set; empty: none connected
  // The engine set's family, chosen with the set (Create, Connect), never per formation; read
  // without the lock by the publication thread (Connect refuses while one is in flight).
  std::shared_ptr<const EngineFamily> family_;
  std::string base_group_;
  // What Group and Receivers show (written under connect_mu_ too).
  mutable std::mutex info_mu_;
  engine::RolloutGroupInfo info_;                    // guarded by info_mu_
  std::set<std::string> dirty_;                      // guarded by info_mu_: engine URLs left dirty
  std::map<std::string, uint64_t> weight_versions_;  // guarded by info_mu_: by URL, at join
  // By URL, the version each engine committed in the group as formed now (a formation forgets
  // every engine it joins: a restarted one's kept weights are gone): bucket patches go only to
  // engines that hold their base this way.
  std::map<std::string, uint64_t> patch_holders_;  // guarded by info_mu_
  // Engines the watch saw report a version (> 0): only they are judged by it.
  std::set<std::string> reporting_;  // guarded by info_mu_
  // Engines of the set a re-formation left out because they did not answer their health check
  // and that the watch found answering again: shown among the receivers (rank offset 0: no rank
  // yet; the version they report, which the committed version may have passed meanwhile) until
  // the next formation -- which the watch asks for, and a catch-up runs when one is behind --
  // takes them back.
  std::set<std::string> rejoining_;  // guarded by info_mu_
  // Engines of the set a formation left out because they cannot take publications (a release
  // too old, an API key wpubd lacks): not watched -- only a ConnectEngines brings them back.
  std::set<std::string> unusable_;  // guarded by info_mu_
  std::unique_ptr<rendezvous::TcpStoreServer> store_;
  std::unique_ptr<transport::GroupChannel> channel_;

  // Group state (publication thread, or a Connect under connect_mu_).
  std::unique_ptr<EngineDriver> driver_;
  const std::string incarnation_;
  std::atomic<int> generation_{0};
  // A group formed and was not torn down since: the group's state, apart from the stage (a
  // publication without engines is in flight with no group; an aborted one leaves it formed).
  std::atomic<bool> formed_{false};
  // The engine watch found an engine back from a restart (out of the NCCL group): the next Begin
  // forms the group again (under connect_mu_).
  bool reform_ = false;
  std::atomic<Stage> stage_{Stage::kIdle};
  uint64_t version_ = 0;
  absl::Time publication_deadline_ = absl::InfiniteFuture();

  // The engine watch's thread (WatchLoop) and what it tells.
  void WatchLoop();
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;         // guarded by watch_mu_
  BehindListener behind_listener_;  // guarded by watch_mu_
  std::thread watch_thread_;        // last: joined first
};

}  // namespace wpub::rollout
