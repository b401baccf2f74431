#include "core/group/round.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wpub::group {
namespace {

// At most this many names in one error message.
constexpr size_t kNamesInError = 8;

std::string SomeNames(const std::vector<std::string>& names) {
  std::vector<std::string> shown(names.begin(),
                                 names.begin() + std::min(names.size(), kNamesInError));
  std::string s = absl::StrJoin(shown, ", ");
  if (names.size() > shown.size()) absl::StrAppend(&s, ", ... (", names.size(), " in all)");
  return s;
}

const char* StageName(int stage) {
  static constexpr const char* kNames[] = {"waiting",      "joined",   "staged",
                                           "transferring", "prepared", "failed"};
  return kNames[stage];
}

}  // namespace

Round::Round(std::string group, uint32_t members, uint64_t version, absl::Duration timeout,
             size_t max_name_bytes, uint64_t id, DecisionRecorder record)
    : group_(std::move(group)),
      members_(members),
      version_(version),
      // Bounded: a deadline is the last progress plus the timeout (no overflow, and
      // ExpireIfStalled keeps InfiniteDuration for "decided").
      timeout_(std::min(timeout, absl::Hours(24 * 365))),
      max_name_bytes_(max_name_bytes),
      id_(id),
      record_(std::move(record)),
      m_(members),
      granted_(members, false),
      last_progress_(Clock::now()) {}

std::string Round::Name(uint32_t member) const {
  const std::string& p = m_[member].publisher;
  return p.empty() ? absl::StrCat("member ", member)
                   : absl::StrCat("member ", member, " (", p, ")");
}

void Round::Progress() {
  last_progress_ = Clock::now();
  cv_.notify_all();
}

absl::Status Round::Join(const MemberHello& hello) {
  const engine::GroupMembership& gm = hello.membership;
  std::lock_guard lock(mu_);
  if (decided_) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", group_, "' version ", version_, " was already ",
                     abort_.ok() ? "committed" : absl::StrCat("aborted: ", abort_.message())));
  }
  if (gm.group != group_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "member ", gm.member, " joins group '", gm.group, "', the leader's is '", group_, "'"));
  }
  if (gm.members != members_) {
    return absl::FailedPreconditionError(
        absl::StrCat("member ", gm.member, " says group '", group_, "' has ", gm.members,
                     " members, the leader's round has ", members_));
  }
  if (hello.version != version_) {
    return absl::FailedPreconditionError(
        absl::StrCat("member ", gm.member, " (", gm.publisher, ") joins version ", hello.version,
                     ", but group '", group_, "' publishes version ", version_));
  }
  if (gm.member >= members_) {
    return absl::InvalidArgumentError(
        absl::StrCat("member ", gm.member, " is not below ", members_));
  }
  Member& m = m_[gm.member];
  if (m.stage != MemberStage::kWaiting) {
    return absl::AlreadyExistsError(absl::StrCat("member ", gm.member, " of group '", group_,
                                                 "' version ", version_, " has joined already (as ",
                                                 m.publisher, ")"));
  }
  for (uint32_t i = 0; i < members_; ++i) {
    if (m_[i].stage != MemberStage::kWaiting && !m_[i].recipe.empty() &&
        m_[i].recipe != hello.recipe) {
      return absl::FailedPreconditionError(
          absl::StrCat("member ", gm.member, " publishes recipe '", hello.recipe, "', ", Name(i),
                       " '", m_[i].recipe, "': a group version has one recipe"));
    }
  }
  m.stage = MemberStage::kJoined;
  m.publisher = gm.publisher;
  m.recipe = hello.recipe;
  m.joined_at = Clock::now();
  Progress();
  return absl::OkStatus();
}

absl::Status Round::ReserveNameBytes(uint32_t member, size_t bytes) {
  std::unique_lock lock(mu_);
  if (member >= members_) return absl::InvalidArgumentError("no such member");
  if (bytes > max_name_bytes_ || name_bytes_ > max_name_bytes_ - bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the tensor names of group '", group_, "' version ", version_, " exceed ",
                     max_name_bytes_, " bytes in all (", Name(member), " sent more)"));
  }
  name_bytes_ += bytes;
  m_[member].reserved_name_bytes += bytes;
  return absl::OkStatus();
}

