// One publication: its construction, ingestion (AddBatch, AppendInline, policy per batch), the
// one way it ends (the Lifecycle's terminal transition, the report, the engine's ledger) and the
// PublicationSession handle. Commit's steps are in session_commit.cc.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/engine/engine_impl.h"

namespace wpub::engine {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

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
      lifecycle_(header_.version,
                 [this](absl::string_view reason) {
                   // A group version another member sent to the engines this one shares: none
                   // of them may resume with a mix (whichever path ends the publication).
                   if (std::shared_ptr<GroupVote> v = vote(); v && v->others_may_have_sent()) {
                     engine_->transports().MarkParticipantsDirty();
                   }
                   engine_->transports().Abort(reason);
                 }),
      store_(engine_->options().max_inline_bytes, engine_->ResolveFn()) {}

// ---------------------------------------------------------------------------------------------
// Ending

PublicationReport PublicationSession::State::MakeReport(const Lifecycle::Ending& ending) const {
  PublicationReport r;
  r.status = ending.outcome;
  r.version = header_.version;
  r.model_id = header_.model_id;
  r.recipe = recipe_.canonical;
  r.code = ending.status.code();
  r.error = std::string(ending.status.message());
  r.started_at = opened_at_;
  r.wall_seconds = Since(t_open_);
  r.tensors_quantized = tensors_quantized_.load();
  r.tensors_passthrough = tensors_passthrough_.load();
  r.tensors_ignored = tensors_ignored_.load();
  r.bytes_in = bytes_in_.load();
  r.attempts = static_cast<uint32_t>(attempts_);
  if (std::shared_ptr<GroupVote> v = vote()) r.group = v->Summary();
  // Only the Commit thread ends a publication whose Commit ran (Stop merely records a request
  // then), so it alone reads the commit path's fields here.
  if (!ending.commit_ran) return r;
  r.phases = phases_;
  r.non_finite = non_finite_;
  // Bad input: the transfer (if any) was cut short by the trainer's data, not by a receiver.
  if (ending.outcome == PublicationStatus::kFailed) return r;
  r.bytes_out = bytes_out_;
  r.bytes_out_by_format = bytes_by_format_;
  r.buckets = num_buckets_;
  r.host_syncs = syncs_.count();
  r.retry_errors = retry_errors_;
  if (ending.transfer_begun) r.receivers = engine_->transports().Outcomes();
  return r;
}

PublicationReport PublicationSession::State::Conclude(const Lifecycle::Ending& ending) {
  if (std::shared_ptr<GroupVote> v = vote(); v && ending.outcome != PublicationStatus::kCommitted) {
    // The leader aborts the version on every member (no-op once it decided).
    v->Fail(ending.status);
  }
  PublicationReport report = MakeReport(ending);
  // The backend's memory, when asked, before the ledger lets the next publication in (its
  // Execute must not run beside the release). However this one ended, nothing reads the
  // buffers now: a Commit that ran ends here after its transports committed or aborted, and
  // one that did not run never used them.
  if (engine_->options().release_backend_memory || header_.release_backend_memory) {
    const uint64_t freed = engine_->backend().ReleaseMemory();
    if (freed > 0) {
      spdlog::info("v{}: released {} bytes of backend memory", header_.version, freed);
    }
  }
  engine_->Record(this, report);
  return report;
}

absl::StatusOr<PublicationReport> PublicationSession::State::End(PublicationStatus outcome,
                                                                 absl::Status status) {
  const Lifecycle::Ending ending = lifecycle_.End(outcome, std::move(status));
  if (!ending.ended_now) {
    return absl::FailedPreconditionError(absl::StrCat(
        "publication ", header_.version, " cannot end ", PublicationStatusName(outcome), " while ",
        LifecycleStageName(lifecycle_.stage())));
  }
  return Conclude(ending);
}

absl::Status PublicationSession::State::Reject(absl::Status status) {
  End(PublicationStatus::kFailed, status).IgnoreError();
  return status;
}

void PublicationSession::State::Stop(absl::Status why, PublicationStatus outcome) {
  if (why.ok()) why = absl::AbortedError("aborted without a reason");
  Lifecycle::Ending ending;
  if (lifecycle_.Stop(outcome, std::move(why), &ending) == Lifecycle::StopResult::kEnded) {
    Conclude(ending);
  }
}

// ---------------------------------------------------------------------------------------------
// The group

std::shared_ptr<GroupVote> PublicationSession::State::vote() const {
  std::lock_guard lock(vote_mu_);
  return vote_;
}

absl::Status PublicationSession::State::JoinGroup(const std::shared_ptr<State>& self) {
  std::weak_ptr<State> weak = self;
  auto on_abort = [weak](absl::Status why) {
    std::shared_ptr<State> state = weak.lock();
    if (state == nullptr) return;
    state->Stop(why, absl::IsInvalidArgument(why) ? PublicationStatus::kFailed
                                                  : PublicationStatus::kAborted);
  };
  absl::StatusOr<std::unique_ptr<GroupVote>> joined =
      engine_->group_joiner()->Join(header_, std::move(on_abort));
  if (!joined.ok()) {
    const absl::Status why(joined.status().code(),
                           absl::StrCat("group '", header_.group->group, "' member ",
                                        header_.group->member, ": ", joined.status().message()));
    return Reject(why);
  }
  std::lock_guard lock(vote_mu_);
  vote_ = *std::move(joined);
  return absl::OkStatus();
}

absl::Status PublicationSession::State::DeclareExpected(std::vector<std::string> names) {
  WPUB_RETURN_IF_ERROR(lifecycle_.CheckOpen());
  if (!header_.group.has_value() || header_.group->member != 0) {
    return Reject(absl::FailedPreconditionError(absl::StrCat(
        "publication ", header_.version,
        ": only the leader of a group (group.member 0) declares "
        "the expected tensors",
        header_.group ? absl::StrCat("; this is member ", header_.group->member) : "")));
  }
  if (expected_.size() + names.size() > kMaxGroupTensors) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("expected: more than ", kMaxGroupTensors, " tensor names declared")));
  }
  for (std::string& n : names) {
    if (n.empty() || n.size() > kMaxGroupTensorNameBytes) {
      return Reject(absl::InvalidArgumentError(
          absl::StrCat("expected: a tensor name of ", n.size(), " bytes (1 to ",
                       kMaxGroupTensorNameBytes, " allowed)")));
    }
    expected_bytes_ += n.size();
    if (expected_bytes_ > kMaxGroupNameBytes) {
      return Reject(absl::InvalidArgumentError(
          absl::StrCat("expected: the declared names exceed ", kMaxGroupNameBytes, " bytes")));
    }
    expected_.push_back(std::move(n));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Ingestion

absl::Status PublicationSession::State::AddBatch(BatchInput batch) {
  WPUB_RETURN_IF_ERROR(lifecycle_.CheckOpen());
  const uint64_t index = store_.num_batches();
  if (batch.tensors.empty()) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("batch ", index, " (", batch.megatron_name, ") has no tensors")));
  }
  if (absl::Status s = store_.AddBatch(index, batch.tensors); !s.ok()) {
    return Reject(s);
  }
  const auto t0 = Clock::now();
  std::vector<TensorDesc> descs;
  descs.reserve(batch.tensors.size());
  for (const TensorInput& t : batch.tensors) descs.push_back(t.desc);
  absl::StatusOr<policy::BatchPlan> plan = policy_->PlanBatch(batch.megatron_name, descs);
  policy_seconds_in_ingest_ += Since(t0);
  if (!plan.ok()) return Reject(plan.status());
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
      return Reject(absl::InternalError(absl::StrCat("tensor ", in.desc.name, ": policy planned ",
                                                     tp.num_outputs, " outputs, expected 3")));
    }
    if (in.desc.numel() == 0) {
      return Reject(absl::InvalidArgumentError(absl::StrCat("tensor ", in.desc.name,
                                                            ": cannot quantize an empty tensor ",
                                                            ShapeString(in.desc.shape))));
    }
    const bool split_slices = in.desc.shape.size() == 3 && in.concat_dim == 0;
    if (!split_slices && in.parts.size() > static_cast<size_t>(kernels::kMaxWeightParts)) {
      return Reject(absl::InvalidArgumentError(
          absl::StrCat("tensor ", in.desc.name, ": ", in.parts.size(), " parts exceed the ",
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
  WPUB_RETURN_IF_ERROR(lifecycle_.CheckOpen());
  if (absl::Status s = store_.AppendInline(batch, tensor, part, offset, bytes); !s.ok()) {
    return Reject(s);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// PublicationSession: a thin handle over State.

PublicationSession::PublicationSession(uint64_t version, std::shared_ptr<State> state)
    : version_(version), state_(std::move(state)) {}

PublicationSession::~PublicationSession() {
  state_->Stop(absl::CancelledError(
                   absl::StrCat("publication ", version_, " was cancelled (closed before commit)")),
               PublicationStatus::kAborted);
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

absl::Status PublicationSession::DeclareExpected(std::vector<std::string> names) {
  return state_->DeclareExpected(std::move(names));
}

absl::StatusOr<PublicationReport> PublicationSession::Commit() { return state_->Commit(); }

void PublicationSession::Abort(absl::Status why) {
  state_->Stop(std::move(why), PublicationStatus::kAborted);
}
void PublicationSession::Fail(absl::Status why) {
  state_->Stop(std::move(why), PublicationStatus::kFailed);
}

}  // namespace wpub::engine
