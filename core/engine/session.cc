// One publication: ingestion and policy per batch, then Commit runs the executor phases
// (policy/planning -> quantize -> pack -> transfer -> commit) and ends the state machine.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"
#include "core/engine/engine_impl.h"
#include "core/engine/planner.h"

namespace wpub::engine {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ABORTED naming every failed receiver, or OK when none failed.
absl::Status FailureFromOutcomes(const std::vector<ReceiverOutcome>& outcomes) {
  std::vector<std::string> why;
  for (const ReceiverOutcome& o : outcomes) {
    if (o.failure != ReceiverFailure::kNone) why.push_back(o.error);
  }
  if (why.empty()) return absl::OkStatus();
  return absl::AbortedError(absl::StrJoin(why, "; "));
}

}  // namespace

CudaIpcResolveFn PublicationSession::State::ResolveFn(Engine::Impl* engine) {
  if (!engine->cuda_ipc) return nullptr;
  return [engine](const CudaIpcSource& source, uint64_t bytes, absl::string_view tensor) {
    std::lock_guard lock(engine->ipc_mu);
    return engine->cuda_ipc->Resolve(source, bytes, tensor);
  };
}

PublicationSession::State::State(std::shared_ptr<Engine::Impl> engine, PublicationHeader header,
                                 ParsedRecipe recipe, std::unique_ptr<policy::Policy> policy,
                                 uint64_t bucket_bytes)
    : engine_(std::move(engine)),
      header_(std::move(header)),
      recipe_(std::move(recipe)),
      policy_(std::move(policy)),
      bucket_bytes_(bucket_bytes),
      opened_at_(absl::Now()),
      t_open_(Clock::now()),
      store_(engine_->options.max_inline_bytes, ResolveFn(engine_.get())) {}

bool PublicationSession::State::ended() const {
  std::lock_guard lock(mu_);
  return ended_;
}

absl::Status PublicationSession::State::CheckOpen() const {
  if (ended_) {
    return absl::FailedPreconditionError(
        absl::StrCat("publication ", header_.version, " has ended: ", end_status_.ToString()));
  }
  if (commit_called_) {
    return absl::FailedPreconditionError(
        absl::StrCat("publication ", header_.version, " is already committing"));
  }
  return absl::OkStatus();
}

PublicationReport PublicationSession::State::MakeReport(PublicationStatus outcome,
                                                        const absl::Status& status) const {
  PublicationReport r;
  r.status = outcome;
  r.version = header_.version;
  r.model_id = header_.model_id;
  r.recipe = recipe_.canonical;
  r.code = status.code();
  r.error = std::string(status.message());
  r.started_at = opened_at_;
  r.wall_seconds = Since(t_open_);
  r.tensors_quantized = tensors_quantized_.load();
  r.tensors_passthrough = tensors_passthrough_.load();
  r.tensors_ignored = tensors_ignored_.load();
  r.bytes_in = bytes_in_.load();
  r.attempts = static_cast<uint32_t>(attempts_);
  return r;
}

absl::Status PublicationSession::State::End(PublicationStatus outcome, absl::Status status) {
  {
    std::lock_guard lock(mu_);
    if (ended_) return status;
    ended_ = true;
    end_status_ = status;
    state_ = PublicationState::kAborted;
    if (transport_begun_) engine_->transports->Abort(status.message());
  }
  PublicationReport report = MakeReport(outcome, status);
  if (commit_called_) {  // the producer thread owns these fields
    report.phases = phases_;
    report.non_finite = non_finite_;
  }
  engine_->Finish(this, report);
  return status;
}