void Round::Stage(uint32_t member, engine::StagedParts parts) {
  std::unique_lock lock(mu_);
  if (decided_ || member >= members_ || m_[member].stage != MemberStage::kJoined) return;
  // What was not reserved while it arrived (the leader's own parts) counts now.
  size_t bytes = 0;
  for (const std::string& n : parts.tensors) bytes += n.size();
  for (const std::string& n : parts.expected) bytes += n.size();
  const size_t more =
      bytes > m_[member].reserved_name_bytes ? bytes - m_[member].reserved_name_bytes : 0;
  if (more > max_name_bytes_ || name_bytes_ > max_name_bytes_ - more) {
    AbortLocked(absl::ResourceExhaustedError(absl::StrCat(
                    "the tensor names of group '", group_, "' version ", version_, " exceed ",
                    max_name_bytes_, " bytes in all (", Name(member), "'s parts)")),
                static_cast<int32_t>(member));
    Unlock(lock);
    return;
  }
  name_bytes_ += more;
  m_[member].tensor_count = parts.tensors.size();
  m_[member].parts = std::move(parts);
  m_[member].stage = MemberStage::kStaged;
  ++staged_;
  Progress();
  if (staged_ == members_) CheckParts();
  Unlock(lock);
}

void Round::ReleaseNamesLocked() {
  for (Member& m : m_) {
    std::vector<std::string>().swap(m.parts.tensors);
    std::vector<std::string>().swap(m.parts.expected);
    m.reserved_name_bytes = 0;
  }
  name_bytes_ = 0;
}

void Round::CheckParts() {
  const auto t0 = Clock::now();
  // Who publishes what: every name once.
  std::map<std::string_view, uint32_t> owner;
  for (uint32_t i = 0; i < members_; ++i) {
    for (const std::string& name : m_[i].parts.tensors) {
      auto [it, inserted] = owner.emplace(name, i);
      if (!inserted) {
        AbortLocked(absl::InvalidArgumentError(absl::StrCat(
                        "tensor ", name, " is published by two members of group '", group_,
                        "' version ", version_, ": ", Name(it->second), " and ", Name(i))),
                    static_cast<int32_t>(i));
        return;
      }
    }
  }
  // The declared manifest (member 0's): every name published, nothing else.
  const std::vector<std::string>& expected = m_[0].parts.expected;
  if (!expected.empty()) {
    std::set<std::string_view> declared(expected.begin(), expected.end());
    std::vector<std::string> missing;
    for (std::string_view name : declared) {
      if (owner.count(name) == 0) missing.emplace_back(name.data(), name.size());
    }
    if (!missing.empty()) {
      AbortLocked(absl::InvalidArgumentError(
                      absl::StrCat("group '", group_, "' version ", version_, ": ", missing.size(),
                                   " tensors of the declared manifest are published by no member: ",
                                   SomeNames(missing))),
                  -1);
      return;
    }
    for (const auto& entry : owner) {
      if (declared.count(entry.first) == 0) {
        const uint32_t who = entry.second;
        AbortLocked(
            absl::InvalidArgumentError(absl::StrCat(
                "tensor ", std::string(entry.first), " published by ", Name(who),
                " is not in the declared manifest of group '", group_, "' version ", version_)),
            static_cast<int32_t>(who));
        return;
      }
    }
  }
  // The leader makes the engines' lifecycle calls: it must send to them too.
  if (Sequential() && !m_[0].parts.engines) {
    for (uint32_t i = 1; i < members_; ++i) {
      if (!m_[i].parts.engines) continue;
      AbortLocked(
          absl::FailedPreconditionError(absl::StrCat(
              Name(i), " of group '", group_, "' sends to NCCL engines but the leader (", Name(0),
              ") has none: the leader makes the engines' lifecycle calls, so it "
              "must be connected to the same engines")),
          static_cast<int32_t>(i));
      return;
    }
  }
  parts_checked_ = true;
  ReleaseNamesLocked();  // checked: nothing needs the names again
  coordination_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  GrantTurns();
}

bool Round::Sequential() const {
  for (const Member& m : m_) {
    if (m.parts.engines) return true;
  }
  return false;
}

void Round::GrantTurns() {
  if (!parts_checked_ || decided_) return;
  const bool sequential = Sequential();
  for (uint32_t i = 0; i < members_; ++i) {
    if (granted_[i]) continue;
    if (sequential) {
      bool before_done = true;
      for (uint32_t j = 0; j < i; ++j) before_done &= m_[j].stage == MemberStage::kPrepared;
      if (!before_done) break;
    }
    granted_[i] = true;
    if (m_[i].stage == MemberStage::kStaged) m_[i].stage = MemberStage::kTransferring;
  }
  Progress();
}

