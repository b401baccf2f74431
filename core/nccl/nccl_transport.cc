// NcclTransport: group formation over the TCPStore + SGLang driver, per-bucket HTTP request +
// broadcast, a watchdog that aborts the communicator on NCCL errors, engine failures or the
// deadline, and re-formation at the next Begin.
#include "core/nccl/nccl_transport.h"

#include <set>

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"
#include "core/gpu/host_syncs.h"
#include "core/gpu/streams.h"

namespace wpub::nccl {
namespace {

engine::ReceiverFailure Classify(const std::string& error) {
  if (error.find("imed out") != std::string::npos || error.find("eadline") != std::string::npos ||
      error.find("Read") != std::string::npos) {
    return engine::ReceiverFailure::kTimeout;
  }
  if (error.find("Connection") != std::string::npos || error.find("NCCL") != std::string::npos) {
    return engine::ReceiverFailure::kDisconnected;
  }
  return engine::ReceiverFailure::kProtocol;
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(
    const NcclTransportOptions& options) {
  WPUB_RETURN_IF_ERROR(CheckCtas(options.nccl_ctas, "NCCL transport: nccl_ctas"));
  if (!options.sglang.engines.empty()) {
    // The initial set obeys the same rules as a ConnectEngines request.
    engine::EngineConnectRequest r;
    for (const engines::EngineSpec& e : options.sglang.engines)
      r.engines.push_back({e.url, e.gpus});
    r.group_name = options.sglang.group_name;
    WPUB_RETURN_IF_ERROR(engine::ValidateEngineConnectRequest(r));
  }
  if (options.sglang.group_name.empty()) {
    return absl::InvalidArgumentError("NCCL transport: empty group name");
  }
  if (options.unique_id_key_templates.empty()) {
    return absl::InvalidArgumentError("NCCL transport: no unique-id key template");
  }
  std::unique_ptr<NcclTransport> t(new NcclTransport(options));
  WPUB_ASSIGN_OR_RETURN(t->store_, rendezvous::TcpStoreServer::Create(options.store));
  if (const cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL transport: CUDA device ", options.device, " is not usable: ", cudaGetErrorString(e)));
  }
  WPUB_CUDA_RETURN_IF_ERROR(gpu::CreateStream(gpu::StreamRole::kCommunication, &t->comm_stream_));
  WPUB_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&t->host_done_, cudaEventDisableTiming));
  {
    std::lock_guard lock(t->connect_mu_);
    t->PublishInfo();
  }
  return t;
}

NcclTransport::NcclTransport(NcclTransportOptions options)
    : options_(std::move(options)),
      engines_(options_.sglang.engines),
      base_group_(options_.sglang.group_name) {}

NcclTransport::~NcclTransport() {
  StopWatchdog();
  {
    std::lock_guard lock(mu_);
    if (comm_) comm_->Abort();  // terminates anything still on the comm stream
  }
  driver_.reset();
  comm_.reset();
  if (comm_stream_ != nullptr) cudaStreamSynchronize(comm_stream_);
  if (host_staging_ != nullptr) cudaFree(host_staging_);
  if (host_done_ != nullptr) cudaEventDestroy(host_done_);
  for (cudaEvent_t e : bcast_events_) cudaEventDestroy(e);
  if (comm_stream_ != nullptr) cudaStreamDestroy(comm_stream_);
}

void NcclTransport::TearDownGroup() {
  if (driver_) {
    driver_->Leave();  // best effort: engines drop the old group (SGLang keys groups by name)
    (void)driver_->WaitIdle(absl::Now() + absl::Seconds(5));
  }
  std::unique_ptr<NcclComm> old;
  {
    std::lock_guard lock(mu_);
    old = std::move(comm_);
  }
  old.reset();  // ncclCommAbort
  driver_.reset();
  group_healthy_ = false;
}

void NcclTransport::PublishInfo() {
  engine::EngineGroupInfo g;
  g.store_address = absl::StrCat(options_.advertise_address, ":", store_->port());
  g.generation = static_cast<uint64_t>(generation_.load());
  g.healthy = group_healthy_;
  if (driver_) {
    const engines::GroupLayout& l = driver_->layout();
    g.group_name = l.group_name;
    g.world_size = l.world_size;
    const std::vector<engines::EngineSpec>& members = driver_->options().engines;
    for (size_t i = 0; i < members.size(); ++i) {
      g.engines.push_back(
          {members[i].url, members[i].gpus, l.rank_offsets[i], engine::ReceiverState::kIdle});
    }
  } else {
    // No group: the engine set the next Begin forms one with (empty after a failed Connect).
    int next = 1;
    for (const engines::EngineSpec& e : engines_) {
      g.engines.push_back({e.url, e.gpus, next, engine::ReceiverState::kLeft});
      next += e.gpus;
    }
  }
  std::lock_guard lock(info_mu_);
  for (engine::ConnectedEngine& e : g.engines) {
    auto it = weight_versions_.find(e.url);
    e.weight_version = it == weight_versions_.end() ? 0 : it->second;
  }
  for (const auto& [url, v] : weight_versions_) {
    g.highest_engine_version = std::max(g.highest_engine_version, v);
  }
  info_ = std::move(g);
}

absl::Status NcclTransport::Form(const std::vector<engines::EngineSpec>& want,
                                 const std::string& base_group, absl::Duration timeout,
                                 bool strict) {
  StopWatchdog();
  TearDownGroup();
  PublishInfo();
  std::vector<engines::EngineSpec> alive;
  if (options_.health_endpoint.empty()) {
    alive = want;
  } else {
    const absl::Duration probe_timeout = std::min(options_.sglang.connect_timeout, timeout);
    const std::vector<bool> up =
        engines::ProbeEngines(want, options_.health_endpoint, probe_timeout);
    std::vector<std::string> down;
    for (size_t i = 0; i < want.size(); ++i) {
      if (up[i]) {
        alive.push_back(want[i]);
      } else {
        down.push_back(want[i].url);
      }
    }
    if (strict && !down.empty()) {
      return absl::UnavailableError(
          absl::StrCat(down.size() == 1 ? "engine " : "engines ", absl::StrJoin(down, ", "),
                       " did not answer GET ", options_.health_endpoint, " within ",
                       absl::FormatDuration(probe_timeout), "; no engine group is connected"));
    }
  }
  if (alive.empty()) {
    return absl::UnavailableError(absl::StrCat("NCCL transport: no engine answered ",
                                               options_.health_endpoint, " (", want.size(),
                                               " configured)"));
  }
  const int generation = ++generation_;
  engines::SglangDriverOptions d = options_.sglang;
  d.engines = alive;
  d.master_address = options_.advertise_address;
  d.master_port = store_->port();
  d.group_name = absl::StrCat(base_group, "_", generation);
  // Everything that may fail before an engine is asked to join comes first, so a failure here
  // leaves no group behind.
  WPUB_ASSIGN_OR_RETURN(UniqueId id, NewUniqueId());
  for (const std::string& tmpl : options_.unique_id_key_templates) {
    WPUB_ASSIGN_OR_RETURN(std::string key, rendezvous::UniqueIdKey(tmpl, d.group_name, 0));
    store_->Set(key, std::vector<uint8_t>(id.begin(), id.end()));
  }
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<engines::SglangDriver> driver,
                        engines::SglangDriver::Create(d));
  NcclCommOptions co;
  co.device = options_.device;
  co.nranks = driver->layout().world_size;
  co.rank = 0;
  co.id = id;
  co.ctas = options_.nccl_ctas;
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<NcclComm> comm, NcclComm::Create(co));
  driver_ = std::move(driver);
  {
    std::lock_guard lock(mu_);
    comm_ = std::move(comm);
  }
  driver_->StartJoin();
  if (absl::Status s = driver_->WaitIdle(absl::Now() + timeout); !s.ok()) {
    TearDownGroup();  // also the engines that did join: never half-connected
    const std::string why =
        absl::StrCat("weight-update group ", d.group_name, " did not form: ", s.message());
    return absl::IsDeadlineExceeded(s) ? absl::DeadlineExceededError(why)
                                       : absl::UnavailableError(why);
  }
  group_healthy_ = true;
  if (!options_.model_info_endpoint.empty()) {
    // What each engine serves now: a daemon that restarted learns the version to go beyond.
    const std::vector<uint64_t> versions = engines::FetchWeightVersions(
        alive, options_.model_info_endpoint, std::min(options_.sglang.connect_timeout, timeout));
    std::lock_guard lock(info_mu_);
    for (size_t i = 0; i < alive.size(); ++i) {
      uint64_t& v = weight_versions_[alive[i].url];
      v = std::max(v, versions[i]);
    }
  }
  PublishInfo();
  return absl::OkStatus();
}

