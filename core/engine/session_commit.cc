// Commit: inputs checked, buckets planned, the transfer (retried for dirty receivers), the point
// of no return. Every exit ends the publication through End or Reject (session.cc).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/log_context.h"
#include "core/common/status.h"
#include "core/engine/engine_impl.h"
#include "core/transport/planner.h"

namespace wpub::engine {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ABORTED naming every failed receiver, or OK when none failed.
absl::Status FailureFromOutcomes(const std::vector<transport::ReceiverOutcome>& outcomes) {
  std::vector<std::string> why;
  for (const transport::ReceiverOutcome& o : outcomes) {
    if (o.failure != transport::ReceiverFailure::kNone) why.push_back(o.error);
  }
  if (why.empty()) return absl::OkStatus();
  return absl::AbortedError(absl::StrJoin(why, "; "));
}

// FAILED_PRECONDITION when fewer than `min_receivers` receivers take part in `version`
// (`receivers`: their names; `when`: where they were counted), OK otherwise.
absl::Status CheckMinReceivers(uint64_t version, size_t min_receivers,
                               const std::vector<std::string>& receivers, absl::string_view when) {
  if (receivers.size() >= min_receivers) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "publication ", version, " needs at least ", min_receivers, " receivers, ", receivers.size(),
      " ", when,
      receivers.empty() ? std::string() : absl::StrCat(" (", absl::StrJoin(receivers, ", "), ")")));
}

}  // namespace

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
  WPUB_ASSIGN_OR_RETURN(plan.buckets,
                        transport::PlanBuckets(plan.outputs, *unit_sizes, bucket_bytes_));
  WPUB_RETURN_IF_ERROR(
      transport::CheckLayout(plan.buckets, plan.outputs, *unit_sizes, bucket_bytes_));
  return plan;
}

absl::Status PublicationSession::State::Transfer(const ExecutionPlan& plan,
                                                 const transport::PublicationManifest& manifest,
                                                 bool* bad_input) {
  transport::Transport* transport = &engine_->transports();
  const LogField phase("phase", "transfer");
  WPUB_RETURN_IF_ERROR(lifecycle_.BeginTransfer());
  bytes_out_ = 0;
  buckets_out_ = 0;
  auto t0 = Clock::now();
  absl::StatusOr<std::vector<std::string>> participants = transport->Begin(manifest);
  if (!participants.ok()) return participants.status();
  phases_.transfer += Since(t0);
  WPUB_RETURN_IF_ERROR(lifecycle_.abort_request());
  // Counted again where the participants are fixed: a receiver may leave between Commit's
  // first count and here (a group member waits for the leader's go in between).
  WPUB_RETURN_IF_ERROR(CheckMinReceivers(header_.version, engine_->options().min_receivers,
                                         *participants, "took part when its transfer began"));

  // The one road of a bucket: backend -> emit -> the transport group -> each transport.
  ExecutionHooks hooks;
  hooks.syncs = &syncs_;
  hooks.emit = [&](std::shared_ptr<const transport::Bucket> bucket) {
    const auto t = Clock::now();
    bytes_out_ += bucket->manifest.nbytes;
    ++buckets_out_;
    const uint32_t index = bucket->manifest.index;
    const uint64_t nbytes = bucket->manifest.nbytes;
    absl::Status s = transport->Send(std::move(bucket));
    phases_.transfer += Since(t);
    LogBucket(index, nbytes, plan.buckets.size(), s);
    return s;
  };
  hooks.cancelled = [&] {
    if (!lifecycle_.abort_request().ok()) return true;
    return !FailureFromOutcomes(transport->Outcomes()).ok();
  };
  absl::StatusOr<ExecutionResult> executed = engine_->backend().Execute(plan, hooks);
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
  absl::Status acked = transport->WaitAcknowledged(absl::Now() + engine_->options().ack_deadline);
  phases_.transfer += Since(t0);
  return acked;
}

void PublicationSession::State::LogBucket(uint32_t index, uint64_t nbytes, size_t total,
                                          const absl::Status& sent) {
  const LogField field("bucket", std::to_string(index));
  if (!sent.ok()) {
    spdlog::debug("v{} bucket {}/{} not sent ({})", version(), index + 1, total,
                  absl::StatusCodeToString(sent.code()));
    return;
  }
  spdlog::debug("v{} bucket {}/{} sent: {} bytes", version(), index + 1, total, nbytes);
  const absl::Time now = absl::Now();
  if (now - opened_at_ < kProgressEvery || now - last_progress_ < kProgressEvery) return;
  last_progress_ = now;
  spdlog::info("v{} in progress: {} of {} buckets sent ({:.1f} MB), {:.1f} s since open", version(),
               buckets_out_.load(), total, static_cast<double>(bytes_out_.load()) / 1e6,
               absl::ToDoubleSeconds(now - opened_at_));
}

absl::Status PublicationSession::State::TransferWithRetries(
    const ExecutionPlan& plan, transport::PublicationManifest& manifest, bool* bad_input) {
  transport::Transport& transport = engine_->transports();
  for (;;) {
    ++attempts_;
    manifest.attempt = static_cast<uint32_t>(attempts_);
    absl::Status sent = Transfer(plan, manifest, bad_input);
    if (sent.ok() || *bad_input) return sent;
    // A group version is not retried: the leader aborts it on every member at once.
    if (vote() != nullptr) return sent;
    std::vector<std::string> dirty;
    for (const transport::ReceiverOutcome& o : transport.Outcomes()) {
      if (o.dirty) dirty.push_back(o.name);
    }
    if (!lifecycle_.abort_request().ok() || dirty.empty() ||
        attempts_ >= engine_->options().max_attempts) {
      return sent;
    }
    // Ends this attempt on every transport (the next Begin re-forms what failed).
    transport.Abort(absl::StrCat("attempt ", attempts_, " failed (", sent.message(),
                                 "); retrying for the dirty receivers ",
                                 absl::StrJoin(dirty, ", ")));
    retry_errors_.push_back(std::string(sent.message()));
  }
}