PublicationReport PublicationSession::State::AbortedReport(absl::Status why) {
  bool begun;
  {
    std::lock_guard lock(mu_);
    if (abort_requested_) why = end_status_;
    begun = transport_begun_;
  }
  if (begun) engine_->transports->Abort(why.message());
  std::vector<ReceiverOutcome> outcomes;
  if (begun) outcomes = engine_->transports->Outcomes();
  {
    std::lock_guard lock(mu_);
    ended_ = true;
    end_status_ = why;
    state_ = PublicationState::kAborted;
  }
  PublicationReport report = MakeReport(PublicationStatus::kAborted, why);
  report.phases = phases_;
  report.non_finite = non_finite_;
  report.bytes_out = bytes_out_;
  report.bytes_out_by_format = bytes_by_format_;
  report.buckets = num_buckets_;
  report.host_syncs = syncs_.count();
  report.receivers = std::move(outcomes);
  report.retry_errors = retry_errors_;
  engine_->Finish(this, report);
  return report;
}

absl::Status PublicationSession::State::AddBatch(BatchInput batch) {
  {
    std::lock_guard lock(mu_);
    WPUB_RETURN_IF_ERROR(CheckOpen());
  }
  const uint64_t index = store_.num_batches();
  if (batch.tensors.empty()) {
    return End(PublicationStatus::kFailed,
               absl::InvalidArgumentError(
                   absl::StrCat("batch ", index, " (", batch.megatron_name, ") has no tensors")));
  }
  if (absl::Status s = store_.AddBatch(index, batch.tensors); !s.ok()) {
    return End(PublicationStatus::kFailed, s);
  }
  const auto t0 = Clock::now();
  std::vector<TensorDesc> descs;
  descs.reserve(batch.tensors.size());
  for (const TensorInput& t : batch.tensors) descs.push_back(t.desc);
  absl::StatusOr<policy::BatchPlan> plan = policy_->PlanBatch(batch.megatron_name, descs);
  policy_seconds_in_ingest_ += Since(t0);
  if (!plan.ok()) return End(PublicationStatus::kFailed, plan.status());
  uint64_t q = 0, p = 0, ig = 0;
  for (size_t i = 0; i < plan->tensors.size(); ++i) {
    const policy::TensorPlan& tp = plan->tensors[i];
    const TensorInput& in = batch.tensors[i];
    if (tp.action == policy::Action::kPass) {
      ++(tp.reason == policy::Reason::kIgnored ? ig : p);
      continue;
    }
    ++q;
    if (tp.num_outputs != 3) {
      return End(PublicationStatus::kFailed,
                 absl::InternalError(absl::StrCat("tensor ", in.desc.name, ": policy planned ",
                                                  tp.num_outputs, " outputs, expected 3")));
    }
    if (in.desc.numel() == 0) {
      return End(PublicationStatus::kFailed,
                 absl::InvalidArgumentError(absl::StrCat("tensor ", in.desc.name,
                                                         ": cannot quantize an empty tensor ",
                                                         ShapeString(in.desc.shape))));
    }
    const bool split_slices = in.desc.shape.size() == 3 && in.concat_dim == 0;
    if (!split_slices && in.parts.size() > static_cast<size_t>(kernels::kMaxWeightParts)) {
      return End(PublicationStatus::kFailed,
                 absl::InvalidArgumentError(absl::StrCat(
                     "tensor ", in.desc.name, ": ", in.parts.size(), " parts exceed the ",
                     kernels::kMaxWeightParts, " a quantized tensor may have")));
    }
  }
  plans_.push_back(*std::move(plan));
  tensors_quantized_ += q;
  tensors_passthrough_ += p;
  tensors_ignored_ += ig;
  bytes_in_.store(store_.bytes_in());
  num_tensors_ += batch.tensors.size();
  ++num_batches_;
  return absl::OkStatus();
}

absl::Status PublicationSession::State::AppendInline(uint64_t batch, uint32_t tensor, uint32_t part,
                                                     uint64_t offset,
                                                     absl::Span<const uint8_t> bytes) {
  {
    std::lock_guard lock(mu_);
    WPUB_RETURN_IF_ERROR(CheckOpen());
  }
  if (absl::Status s = store_.AppendInline(batch, tensor, part, offset, bytes); !s.ok()) {
    return End(PublicationStatus::kFailed, s);
  }
  return absl::OkStatus();
}