absl::StatusOr<engine::EngineGroupInfo> NcclTransport::Connect(
    const engine::EngineConnectRequest& request) {
  WPUB_RETURN_IF_ERROR(engine::ValidateEngineConnectRequest(request));
  std::lock_guard lock(connect_mu_);
  if (in_flight_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "publication ", version_, " is in flight on the NCCL transport; connect after it ends"));
  }
  std::vector<engines::EngineSpec> want;
  for (const engine::EngineEndpoint& e : request.engines) want.push_back({e.url, e.gpus});
  const std::string base = request.group_name.empty() ? base_group_ : request.group_name;
  const absl::Duration timeout =
      request.timeout > absl::ZeroDuration() ? request.timeout : options_.join_timeout;
  engines_.clear();  // a failure below leaves no engines
  absl::Status s = Form(want, base, timeout, /*strict=*/true);
  if (s.ok()) {
    engines_ = want;
    base_group_ = base;
  }
  PublishInfo();
  if (!s.ok()) return s;
  return Group();
}

engine::EngineGroupInfo NcclTransport::Group() const {
  engine::EngineGroupInfo g;
  {
    std::lock_guard lock(info_mu_);
    g = info_;
  }
  // Live state: a failure or an abort since the snapshot marks the group down.
  g.healthy = g.healthy && group_healthy_;
  std::set<std::string> dirty;
  {
    std::lock_guard lock(info_mu_);
    dirty = dirty_;
  }
  for (engine::ConnectedEngine& e : g.engines) {
    if (e.state == engine::ReceiverState::kLeft) continue;
    e.state = !g.healthy   ? engine::ReceiverState::kFailed
              : in_flight_ ? engine::ReceiverState::kReceiving
                           : engine::ReceiverState::kIdle;
    // Paused with a possible mix of versions until a complete one reaches it.
    if (dirty.count(e.url) && e.state != engine::ReceiverState::kReceiving) {
      e.state = engine::ReceiverState::kDirty;
    }
  }
  return g;
}

