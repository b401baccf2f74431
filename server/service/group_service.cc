// The leader's Group service: each member's Join stream turned into Round calls (core/group) by
// a callback reactor, and the Outcome a member in doubt asks for.
#include "server/service/group_service.h"

#include <deque>
#include <mutex>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "server/common/log_escape.h"
#include "wire/convert.h"
#include "wire/status_map.h"

namespace wpub::server {
namespace {

namespace pb = ::wpub::v1;

// One member's Group.Join stream on the leader, served from callbacks (no thread per stream):
// its messages become Round calls as they are read; the round's instructions (transfer, then the
// decision) are written as the round reaches them (Round::OnTransfer / OnDecision); the round's
// progress timeout is the service's StallWatch's. The stream finishes once the member stopped
// sending and the decision was written -- so no round callback outlives the reactor.
//
// Locking: mu_ guards the reactor's state; no Round call that may run callbacks (Fail, Stage,
// Prepared, OnTransfer, OnDecision) is made while holding it.
class JoinReactor final
    : public grpc::ServerBidiReactor<pb::GroupMemberMessage, pb::GroupLeaderMessage> {
 public:
  JoinReactor(GroupService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context), peer_(context->peer()) {
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (round_ == nullptr) {
      Join(ok);
      return;
    }
    if (!ok) {  // the member closed its side, or the stream broke
      EndOfReads();
      return;
    }
    if (absl::Status s = Handle(); !s.ok()) {
      {
        std::lock_guard lock(mu_);
        member_status_ = s;
      }
      round_->Fail(member_, absl::Status(s.code(), absl::StrCat("protocol error: ", s.message())));
      EndOfReads();
      return;
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock lock(mu_);
    out_.pop_front();
    if (!ok) out_.clear();  // the stream broke: its reads end too
    writing_ = !out_.empty();
    if (writing_) StartWrite(&out_.front());
    MaybeFinish(lock);
  }

  void OnDone() override {
    service_->StreamEnded();
    delete this;
  }

 private:
  // The first message: the member's join.
  void Join(bool ok) {
    if (!ok || in_.kind_case() != pb::GroupMemberMessage::kJoin) {
      FinishNow(
          {grpc::StatusCode::INVALID_ARGUMENT, "the first Group.Join message must be 'join'"});
      return;
    }
    join_ = in_.join();
    const pb::GroupJoin& j = join_;
    if (!(j.timeout_seconds() >= 0) || j.timeout_seconds() > 86400) {
      FinishNow({grpc::StatusCode::INVALID_ARGUMENT, "join.timeout_seconds must be in [0, 86400]"});
      return;
    }
    if (j.member() == 0) {
      FinishNow({grpc::StatusCode::INVALID_ARGUMENT,
                 "member 0 is the leader itself; it does not join over the network"});
      return;
    }
    group::MemberHello hello;
    hello.membership.group = j.group();
    hello.membership.members = j.members();
    hello.membership.member = j.member();
    hello.membership.publisher = j.publisher().empty() ? peer_ : j.publisher();
    hello.membership.leader = "(this daemon)";
    hello.version = j.version();
    hello.recipe = j.recipe();
    absl::StatusOr<std::shared_ptr<group::Round>> joined =
        service_->coordinator()->Join(hello, absl::Seconds(j.timeout_seconds()));
    if (!joined.ok()) {
      spdlog::warn("group: refused member {} ({}) of '{}' v{}: {}", j.member(),
                   LogEscape(hello.membership.publisher), LogEscape(j.group()), j.version(),
                   LogEscape(joined.status().ToString()));
      FinishNow(wire::ToGrpcStatus(joined.status()));
      return;
    }
    member_ = j.member();
    round_ = *std::move(joined);
    spdlog::info("group: member {} ({}) joined '{}' v{}", member_,
                 LogEscape(hello.membership.publisher), LogEscape(j.group()), j.version());
    if (absl::Status watched = service_->stall_watch().Watch(round_); !watched.ok()) {
      round_->Fail(member_, watched);
    }
    pb::GroupLeaderMessage accepted;
    accepted.mutable_accepted()->set_round(round_->id());
    Send(std::move(accepted));
    // The instructions, in order: transfer (unless aborted first), then the decision.
    round_->OnTransfer(member_, [this](absl::Status go) {
      if (!go.ok()) {
        Decided(go);
        return;
      }
      pb::GroupLeaderMessage transfer;
      transfer.mutable_transfer();
      Send(std::move(transfer));
      round_->OnDecision(member_, [this](absl::Status decision) { Decided(decision); });
    });
    StartRead(&in_);
  }

  // A message after the join; an error is the member's protocol error.
  absl::Status Handle() {
    switch (in_.kind_case()) {
      case pb::GroupMemberMessage::kParts: {
        if (staged_) return absl::InvalidArgumentError("parts after its last parts message");
        const pb::GroupParts& p = in_.parts();
        if (parts_.tensors.size() + p.tensors_size() > engine::kMaxGroupTensors) {
          return absl::InvalidArgumentError(
              absl::StrCat("more than ", engine::kMaxGroupTensors, " tensor names"));
        }
        size_t message_bytes = 0;
        for (const std::string& name : p.tensors()) {
          message_bytes += name.size();
          if (name.empty() || name.size() > engine::kMaxGroupTensorNameBytes) {
            return absl::InvalidArgumentError(
                absl::StrCat("a tensor name of ", name.size(), " bytes (1 to ",
                             engine::kMaxGroupTensorNameBytes, " allowed)"));
          }
          if (name_bytes_ + message_bytes > engine::kMaxGroupNameBytes) {
            return absl::InvalidArgumentError(
                absl::StrCat("its tensor names exceed ", engine::kMaxGroupNameBytes, " bytes"));
          }
        }
        // The round's bound over every member together, before the names are kept.
        WPUB_RETURN_IF_ERROR(round_->ReserveNameBytes(member_, message_bytes));
        name_bytes_ += message_bytes;
        for (const std::string& name : p.tensors()) parts_.tensors.push_back(name);
        if (p.last()) {
          parts_.bytes_in = p.bytes_in();
          parts_.bytes_out = p.bytes_out();
          parts_.buckets = p.buckets();
          parts_.engines = p.engines();
          staged_ = true;
          round_->Stage(member_, std::move(parts_));
        }
        return absl::OkStatus();
      }
      case pb::GroupMemberMessage::kPrepared: {
        engine::PreparedParts prepared;
        for (const std::string& r : in_.prepared().receivers()) prepared.receivers.push_back(r);
        prepared.bytes_out = in_.prepared().bytes_out();
        prepared.phases = wire::FromProto(in_.prepared().phases());
        round_->Prepared(member_, std::move(prepared));
        return absl::OkStatus();
      }
      case pb::GroupMemberMessage::kFailed:
        round_->Fail(member_, absl::Status(static_cast<absl::StatusCode>(in_.failed().code()),
                                           in_.failed().reason()));
        return absl::OkStatus();
      default:
        return absl::InvalidArgumentError("an unexpected message after 'join'");
    }
  }

  // The member sends nothing more (closed, broke, or a protocol error of its).
  void EndOfReads() {
    if (!round_->decided()) {
      // The stream ended before the decision: the member died or its connection dropped. A
      // prepared member's vote stands (the round ignores this); it asks for the decision.
      if (round_->prepared(member_)) {
        spdlog::warn(
            "group: member {} of '{}' v{} lost its stream after it prepared: its vote "
            "stands, it learns the decision through Group.Outcome",
            member_, LogEscape(join_.group()), join_.version());
      }
      round_->Fail(member_, absl::UnavailableError(absl::StrCat(
                                "its connection to the leader was lost (",
                                context_->IsCancelled() ? "cancelled" : "stream closed", ")")));
    }
    std::unique_lock lock(mu_);
    reads_done_ = true;
    MaybeFinish(lock);
  }

  // The round's decision for this member: written, then the stream may finish.
  void Decided(const absl::Status& decision) {
    pb::GroupLeaderMessage out;
    pb::GroupDecision* d = out.mutable_decision();
    d->set_commit(decision.ok());
    d->set_code(static_cast<int32_t>(decision.code()));
    d->set_reason(std::string(decision.message()));
    d->set_others_sent(round_->others_may_have_sent(member_));
    std::lock_guard lock(mu_);
    decided_ = true;
    SendLocked(std::move(out));
  }

  void Send(pb::GroupLeaderMessage message) {
    std::lock_guard lock(mu_);
    SendLocked(std::move(message));
  }
  void SendLocked(pb::GroupLeaderMessage message) {
    out_.push_back(std::move(message));
    if (!writing_) {
      writing_ = true;
      StartWrite(&out_.front());
    }
  }

  // Finish once the member stopped sending, the decision was written and no write is in flight
  // (Finish may not overlap a write; none starts after the decision). Releases `lock` before it
  // reports the round and finishes.
  void MaybeFinish(std::unique_lock<std::mutex>& lock) {
    if (finished_ || !reads_done_ || !decided_ || writing_) return;
    finished_ = true;
    const grpc::Status status =
        member_status_.ok() ? grpc::Status::OK : wire::ToGrpcStatus(member_status_);
    lock.unlock();
    service_->coordinator()->Observe(round_);
    const absl::Status outcome = round_->abort_status();
    spdlog::info("group: member {} of '{}' v{}: {}", member_, LogEscape(join_.group()),
                 join_.version(), outcome.ok() ? "committed" : LogEscape(outcome.ToString()));
    Finish(status);
  }

  // Before the member joined a round: nothing is in flight.
  void FinishNow(grpc::Status status) {
    std::lock_guard lock(mu_);
    finished_ = true;
    Finish(std::move(status));
  }

  GroupService* const service_;
  grpc::CallbackServerContext* const context_;  // valid until OnDone
  const std::string peer_;
  pb::GroupMemberMessage in_;  // being read
  // Set by the first message (the reads are one at a time, so the read callbacks own these).
  pb::GroupJoin join_;
  std::shared_ptr<group::Round> round_;
  uint32_t member_ = 0;
  engine::StagedParts parts_;
  size_t name_bytes_ = 0;
  bool staged_ = false;

  std::mutex mu_;
  absl::Status member_status_;              // a protocol error of the member's
  std::deque<pb::GroupLeaderMessage> out_;  // front() is being written while writing_
  bool writing_ = false;
  bool reads_done_ = false;
  bool decided_ = false;
  bool finished_ = false;
};

}  // namespace

GroupService::GroupService(group::Coordinator* coordinator, ServiceOptions options)
    : coordinator_(coordinator), options_(std::move(options)) {}

grpc::ServerBidiReactor<pb::GroupMemberMessage, pb::GroupLeaderMessage>* GroupService::Join(
    grpc::CallbackServerContext* context) {
  const auto refuse = [](grpc::Status status) {
    struct Refused final : grpc::ServerBidiReactor<pb::GroupMemberMessage, pb::GroupLeaderMessage> {
      explicit Refused(grpc::Status status) { Finish(std::move(status)); }
      void OnDone() override { delete this; }
    };
    return new Refused(std::move(status));
  };
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) return refuse(auth);
  if (const size_t n = ++open_streams_;
      options_.max_group_streams > 0 && n > options_.max_group_streams) {
    --open_streams_;
    return refuse({grpc::StatusCode::RESOURCE_EXHAUSTED,
                   absl::StrCat(options_.max_group_streams,
                                " group members are connected, the most this daemon serves at "
                                "once")});
  }
  if (grpc::Status peer = CheckGroupPeer(options_, *context); !peer.ok()) {
    --open_streams_;
    spdlog::warn("group: refused a join: {}", LogEscape(peer.error_message()));
    return refuse(peer);
  }
  return new JoinReactor(this, context);
}

grpc::ServerUnaryReactor* GroupService::Outcome(grpc::CallbackServerContext* context,
                                                const pb::GroupOutcomeRequest* request,
                                                pb::GroupOutcome* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(Answer(*context, *request, response));
  return reactor;
}

grpc::Status GroupService::Answer(const grpc::CallbackServerContext& context,
                                  const pb::GroupOutcomeRequest& request,
                                  pb::GroupOutcome* response) const {
  if (grpc::Status auth = CheckAuth(options_, context); !auth.ok()) return auth;
  if (grpc::Status peer = CheckGroupPeer(options_, context); !peer.ok()) return peer;
  if (request.group().size() > 100) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "group: longer than 100 bytes"};
  }
  const group::RoundOutcome o =
      coordinator_->OutcomeOf(request.group(), request.version(), request.round());
  using State = group::RoundOutcome::State;
  switch (o.state) {
    case State::kUndecided:
      response->set_state(pb::GroupOutcome::UNDECIDED);
      break;
    case State::kCommitted:
      response->set_state(pb::GroupOutcome::COMMITTED);
      break;
    case State::kAborted:
      response->set_state(pb::GroupOutcome::ABORTED);
      break;
    case State::kUnknown:
      response->set_state(pb::GroupOutcome::UNKNOWN);
      break;
  }
  response->set_code(static_cast<int32_t>(o.why.code()));
  response->set_reason(std::string(o.why.message()));
  return grpc::Status::OK;
}

}  // namespace wpub::server