void Round::Prepared(uint32_t member, engine::PreparedParts parts) {
  std::unique_lock lock(mu_);
  if (decided_ || member >= members_ || !granted_[member] ||
      m_[member].stage != MemberStage::kTransferring) {
    return;
  }
  Member& m = m_[member];
  m.prepared = std::move(parts);
  m.stage = MemberStage::kPrepared;
  m.seconds = std::chrono::duration<double>(Clock::now() - m.joined_at).count();
  ++prepared_;
  slowest_member_ = static_cast<int32_t>(member);
  Progress();
  if (prepared_ == members_) {
    Decide();
  } else {
    GrantTurns();
  }
  Unlock(lock);
}

void Round::Decide() {
  const auto t0 = Clock::now();
  // Committed means held: every receiver must hold every member's buckets, so every member's
  // publication must have had the same receivers.
  std::set<std::string> all;
  for (const Member& m : m_) all.insert(m.prepared.receivers.begin(), m.prepared.receivers.end());
  for (uint32_t i = 0; i < members_; ++i) {
    std::set<std::string> mine(m_[i].prepared.receivers.begin(), m_[i].prepared.receivers.end());
    std::vector<std::string> absent;
    for (const std::string& r : all) {
      if (mine.count(r) == 0) absent.push_back(r);
    }
    if (!absent.empty()) {
      AbortLocked(absl::AbortedError(absl::StrCat(
                      "group '", group_, "' version ", version_, ": receivers ", SomeNames(absent),
                      " took part in other members' publications but not in ", Name(i),
                      "'s (every receiver must subscribe to every member)")),
                  static_cast<int32_t>(i));
      return;
    }
  }
  // Recorded before anyone hears it: a leader that has no record never announced a commit.
  if (record_) {
    RoundDecision d{group_, version_, id_, /*commit=*/true, absl::StatusCode::kOk, ""};
    if (absl::Status s = record_(d); !s.ok()) {
      AbortLocked(absl::AbortedError(absl::StrCat("group '", group_, "' version ", version_,
                                                  ": the leader could not record its decision to "
                                                  "commit (",
                                                  s.message(), ")")),
                  -1);
      return;
    }
  }
  decided_ = true;
  coordination_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  Progress();
}

void Round::Fail(uint32_t member, const absl::Status& why) {
  std::unique_lock lock(mu_);
  if (member >= members_) return;
  // A prepared vote binds: the member learns the decision, it cannot take its vote back.
  if (m_[member].stage == MemberStage::kPrepared) return;
  if (!decided_) {
    m_[member].error = std::string(why.message());
    m_[member].stage = MemberStage::kFailed;
  }
  // The member's own status code: bad input stays INVALID_ARGUMENT on every member.
  const absl::StatusCode code =
      why.code() == absl::StatusCode::kInvalidArgument ? why.code() : absl::StatusCode::kAborted;
  AbortLocked(absl::Status(code, absl::StrCat(Name(member), " of group '", group_, "' version ",
                                              version_, " failed: ", why.message())),
              static_cast<int32_t>(member));
  Unlock(lock);
}

void Round::Abort(const absl::Status& why) {
  std::unique_lock lock(mu_);
  AbortLocked(why, -1);
  Unlock(lock);
}

void Round::OnAbort(std::function<void(absl::Status)> fn) {
  // The decision, heard only when it is an abort (member 0 is every round's).
  OnDecision(0, [fn = std::move(fn)](absl::Status decision) {
    if (!decision.ok()) fn(std::move(decision));
  });
}

void Round::OnTransfer(uint32_t member, std::function<void(absl::Status)> fn) {
  std::unique_lock lock(mu_);
  watches_.push_back(Watch{member, /*decision=*/false, std::move(fn)});
  Unlock(lock);
}

void Round::OnDecision(uint32_t member, std::function<void(absl::Status)> fn) {
  std::unique_lock lock(mu_);
  watches_.push_back(Watch{member, /*decision=*/true, std::move(fn)});
  Unlock(lock);
}

absl::Duration Round::ExpireIfStalled() {
  std::unique_lock lock(mu_);
  if (!decided_) ExpireLocked(/*decision=*/parts_checked_);
  if (decided_) {
    Unlock(lock);
    return absl::InfiniteDuration();
  }
  const absl::Duration left =
      absl::FromChrono(last_progress_ + absl::ToChronoNanoseconds(timeout_) - Clock::now());
  return std::max(left, absl::ZeroDuration());
}

bool Round::ExpireLocked(bool decision) {
  if (Clock::now() < last_progress_ + absl::ToChronoNanoseconds(timeout_)) return false;
  const MemberStage want = decision ? MemberStage::kPrepared : MemberStage::kStaged;
  AbortLocked(absl::DeadlineExceededError(absl::StrCat(
                  "group '", group_, "' version ", version_, ": no progress for ",
                  absl::FormatDuration(timeout_), " waiting for ", MembersBelow(want))),
              -1);
  return true;
}