engine::TransportCapabilities NcclTransport::capabilities() const {
  engine::TransportCapabilities c;
  c.name = "nccl";
  c.host_buckets = true;
  c.device_buckets = true;
  c.receiver_paced = false;
  c.acknowledges_checksums = false;
  c.applies_on_receipt = true;  // SGLang loads each bucket into its live weights
  return c;
}

absl::StatusOr<std::vector<std::string>> NcclTransport::Begin(
    const engine::PublicationManifest& m) {
  std::lock_guard connect_lock(connect_mu_);
  if (in_flight_) {
    return absl::FailedPreconditionError(
        absl::StrCat("NCCL transport: publication ", version_, " is in flight"));
  }
  StopWatchdog();  // left running by an Abort from another thread
  {
    std::lock_guard lock(mu_);
    failure_ = absl::OkStatus();
  }
  if (engines_.empty()) {
    // No engines connected (yet, or after a failed ConnectEngines): no participants here; the
    // publication reaches the other transports' receivers only.
    if (driver_) TearDownGroup();
    version_ = m.version;
    in_flight_ = true;
    return std::vector<std::string>{};
  }
  if (!group_healthy_ || !comm_ || comm_->aborted()) {
    // Re-formation after a failure: the engines that answer their health check.
    absl::Status s = Form(engines_, base_group_, options_.join_timeout, /*strict=*/false);
    PublishInfo();
    WPUB_RETURN_IF_ERROR(s);
  }
  version_ = m.version;
  in_flight_ = true;
  bcast_count_ = 0;
  publication_deadline_ = absl::Now() + options_.publication_deadline;
  driver_->BeginPublication(m.version);
  resume_pending_ = true;
  StartWatchdog();
  std::vector<std::string> names;
  for (const auto& e : driver_->options().engines) names.push_back(e.url);
  return names;
}

