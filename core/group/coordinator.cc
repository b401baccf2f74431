#include "core/group/coordinator.h"

#include <random>
#include <string>
#include <utility>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"

namespace wpub::group {

struct Coordinator::Metrics {
  prometheus::Family<prometheus::Counter>* rounds = nullptr;
  prometheus::Gauge* members = nullptr;
  prometheus::Histogram* coordination = nullptr;
  prometheus::Family<prometheus::Gauge>* member_seconds = nullptr;
  prometheus::Family<prometheus::Gauge>* member_bytes = nullptr;
};

namespace {

uint64_t BootId() {
  std::random_device rd;
  uint32_t id = 0;
  while (id == 0) id = rd();
  return id;
}

}  // namespace

Coordinator::Coordinator(CoordinatorOptions options, prometheus::Registry* registry)
    : options_(options),
      decisions_(options_.decisions != nullptr ? options_.decisions
                                               : std::make_shared<DecisionLog>()),
      boot_(BootId()) {
  if (registry == nullptr) return;
  metrics_ = std::make_unique<Metrics>();
  metrics_->rounds = &prometheus::BuildCounter()
                          .Name("wpub_group_rounds_total")
                          .Help("Group versions this daemon led, by outcome (committed, aborted).")
                          .Register(*registry);
  metrics_->members = &prometheus::BuildGauge()
                           .Name("wpub_group_members")
                           .Help("Members of the last group version this daemon led.")
                           .Register(*registry)
                           .Add({});
  metrics_->coordination =
      &prometheus::BuildHistogram()
           .Name("wpub_group_coordination_seconds")
           .Help("The leader's bookkeeping per group version (parts and receiver checks).")
           .Register(*registry)
           .Add({}, prometheus::Histogram::BucketBoundaries{1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1});
  metrics_->member_seconds =
      &prometheus::BuildGauge()
           .Name("wpub_group_member_seconds")
           .Help(
               "Per member of the last group version this daemon led: its phases (ingest .. "
               "transfer, as the member measured them) and 'total' (join to prepared, on the "
               "leader's clock).")
           .Register(*registry);
  metrics_->member_bytes = &prometheus::BuildGauge()
                                .Name("wpub_group_member_bytes")
                                .Help("Bucket bytes of each member of the last group version.")
                                .Register(*registry);
}

Coordinator::~Coordinator() = default;

absl::StatusOr<std::shared_ptr<Round>> Coordinator::Join(const MemberHello& hello,
                                                         absl::Duration timeout) {
  const engine::GroupMembership& gm = hello.membership;
  if (absl::Status s = engine::ValidateGroupMembership(gm); !s.ok()) return s;
  if (hello.version == 0 || hello.version > options_.max_version) {
    return absl::InvalidArgumentError(absl::StrCat(
        "member ", gm.member, " (", gm.publisher, ") joins group '", gm.group, "' with version ",
        hello.version, ": versions are 1 to ", options_.max_version));
  }
  // The leader's timeouts are the leader's: its own header's, else its --group_timeout.
  if (gm.member != 0 || timeout <= absl::ZeroDuration()) timeout = options_.default_timeout;
  const auto same = [&](const std::shared_ptr<Round>& r) {
    return r->group() == gm.group && r->members() == gm.members && r->version() == hello.version;
  };
  // Rounds to abort once the lock is released (their callbacks run), each with its reason.
  std::vector<std::pair<std::shared_ptr<Round>, absl::Status>> aborted;
  std::shared_ptr<Round> round;
  {
    std::lock_guard lock(mu_);
    std::erase_if(pending_, [](const std::shared_ptr<Round>& r) { return r->decided(); });
    const bool led = active_ != nullptr && !active_->decided();
    if (gm.member == 0) {
      if (led && same(active_)) {
        round = active_;
      } else {
        if (led) {
          // The leader's own version wins: the stale round cannot complete.
          aborted.emplace_back(active_, absl::AbortedError(absl::StrCat(
                                            "the leader opened group '", gm.group, "' version ",
                                            hello.version, " while version ", active_->version(),
                                            " of group '", active_->group(), "' waited for it")));
        }
        // The members that joined before the leader wait in a pending round of its version;
        // every other pending round is for a version the leader does not publish.
        for (const std::shared_ptr<Round>& r : pending_) {
          if (round == nullptr && same(r)) {
            round = r;
          } else {
            aborted.emplace_back(
                r, absl::AbortedError(absl::StrCat("the leader opened group '", gm.group,
                                                   "' version ", hello.version, ", not group '",
                                                   r->group(), "' version ", r->version())));
          }
        }
        pending_.clear();
        if (round == nullptr) round = NewRound(gm, hello.version, timeout);
        active_ = round;
      }
    } else if (led) {
      if (!same(active_)) {
        // Refused without disturbing the round: a member that is really missing makes the
        // round time out, a Join for another group or version changes nothing.
        return absl::FailedPreconditionError(absl::StrCat(
            "member ", gm.member, " (", gm.publisher, ") joins group '", gm.group, "' version ",
            hello.version, " with ", gm.members, " members, but the leader publishes group '",
            active_->group(), "' version ", active_->version(), " with ", active_->members(),
            " members"));
      }
      round = active_;
    } else {
      for (const std::shared_ptr<Round>& r : pending_) {
        if (same(r)) round = r;
      }
      if (round == nullptr) {
        if (pending_.size() >= kMaxPendingRounds) {
          return absl::ResourceExhaustedError(
              absl::StrCat("member ", gm.member, " (", gm.publisher, ") joins group '", gm.group,
                           "' version ", hello.version, " before its leader, and ", pending_.size(),
                           " other versions already wait for theirs"));
        }
        round = NewRound(gm, hello.version, timeout);
        pending_.push_back(round);
      }
    }
  }
  for (const auto& [r, why] : aborted) {
    r->Abort(why);
    Observe(r);
  }
  WPUB_RETURN_IF_ERROR(round->Join(hello));
  return round;
}

std::shared_ptr<Round> Coordinator::NewRound(const engine::GroupMembership& gm, uint64_t version,
                                             absl::Duration timeout) {
  const uint64_t id = boot_ << 32 | ++next_round_;
  return std::make_shared<Round>(
      gm.group, gm.members, version, timeout, kMaxRoundNameBytes, id,
      [log = decisions_](const RoundDecision& d) { return log->Record(d); });
}

RoundOutcome Coordinator::OutcomeOf(const std::string& group, uint64_t version,
                                    uint64_t round) const {
  using State = RoundOutcome::State;
  const auto recorded = [&]() -> std::optional<RoundOutcome> {
    std::optional<RoundDecision> d = decisions_->Find(round);
    if (!d.has_value() || d->group != group || d->version != version) return std::nullopt;
    if (d->commit) return RoundOutcome{State::kCommitted, absl::OkStatus()};
    return RoundOutcome{
        State::kAborted,
        absl::Status(d->code == absl::StatusCode::kOk ? absl::StatusCode::kAborted : d->code,
                     d->reason)};
  };
  if (std::optional<RoundOutcome> o = recorded()) return *o;
  {
    std::lock_guard lock(mu_);
    std::vector<std::shared_ptr<Round>> open = pending_;
    if (active_ != nullptr) open.push_back(active_);
    for (const std::shared_ptr<Round>& r : open) {
      if (r->id() != round || r->group() != group || r->version() != version) continue;
      if (!r->decided()) return RoundOutcome{State::kUndecided, absl::OkStatus()};
    }
  }
  // Decided since the first look.
  if (std::optional<RoundOutcome> o = recorded()) return *o;
  const std::string what =
      absl::StrCat("group '", group, "' version ", version, " (round ", round, ")");
  if (round >> 32 == boot_ || decisions_->durable()) {
    return RoundOutcome{
        State::kAborted,
        absl::AbortedError(
            absl::StrCat("the leader has no record of ", what,
                         ": it never committed it (a commit is recorded before it is announced)"))};
  }
  return RoundOutcome{
      State::kUnknown,
      absl::UnavailableError(absl::StrCat(
          "the leader has no record of ", what,
          ": it restarted and keeps no decision log (--group_decision_log), so it cannot say"))};
}

std::optional<engine::GroupSummary> Coordinator::LastRound() const {
  std::lock_guard lock(mu_);
  if (active_ == nullptr) return std::nullopt;
  engine::GroupSummary s = active_->Summary();
  s.member = 0;
  return s;
}

void Coordinator::Observe(const std::shared_ptr<Round>& round) {
  if (round == nullptr || !round->decided()) return;
  {
    std::lock_guard lock(mu_);
    if (observed_ == round) return;
    observed_ = round;
  }
  if (metrics_ == nullptr) return;
  const engine::GroupSummary s = round->Summary();
  metrics_->rounds->Add({{"outcome", s.outcome}}).Increment();
  metrics_->members->Set(s.members);
  metrics_->coordination->Observe(s.coordination_seconds);
  for (const engine::GroupMemberSummary& m : s.members_detail) {
    const std::string member = std::to_string(m.member);
    for (const char* phase : engine::kPhaseNames) {
      metrics_->member_seconds->Add({{"member", member}, {"phase", phase}})
          .Set(engine::PhaseValue(m.phases, phase));
    }
    metrics_->member_seconds->Add({{"member", member}, {"phase", "total"}}).Set(m.seconds);
    metrics_->member_bytes->Add({{"member", member}}).Set(static_cast<double>(m.bytes_out));
  }
}

namespace {

// Member 0's vote: the leader's own publication in its round.
class LocalVote : public engine::GroupVote {
 public:
  LocalVote(Coordinator* coordinator, std::shared_ptr<Round> round, std::string leader)
      : coordinator_(coordinator), round_(std::move(round)), leader_(std::move(leader)) {}
  ~LocalVote() override {
    Fail(absl::AbortedError("the leader's publication ended"));
    coordinator_->Observe(round_);
  }