absl::StatusOr<ExecutionPlan> PublicationSession::State::BuildPlan(
    std::vector<uint32_t>* unit_sizes) {
  ExecutionPlan plan;
  plan.version = header_.version;
  plan.mode = recipe_.mode;
  plan.allow_non_finite = header_.allow_non_finite;
  plan.inputs = &store_.tensors();
  for (size_t b = 0; b < plans_.size(); ++b) {
    const policy::BatchPlan& bp = plans_[b];
    const size_t base = store_.FlatIndex(b, 0);
    const int group_base = static_cast<int>(plan.amax_groups.size());
    for (const policy::AmaxGroup& g : bp.amax_groups) {
      AmaxGroupPlan gp;
      gp.slices = g.slices;
      for (int m : g.members) gp.members.push_back(base + static_cast<size_t>(m));
      plan.amax_groups.push_back(std::move(gp));
    }
    for (size_t i = 0; i < bp.tensors.size(); ++i) {
      const policy::TensorPlan& tp = bp.tensors[i];
      const size_t input = base + i;
      if (tp.action == policy::Action::kPass) {
        plan.outputs.push_back(store_.tensors()[input].desc);
        plan.sources.push_back(OutputSource{OutputKind::kPassthrough, input, -1});
        unit_sizes->push_back(1);
        bytes_by_format_[std::string(DTypeName(plan.outputs.back().dtype))] +=
            static_cast<uint64_t>(plan.outputs.back().nbytes());
        continue;
      }
      const int group = group_base + tp.amax_group;
      static constexpr OutputKind kKinds[3] = {OutputKind::kPacked, OutputKind::kScales,
                                               OutputKind::kDecodeScale};
      static constexpr DType kTypes[3] = {DType::kUInt8, DType::kFloat8E4M3, DType::kFloat32};
      for (size_t k = 0; k < 3; ++k) {
        const TensorDesc& out = bp.outputs[tp.first_output + k];
        if (out.dtype != kTypes[k]) {
          return absl::InternalError(
              absl::StrCat("policy output ", out.name, " has dtype ", DTypeName(out.dtype)));
        }
        plan.outputs.push_back(out);
        plan.sources.push_back(OutputSource{kKinds[k], input, group});
        bytes_by_format_["nvfp4"] += static_cast<uint64_t>(out.nbytes());
      }
      unit_sizes->push_back(3);
    }
  }
  WPUB_ASSIGN_OR_RETURN(plan.buckets, PlanBuckets(plan.outputs, *unit_sizes, bucket_bytes_));
  WPUB_RETURN_IF_ERROR(CheckLayout(plan.buckets, plan.outputs, *unit_sizes, bucket_bytes_));
  return plan;
}