absl::Status NcclTransport::SendDevice(const engine::BucketManifest& manifest, const void* data,
                                       uint64_t nbytes, cudaEvent_t ready, cudaEvent_t done) {
  if (!in_flight_) return absl::FailedPreconditionError("NCCL transport: no publication begun");
  WPUB_RETURN_IF_ERROR(failure());
  if (!driver_) {
    // No engines: nothing to broadcast, but the backend reuses the buffer after `done`.
    WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comm_stream_, ready, 0));
    WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(done, comm_stream_));
    return absl::OkStatus();
  }
  // The engine posts its receive inside this request's handler: issue it first.
  driver_->PostBucket(manifest);
  if (!comm_->ready()) {
    absl::Status s = comm_->WaitReady(publication_deadline_, [this] { return !failure().ok(); });
    if (!s.ok()) {
      // The keys engines asked the store for tell a wrong unique-id key template at once.
      Fail(absl::AbortedError(absl::StrCat(
          "NCCL group did not become ready: ", s.message(), " (keys engines asked the store for: ",
          absl::StrJoin(store_->RecentlyAwaitedKeys(), ", "), ")")));
      return failure();
    }
  }
  WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comm_stream_, ready, 0));
  while (bcast_events_.size() < 2 * (bcast_count_ + 1)) {
    cudaEvent_t e = nullptr;
    WPUB_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    bcast_events_.push_back(e);
  }
  const size_t timed = bcast_count_;  // counted once both of its events are recorded
  WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(bcast_events_[2 * timed], comm_stream_));
  if (absl::Status s = comm_->Broadcast(const_cast<void*>(data), nbytes, 0, comm_stream_);
      !s.ok()) {
    Fail(absl::AbortedError(absl::StrCat("bucket ", manifest.index, ": ", s.message())));
    return failure();
  }
  WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(bcast_events_[2 * timed + 1], comm_stream_));
  ++bcast_count_;
  WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(done, comm_stream_));
  return absl::OkStatus();
}

NcclTransport::BroadcastTiming NcclTransport::last_broadcast_timing() const {
  BroadcastTiming t;
  for (size_t i = 0; i < bcast_count_; ++i) {
    float busy = 0, idle = 0;
    if (cudaEventElapsedTime(&busy, bcast_events_[2 * i], bcast_events_[2 * i + 1]) !=
            cudaSuccess ||
        (i > 0 && cudaEventElapsedTime(&idle, bcast_events_[2 * i - 1], bcast_events_[2 * i]) !=
                      cudaSuccess)) {
      (void)cudaGetLastError();
      return BroadcastTiming();
    }
    t.busy.push_back(busy / 1e3);
    if (i > 0) t.idle.push_back(idle / 1e3);
  }
  return t;
}

absl::Status NcclTransport::Send(std::shared_ptr<const engine::Bucket> bucket) {
  const uint64_t n = bucket->bytes.size();
  // The previous host bucket's broadcast must be done before its buffer is overwritten.
  gpu::HostSyncs uncounted(nullptr);
  WPUB_RETURN_IF_ERROR(uncounted.EventSynchronize(host_done_, "host bucket buffer reuse"));
  if (n > host_staging_bytes_) {
    if (host_staging_ != nullptr) cudaFree(host_staging_);
    host_staging_ = nullptr;
    host_staging_bytes_ = 0;
    WPUB_CUDA_RETURN_IF_ERROR(cudaMalloc(&host_staging_, n));
    host_staging_bytes_ = n;
  }
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_staging_, bucket->bytes.data(), n,
                                            cudaMemcpyHostToDevice, comm_stream_));
  WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(host_done_, comm_stream_));
  return SendDevice(bucket->manifest, host_staging_, n, host_done_, host_done_);
}