void Round::Unlock(std::unique_lock<std::mutex>& lock) {
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> ready;
  std::erase_if(watches_, [&](Watch& w) {
    if (decided_) {
      ready.emplace_back(std::move(w.fn), abort_);
    } else if (w.member >= members_) {
      ready.emplace_back(std::move(w.fn), absl::InvalidArgumentError("no such member"));
    } else if (!w.decision && granted_[w.member]) {
      ready.emplace_back(std::move(w.fn), absl::OkStatus());
    } else {
      return false;
    }
    return true;
  });
  lock.unlock();
  for (auto& [fn, status] : ready) fn(status);
}

void Round::AbortLocked(const absl::Status& why, int32_t failed_member) {
  if (decided_) return;
  ReleaseNamesLocked();  // kept by the last round's summary for as long as it is the last
  decided_ = true;
  abort_ = why.ok() ? absl::AbortedError("aborted") : why;
  failed_member_ = failed_member;
  // An abort need not be on disk before it is announced (a leader without a record of a round
  // answers aborted), but an answer naming the reason is better than a presumed one.
  if (record_) {
    record_(RoundDecision{group_, version_, id_, /*commit=*/false, abort_.code(),
                          std::string(abort_.message())})
        .IgnoreError();
  }
  Progress();
}

std::string Round::MembersBelow(MemberStage stage) const {
  std::vector<std::string> names;
  for (uint32_t i = 0; i < members_; ++i) {
    if (m_[i].stage < stage) {
      names.push_back(absl::StrCat(Name(i), " ", StageName(static_cast<int>(m_[i].stage))));
    }
  }
  return absl::StrJoin(names, ", ");
}

absl::Status Round::Await(uint32_t member, bool decision) {
  std::unique_lock lock(mu_);
  if (member >= members_) return absl::InvalidArgumentError("no such member");
  const auto timeout = absl::ToChronoNanoseconds(timeout_);
  for (;;) {
    if (decided_) return abort_;
    if (!decision && granted_[member]) return absl::OkStatus();
    if (ExpireLocked(decision)) {
      const absl::Status why = abort_;
      Unlock(lock);
      return why;
    }
    cv_.wait_until(lock, last_progress_ + timeout);
  }
}

absl::Status Round::AwaitTransfer(uint32_t member) { return Await(member, false); }
absl::Status Round::AwaitDecision(uint32_t member) { return Await(member, true); }

bool Round::others_may_have_sent(uint32_t member) const {
  std::lock_guard lock(mu_);
  for (uint32_t i = 0; i < members_; ++i) {
    if (i != member && granted_[i] && m_[i].parts.engines) return true;
  }
  return false;
}

bool Round::joined(uint32_t member) const {
  std::lock_guard lock(mu_);
  return member < members_ && m_[member].stage != MemberStage::kWaiting;
}

bool Round::prepared(uint32_t member) const {
  std::lock_guard lock(mu_);
  return member < members_ && m_[member].stage == MemberStage::kPrepared;
}

bool Round::decided() const {
  std::lock_guard lock(mu_);
  return decided_;
}

absl::Status Round::abort_status() const {
  std::lock_guard lock(mu_);
  return abort_;
}

engine::GroupSummary Round::Summary() const {
  std::lock_guard lock(mu_);
  engine::GroupSummary s;
  s.group = group_;
  s.version = version_;
  s.members = members_;
  s.outcome = !decided_ ? "open" : abort_.ok() ? "committed" : "aborted";
  s.error = std::string(abort_.message());
  s.failed_member = failed_member_;
  s.slowest_member = prepared_ > 0 ? slowest_member_ : -1;
  s.coordination_seconds = coordination_seconds_;
  for (uint32_t i = 0; i < members_; ++i) {
    const Member& m = m_[i];
    engine::GroupMemberSummary d;
    d.member = i;
    d.publisher = m.publisher;
    d.state = StageName(static_cast<int>(m.stage));
    if (decided_ && m.stage == MemberStage::kPrepared)
      d.state = abort_.ok() ? "committed" : "aborted";
    d.tensors = m.tensor_count;
    d.bytes_in = m.parts.bytes_in;
    d.bytes_out = m.prepared.bytes_out ? m.prepared.bytes_out : m.parts.bytes_out;
    d.buckets = m.parts.buckets;
    d.engines = m.parts.engines;
    d.phases = m.prepared.phases;
    d.seconds = m.seconds;
    d.error = m.error;
    s.members_detail.push_back(std::move(d));
  }
  return s;
}

}  // namespace wpub::group