absl::Status PublicationSession::State::Transfer(const ExecutionPlan& plan,
                                                 const PublicationManifest& manifest,
                                                 bool* bad_input) {
  Transport* transport = engine_->transports.get();
  {
    std::lock_guard lock(mu_);
    if (abort_requested_) return end_status_;
    transport_begun_ = true;
  }
  bytes_out_ = 0;
  auto t0 = Clock::now();
  if (absl::Status s = transport->Begin(manifest).status(); !s.ok()) return s;
  phases_.transfer += Since(t0);
  {
    std::lock_guard lock(mu_);
    if (abort_requested_) return end_status_;
  }

  // The one road of a bucket: backend -> emit -> the transport group -> each transport.
  ExecutionHooks hooks;
  hooks.syncs = &syncs_;
  hooks.emit = [&](std::shared_ptr<const Bucket> bucket) {
    const auto t = Clock::now();
    bytes_out_ += bucket->manifest.nbytes;
    absl::Status s = transport->Send(std::move(bucket));
    phases_.transfer += Since(t);
    return s;
  };
  hooks.cancelled = [&] {
    {
      std::lock_guard lock(mu_);
      if (abort_requested_) return true;
    }
    return !FailureFromOutcomes(transport->Outcomes()).ok();
  };
  absl::StatusOr<ExecutionResult> executed = engine_->backend->Execute(plan, hooks);
  if (!executed.ok()) {
    // INVALID_ARGUMENT is the trainer's input (e.g. non-finite weights): the caller fails the
    // publication; anything else is the transfer's.
    if (absl::IsInvalidArgument(executed.status())) {
      *bad_input = true;
      return executed.status();
    }
    absl::Status why = FailureFromOutcomes(transport->Outcomes());
    return why.ok() ? executed.status() : why;
  }
  phases_.quantize += executed->quantize_seconds;
  phases_.pack += executed->pack_seconds;
  non_finite_ = executed->non_finite;

  t0 = Clock::now();
  absl::Status acked = transport->WaitAcknowledged(absl::Now() + engine_->options.ack_deadline);
  phases_.transfer += Since(t0);
  return acked;
}

absl::StatusOr<PublicationReport> PublicationSession::State::Commit() {
  {
    std::lock_guard lock(mu_);
    WPUB_RETURN_IF_ERROR(CheckOpen());
    commit_called_ = true;
  }
  const auto t_commit = Clock::now();
  phases_.policy = policy_seconds_in_ingest_;
  phases_.ingest =
      std::chrono::duration<double>(t_commit - t_open_).count() - policy_seconds_in_ingest_;
  if (num_tensors_.load() == 0) {
    return End(PublicationStatus::kFailed,
               absl::InvalidArgumentError(
                   absl::StrCat("publication ", header_.version, " is empty (no tensors)")));
  }
  if (absl::Status s = store_.CheckComplete(); !s.ok()) {
    return End(PublicationStatus::kFailed, s);
  }
  // A quantizing recipe whose plans quantize nothing (names the policy did not recognize).
  if (absl::Status s = policy::CheckQuantizesAnything(policy_->settings(), plans_); !s.ok()) {
    return End(PublicationStatus::kFailed, s);
  }
  state_ = PublicationState::kStaged;

  // Policy/planning.
  auto t0 = Clock::now();
  std::vector<uint32_t> units;
  absl::StatusOr<ExecutionPlan> plan = BuildPlan(&units);
  if (!plan.ok()) return End(PublicationStatus::kFailed, plan.status());
  PublicationManifest manifest;
  manifest.version = header_.version;
  manifest.model_id = header_.model_id;
  manifest.recipe = recipe_.canonical;
  for (const BucketLayout& b : plan->buckets) {
    manifest.buckets.push_back(MakeBucketManifest(b, plan->outputs));
  }
  num_buckets_ = static_cast<uint32_t>(manifest.buckets.size());
  phases_.policy += Since(t0);

  Transport* transport = engine_->transports.get();
  if (const size_t n = transport->Receivers().size(); n < engine_->options.min_receivers) {
    return AbortedReport(absl::FailedPreconditionError(
        absl::StrCat("publication ", header_.version, " needs at least ",
                     engine_->options.min_receivers, " receivers, ", n, " connected")));
  }
  // The transfer, retried while an aborted attempt left receivers that apply on receipt dirty
  // (their live weights may mix two versions) and the inputs are still held here.
  for (;;) {
    ++attempts_;
    manifest.attempt = static_cast<uint32_t>(attempts_);
    bool bad_input = false;
    absl::Status sent = Transfer(*plan, manifest, &bad_input);
    if (sent.ok()) break;
    if (bad_input) return End(PublicationStatus::kFailed, sent);
    std::vector<std::string> dirty;
    for (const ReceiverOutcome& o : transport->Outcomes()) {
      if (o.dirty) dirty.push_back(o.name);
    }
    bool stop;
    {
      std::lock_guard lock(mu_);
      stop = abort_requested_;
    }
    if (stop || dirty.empty() || attempts_ >= engine_->options.max_attempts) {
      return AbortedReport(sent);
    }
    // Ends this attempt on every transport (the next Begin re-forms what failed).
    transport->Abort(absl::StrCat("attempt ", attempts_, " failed (", sent.message(),
                                  "); retrying for the dirty receivers ",
                                  absl::StrJoin(dirty, ", ")));
    retry_errors_.push_back(std::string(sent.message()));
  }

  t0 = Clock::now();
  {
    std::lock_guard lock(mu_);
    if (abort_requested_) {
      // Released below by AbortedReport (which takes mu_ itself).
    } else {
      committing_ = true;
      if (absl::Status s = transport->Commit(); !s.ok()) {
        // A receiver failed after its last acknowledgement (e.g. it left): name it.
        const absl::Status why = FailureFromOutcomes(transport->Outcomes());
        committing_ = false;
        abort_requested_ = true;
        end_status_ = why.ok() ? s : why;
      }
    }
  }
  if (!committing_) return AbortedReport(end_status_);
  PublicationReport report = MakeReport(PublicationStatus::kCommitted, absl::OkStatus());
  report.receivers = transport->Outcomes();
  report.retry_errors = retry_errors_;
  {
    std::lock_guard lock(mu_);
    ended_ = true;
    state_ = PublicationState::kCommitted;
  }
  phases_.commit = Since(t0);
  report.phases = phases_;
  report.wall_seconds = Since(t_open_);
  report.host_syncs = syncs_.count();
  report.bytes_out = bytes_out_;
  report.bytes_out_by_format = bytes_by_format_;
  report.non_finite = non_finite_;
  report.buckets = num_buckets_;
  engine_->Finish(this, report);
  return report;
}