absl::Status NcclTransport::WaitAcknowledged(absl::Time deadline) {
  if (!in_flight_) return absl::FailedPreconditionError("NCCL transport: no publication begun");
  const absl::Time d = std::min(deadline, publication_deadline_);
  // The engines answer their bucket requests once their receives completed.
  for (;;) {
    if (!driver_) break;  // no engines
    WPUB_RETURN_IF_ERROR(failure());
    const absl::Time step = std::min(d, absl::Now() + absl::Milliseconds(20));
    absl::Status s = driver_->WaitIdle(step);
    if (s.ok()) break;
    if (!absl::IsDeadlineExceeded(s) || absl::Now() >= d) {
      Fail(absl::IsDeadlineExceeded(s) ? absl::DeadlineExceededError(absl::StrCat(
                                             "publication ", version_, ": ", s.message()))
                                       : s);
      return failure();
    }
  }
  // And rank 0's side of every broadcast is complete: the last one's end event, polled (no
  // blocking wait).
  if (bcast_count_ == 0) return absl::OkStatus();
  const cudaEvent_t last = bcast_events_[2 * bcast_count_ - 1];
  for (;;) {
    const cudaError_t q = cudaEventQuery(last);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) {
      return absl::InternalError(absl::StrCat("comm stream: ", cudaGetErrorString(q)));
    }
    WPUB_RETURN_IF_ERROR(failure());
    if (absl::Now() >= d) {
      Fail(absl::DeadlineExceededError("broadcasts did not complete before the deadline"));
      return failure();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

absl::Status NcclTransport::Commit() {
  if (!in_flight_) return absl::FailedPreconditionError("NCCL transport: no publication begun");
  StopWatchdog();
  WPUB_RETURN_IF_ERROR(failure());
  if (!driver_) {  // no engines
    in_flight_ = false;
    return absl::OkStatus();
  }
  driver_->EndPublication();
  resume_pending_ = false;
  absl::Status s = driver_->WaitIdle(absl::Now() + options_.sglang.request_timeout);
  {
    // An engine that applied the whole version is clean again; one whose end calls failed
    // may have applied part of it and stays dirty.
    std::lock_guard lock(info_mu_);
    for (const engines::EngineOutcome& o : driver_->outcomes()) {
      if (o.failed) {
        dirty_.insert(o.url);
      } else {
        dirty_.erase(o.url);
        weight_versions_[o.url] = version_;
      }
    }
  }
  in_flight_ = false;
  last_outcomes_ = Outcomes();
  return s;
}

void NcclTransport::Abort(absl::string_view reason) {
  Fail(absl::AbortedError(absl::StrCat("publication ", version_, " aborted: ", reason)));
  {
    std::lock_guard lock(mu_);
    last_outcomes_.clear();
  }
  ResumeCleanEngines();
  in_flight_ = false;
}

void NcclTransport::ResumeCleanEngines() {
  // Begin (which replaces driver_) holds connect_mu_ for as long as it forms a group: an abort
  // arriving then leaves the resume to the publication thread's own Abort, which follows.
  std::unique_lock connect_lock(connect_mu_, std::try_to_lock);
  if (!connect_lock.owns_lock() || !driver_ || !resume_pending_.exchange(false)) return;
  std::set<std::string> still_dirty;
  {
    std::lock_guard lock(info_mu_);
    still_dirty = dirty_;
  }
  const std::vector<bool> dirty = driver_->ResumeAfterAbort(still_dirty);
  const auto& engines = driver_->options().engines;
  std::lock_guard lock(info_mu_);
  for (size_t i = 0; i < dirty.size() && i < engines.size(); ++i) {
    if (dirty[i]) dirty_.insert(engines[i].url);
  }
}

std::vector<std::string> NcclTransport::dirty_engines() const {
  std::lock_guard lock(info_mu_);
  return std::vector<std::string>(dirty_.begin(), dirty_.end());
}

void NcclTransport::Fail(absl::Status why) {
  std::lock_guard lock(mu_);
  if (failure_.ok()) failure_ = std::move(why);
  if (comm_) comm_->Abort();
  group_healthy_ = false;
}

absl::Status NcclTransport::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

void NcclTransport::StartWatchdog() {
  {
    std::lock_guard lock(mu_);
    watchdog_stop_ = false;
  }
  watchdog_ = std::thread([this] {
    std::unique_lock lock(mu_);
    while (!watchdog_stop_) {
      cv_.wait_for(lock, absl::ToChronoNanoseconds(options_.watchdog_interval));
      if (watchdog_stop_ || !failure_.ok()) continue;
      NcclComm* comm = comm_.get();
      lock.unlock();
      absl::Status why;
      if (comm != nullptr) {
        if (absl::Status s = comm->AsyncError(); !s.ok()) why = s;
      }
      if (why.ok() && driver_->any_failed()) {
        std::vector<std::string> errs;
        for (const auto& o : driver_->outcomes()) {
          if (o.failed) errs.push_back(o.error);
        }
        why = absl::AbortedError(absl::StrJoin(errs, "; "));
      }
      if (why.ok() && absl::Now() > publication_deadline_) {
        why = absl::DeadlineExceededError(absl::StrCat(
            "publication ", version_, " did not reach every engine within ",
            absl::FormatDuration(options_.publication_deadline), "; NCCL communicator aborted"));
      }
      if (!why.ok()) Fail(why);
      lock.lock();
    }
  });
}

void NcclTransport::StopWatchdog() {
  {
    std::lock_guard lock(mu_);
    watchdog_stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

std::vector<engine::ReceiverOutcome> NcclTransport::Outcomes() const {
  if (!driver_) return {};
  const absl::Status f = failure();
  std::vector<engine::ReceiverOutcome> out;
  bool any_engine_failed = false;
  for (const auto& o : driver_->outcomes()) any_engine_failed |= o.failed;
  std::set<std::string> dirty;
  {
    std::lock_guard lock(info_mu_);
    dirty = dirty_;
  }
  for (const auto& o : driver_->outcomes()) {
    engine::ReceiverOutcome r;
    r.name = o.url;
    // Holds part of a version that has not committed: left dirty by an abort, or (in flight)
    // it would be if this attempt ended now.
    r.dirty = dirty.count(o.url) > 0 || (in_flight_ && o.updates_sent > 0);
    if (o.failed || (!f.ok() && !any_engine_failed)) {
      r.state = engine::ReceiverState::kFailed;
      r.error = o.failed ? o.error : std::string(f.message());
      r.failure = Classify(r.error);
    } else {
      r.state = in_flight_ ? engine::ReceiverState::kReceiving : engine::ReceiverState::kStaged;
      r.committed = !in_flight_ && f.ok();
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<engine::ReceiverInfo> NcclTransport::Receivers() const {
  std::vector<engine::ReceiverInfo> out;
  for (const engine::ConnectedEngine& e : Group().engines) {
    engine::ReceiverInfo r;
    r.name = e.url;
    r.state = e.state == engine::ReceiverState::kFailed ? engine::ReceiverState::kLeft : e.state;
    out.push_back(std::move(r));
  }
  // Dirty engines no longer in the group (it re-formed without them) are still paused.
  std::set<std::string> listed;
  for (const auto& r : out) listed.insert(r.name);
  for (const std::string& url : dirty_engines()) {
    if (listed.count(url)) continue;
    engine::ReceiverInfo r;
    r.name = url;
    r.state = engine::ReceiverState::kDirty;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace wpub::nccl