absl::Status PublicationSession::State::CheckInputs() const {
  if (num_tensors_.load() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("publication ", header_.version, " is empty (no tensors)"));
  }
  WPUB_RETURN_IF_ERROR(store_.CheckComplete());
  // A quantizing recipe whose plans quantize nothing (names the policy did not recognize).
  return policy::CheckQuantizesAnything(policy_->settings(), plans_);
}

transport::PublicationManifest PublicationSession::State::MakeManifest(
    const ExecutionPlan& plan) const {
  transport::PublicationManifest manifest;
  manifest.version = header_.version;
  manifest.model_id = header_.model_id;
  manifest.recipe = recipe_.canonical;
  if (header_.group.has_value()) {
    manifest.group = header_.group->group;
    manifest.group_members = header_.group->members;
    manifest.group_member = header_.group->member;
    manifest.engine_lifecycle = header_.group->member == 0;
  }
  for (const transport::BucketLayout& b : plan.buckets) {
    manifest.buckets.push_back(transport::MakeBucketManifest(b, plan.outputs));
  }
  return manifest;
}

absl::StatusOr<PublicationReport> PublicationSession::State::Commit() {
  WPUB_RETURN_IF_ERROR(lifecycle_.BeginCommit());
  const auto t_commit = Clock::now();
  phases_.policy = policy_seconds_in_ingest_;
  phases_.ingest =
      std::chrono::duration<double>(t_commit - t_open_).count() - policy_seconds_in_ingest_;
  if (absl::Status s = CheckInputs(); !s.ok()) return Reject(s);
  if (absl::Status s = lifecycle_.Stage(); !s.ok()) return End(PublicationStatus::kAborted, s);

  // Policy/planning.
  auto t0 = Clock::now();
  std::vector<uint32_t> units;
  absl::StatusOr<ExecutionPlan> plan = BuildPlan(&units);
  if (!plan.ok()) return Reject(plan.status());
  transport::PublicationManifest manifest = MakeManifest(*plan);
  num_buckets_ = static_cast<uint32_t>(manifest.buckets.size());
  phases_.policy += Since(t0);

  transport::TransportGroup& transport = engine_->transports();
  {  // Before any byte moves; Transfer counts again where the participants are fixed.
    std::vector<std::string> connected;
    for (const transport::ReceiverInfo& r : transport.Receivers()) connected.push_back(r.name);
    const absl::Status enough = CheckMinReceivers(header_.version, engine_->options().min_receivers,
                                                  connected, "connected");
    if (!enough.ok()) return End(PublicationStatus::kAborted, enough);
  }
  const std::shared_ptr<GroupVote> group_vote = vote();
  // A group version: what every member publishes is checked before any byte moves, and the
  // leader says when this member may transfer.
  if (group_vote != nullptr) {
    t0 = Clock::now();
    StagedParts parts;
    parts.tensors.reserve(store_.tensors().size());
    for (const InputTensor& t : store_.tensors()) parts.tensors.push_back(t.desc.name);
    parts.expected = std::move(expected_);
    parts.bytes_in = bytes_in_.load();
    parts.bytes_out = manifest.total_bytes();
    parts.buckets = num_buckets_;
    parts.engines = transport.HasReceiversApplyingOnReceipt();
    absl::Status go = group_vote->Stage(parts);
    phases_.group += Since(t0);
    if (!go.ok()) {
      if (absl::IsInvalidArgument(go)) return Reject(go);
      return End(PublicationStatus::kAborted, go);
    }
  }
  bool bad_input = false;
  if (absl::Status sent = TransferWithRetries(*plan, manifest, &bad_input); !sent.ok()) {
    if (bad_input) return Reject(sent);
    return End(PublicationStatus::kAborted, sent);
  }
  if (group_vote != nullptr) {
    t0 = Clock::now();
    PreparedParts parts;
    // A receiver is its name and its process's instance: two processes that share a name (one
    // subscribed to each member) are two receivers, and the leader's check refuses them.
    for (const transport::ReceiverOutcome& o : transport.Outcomes()) {
      parts.receivers.push_back(
          o.instance.empty() ? o.name : absl::StrCat(o.name, " (instance ", o.instance, ")"));
    }
    parts.bytes_out = bytes_out_;
    parts.phases = phases_;
    // From the vote on, the leader's decision alone ends this publication (a cancellation is
    // refused): a member that voted prepared never aborts on its own.
    if (absl::Status s = lifecycle_.Prepare(); !s.ok()) return End(PublicationStatus::kAborted, s);
    absl::Status decided = group_vote->Prepare(parts);
    phases_.group += Since(t0);
    if (!decided.ok()) return End(PublicationStatus::kAborted, decided);
  }

  t0 = Clock::now();
  const absl::Status committed = lifecycle_.PassPointOfNoReturn([&] {
    // The group decided: every receiver still there is told, none can refuse.
    if (group_vote != nullptr) return transport.CommitDecided();
    absl::Status s = transport.Commit();
    if (s.ok()) return s;
    // A receiver failed after its last acknowledgement (e.g. it left): name it.
    const absl::Status why = FailureFromOutcomes(transport.Outcomes());
    return why.ok() ? s : why;
  });
  if (!committed.ok()) return End(PublicationStatus::kAborted, committed);
  phases_.commit = Since(t0);
  return End(PublicationStatus::kCommitted, absl::OkStatus());
}

}  // namespace wpub::engine