  absl::Status Stage(const engine::StagedParts& parts) override {
    round_->Stage(0, parts);
    return round_->AwaitTransfer(0);
  }
  absl::Status Prepare(const engine::PreparedParts& parts) override {
    round_->Prepared(0, parts);
    absl::Status s = round_->AwaitDecision(0);
    coordinator_->Observe(round_);
    return s;
  }
  void Fail(const absl::Status& why) override {
    if (!round_->decided()) round_->Fail(0, why);
  }
  bool others_may_have_sent() const override { return round_->others_may_have_sent(0); }
  engine::GroupSummary Summary() const override {
    engine::GroupSummary s = round_->Summary();
    s.member = 0;
    s.leader = leader_;
    return s;
  }

 private:
  Coordinator* const coordinator_;
  const std::shared_ptr<Round> round_;
  const std::string leader_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<engine::GroupVote>> Coordinator::JoinLocal(
    const engine::PublicationHeader& header, std::function<void(absl::Status)> on_abort) {
  if (!header.group.has_value() || header.group->member != 0) {
    return absl::InternalError("JoinLocal is for the leader's own publication (member 0)");
  }
  MemberHello hello;
  hello.membership = *header.group;
  hello.version = header.version;
  hello.recipe = header.recipe;
  absl::StatusOr<std::shared_ptr<Round>> round = Join(hello, header.group->timeout);
  if (!round.ok()) return round.status();
  // Another member's failure stops the leader's own publication wherever it is.
  if (on_abort) (*round)->OnAbort(std::move(on_abort));
  return std::unique_ptr<engine::GroupVote>(
      new LocalVote(this, *std::move(round), header.group->publisher));
}

}  // namespace wpub::group