void PublicationSession::State::Abort(absl::Status why) {
  Stop(std::move(why), PublicationStatus::kAborted);
}

void PublicationSession::State::Stop(absl::Status why, PublicationStatus outcome) {
  if (why.ok()) why = absl::AbortedError("aborted without a reason");
  {
    std::lock_guard lock(mu_);
    if (ended_ || committing_) return;
    if (commit_called_) {
      // The Commit thread ends the publication; make it stop promptly.
      if (!abort_requested_) {
        abort_requested_ = true;
        end_status_ = why;
        if (transport_begun_) engine_->transports->Abort(why.message());
      }
      return;
    }
    ended_ = true;
    end_status_ = why;
    state_ = PublicationState::kAborted;
  }
  engine_->Finish(this, MakeReport(outcome, why));
}

// ---------------------------------------------------------------------------------------------
// PublicationSession: a thin handle over State.

PublicationSession::PublicationSession(uint64_t version, std::shared_ptr<State> state)
    : version_(version), state_(std::move(state)) {}

PublicationSession::~PublicationSession() {
  state_->Abort(absl::CancelledError(
      absl::StrCat("publication ", version_, " was cancelled (closed before commit)")));
}

absl::Status PublicationSession::AddBatch(BatchInput batch) {
  return state_->AddBatch(std::move(batch));
}

uint64_t PublicationSession::num_batches() const { return state_->num_batches(); }

absl::Status PublicationSession::AppendInline(uint64_t batch_index, uint32_t tensor_index,
                                              uint32_t part_index, uint64_t offset,
                                              absl::Span<const uint8_t> bytes) {
  return state_->AppendInline(batch_index, tensor_index, part_index, offset, bytes);
}

absl::StatusOr<PublicationReport> PublicationSession::Commit() { return state_->Commit(); }

void PublicationSession::Abort(absl::Status why) { state_->Abort(std::move(why)); }
void PublicationSession::Fail(absl::Status why) {
  state_->Stop(std::move(why), PublicationStatus::kFailed);
}

}  // namespace wpub::engine
