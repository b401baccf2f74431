// The leader's Group.Join handler: a member's stream turned into Round calls (core/group), with
// a writer thread that forwards the round's instructions (transfer, decision) to the member.
#include "server/service/group_service.h"

#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "server/common/log_escape.h"
#include "wire/convert.h"
#include "wire/status_map.h"

namespace wpub::server {
namespace {

namespace pb = ::wpub::v1;

pb::GroupLeaderMessage DecisionMessage(const absl::Status& s, bool others_sent) {
  pb::GroupLeaderMessage out;
  pb::GroupDecision* d = out.mutable_decision();
  d->set_commit(s.ok());
  d->set_code(static_cast<int32_t>(s.code()));
  d->set_reason(std::string(s.message()));
  d->set_others_sent(others_sent);
  return out;
}

}  // namespace

GroupService::GroupService(group::Coordinator* coordinator, ServiceOptions options)
    : coordinator_(coordinator), options_(std::move(options)) {}

grpc::Status GroupService::Join(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<pb::GroupLeaderMessage, pb::GroupMemberMessage>* stream) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) return auth;
  // Each stream holds a server thread for its whole round: beyond the bound, refused at once.
  struct StreamSlot {
    std::atomic<size_t>& open;
    ~StreamSlot() { --open; }
  } slot{open_streams_};
  if (const size_t n = ++open_streams_;
      options_.max_group_streams > 0 && n > options_.max_group_streams) {
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat(options_.max_group_streams,
                         " group members are connected, the most this daemon serves at once "
                         "(half of --grpc_max_threads)")};
  }
  if (grpc::Status peer = CheckGroupPeer(options_, *context); !peer.ok()) {
    spdlog::warn("group: refused a join: {}", LogEscape(peer.error_message()));
    return peer;
  }
  pb::GroupMemberMessage msg;
  if (!stream->Read(&msg) || msg.kind_case() != pb::GroupMemberMessage::kJoin) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "the first Group.Join message must be 'join'"};
  }
  const pb::GroupJoin j = msg.join();  // a copy: msg is read into again below
  group::MemberHello hello;
  hello.membership.group = j.group();
  hello.membership.members = j.members();
  hello.membership.member = j.member();
  hello.membership.publisher = j.publisher().empty() ? std::string(context->peer()) : j.publisher();
  hello.membership.leader = "(this daemon)";
  hello.version = j.version();
  hello.recipe = j.recipe();
  if (!(j.timeout_seconds() >= 0) || j.timeout_seconds() > 86400) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "join.timeout_seconds must be in [0, 86400]"};
  }
  if (j.member() == 0) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            "member 0 is the leader itself; it does not join over the network"};
  }
  absl::StatusOr<std::shared_ptr<group::Round>> joined =
      coordinator_->Join(hello, absl::Seconds(j.timeout_seconds()));
  if (!joined.ok()) {
    spdlog::warn("group: refused member {} ({}) of '{}' v{}: {}", j.member(),
                 LogEscape(hello.membership.publisher), LogEscape(j.group()), j.version(),
                 LogEscape(joined.status().ToString()));
    return ToGrpcStatus(joined.status());
  }
  std::shared_ptr<group::Round> round = *std::move(joined);
  const uint32_t m = j.member();
  spdlog::info("group: member {} ({}) joined '{}' v{}", m, LogEscape(hello.membership.publisher),
               LogEscape(j.group()), j.version());
  {
    pb::GroupLeaderMessage accepted;
    accepted.mutable_accepted()->set_round(round->id());
    if (!stream->Write(accepted)) {
      round->Fail(m, absl::UnavailableError("its stream broke before it was accepted"));
      coordinator_->Observe(round);
      return {grpc::StatusCode::UNAVAILABLE, "the member went away"};
    }
  }
  // The instructions, in order: transfer (unless aborted first), then the decision.
  std::thread writer([&] {
    absl::Status go = round->AwaitTransfer(m);
    if (go.ok()) {
      pb::GroupLeaderMessage transfer;
      transfer.mutable_transfer();
      stream->Write(transfer);
      go = round->AwaitDecision(m);
    }
    stream->Write(DecisionMessage(go, round->others_may_have_sent(m)));
  });

  engine::StagedParts parts;
  size_t name_bytes = 0;
  bool staged = false;
  absl::Status member_status;  // a protocol error of the member's
  while (stream->Read(&msg)) {
    switch (msg.kind_case()) {
      case pb::GroupMemberMessage::kParts: {
        if (staged) {
          member_status = absl::InvalidArgumentError("parts after its last parts message");
          break;
        }
        const pb::GroupParts& p = msg.parts();
        if (parts.tensors.size() + p.tensors_size() > engine::kMaxGroupTensors) {
          member_status = absl::InvalidArgumentError(
              absl::StrCat("more than ", engine::kMaxGroupTensors, " tensor names"));
          break;
        }
        size_t message_bytes = 0;
        for (const std::string& name : p.tensors()) {
          message_bytes += name.size();
          if (name.empty() || name.size() > engine::kMaxGroupTensorNameBytes) {
            member_status = absl::InvalidArgumentError(
                absl::StrCat("a tensor name of ", name.size(), " bytes (1 to ",
                             engine::kMaxGroupTensorNameBytes, " allowed)"));
          } else if (name_bytes + message_bytes > engine::kMaxGroupNameBytes) {
            member_status = absl::InvalidArgumentError(
                absl::StrCat("its tensor names exceed ", engine::kMaxGroupNameBytes, " bytes"));
          }
          if (!member_status.ok()) break;
        }
        // The round's bound over every member together, before the names are kept.
        if (member_status.ok()) member_status = round->ReserveNameBytes(m, message_bytes);
        if (!member_status.ok()) break;
        name_bytes += message_bytes;
        for (const std::string& name : p.tensors()) parts.tensors.push_back(name);
        if (p.last()) {
          parts.bytes_in = p.bytes_in();
          parts.bytes_out = p.bytes_out();
          parts.buckets = p.buckets();
          parts.engines = p.engines();
          staged = true;
          round->Stage(m, std::move(parts));
        }
        break;
      }
      case pb::GroupMemberMessage::kPrepared: {
        engine::PreparedParts prepared;
        for (const std::string& r : msg.prepared().receivers()) prepared.receivers.push_back(r);
        prepared.bytes_out = msg.prepared().bytes_out();
        prepared.phases = FromProto(msg.prepared().phases());
        round->Prepared(m, std::move(prepared));
        break;
      }
      case pb::GroupMemberMessage::kFailed:
        round->Fail(m, absl::Status(static_cast<absl::StatusCode>(msg.failed().code()),
                                    msg.failed().reason()));
        break;
      default:
        member_status = absl::InvalidArgumentError("an unexpected message after 'join'");
        break;
    }
    if (!member_status.ok()) {
      round->Fail(m, absl::Status(member_status.code(),
                                  absl::StrCat("protocol error: ", member_status.message())));
      break;
    }
  }
  if (!round->decided()) {
    // The stream ended before the decision: the member died or its connection dropped. A
    // prepared member's vote stands (the round ignores this); it asks for the decision.
    if (round->prepared(m)) {
      spdlog::warn(
          "group: member {} of '{}' v{} lost its stream after it prepared: its vote "
          "stands, it learns the decision through Group.Outcome",
          m, LogEscape(j.group()), j.version());
    }
    round->Fail(m, absl::UnavailableError(
                       absl::StrCat("its connection to the leader was lost (",
                                    context->IsCancelled() ? "cancelled" : "stream closed", ")")));
  }
  writer.join();
  coordinator_->Observe(round);
  const absl::Status outcome = round->abort_status();
  spdlog::info("group: member {} of '{}' v{}: {}", m, LogEscape(j.group()), j.version(),
               outcome.ok() ? "committed" : LogEscape(outcome.ToString()));
  return member_status.ok() ? grpc::Status::OK : ToGrpcStatus(member_status);
}

grpc::Status GroupService::Outcome(grpc::ServerContext* context,
                                   const pb::GroupOutcomeRequest* request,
                                   pb::GroupOutcome* response) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) return auth;
  if (grpc::Status peer = CheckGroupPeer(options_, *context); !peer.ok()) return peer;
  if (request->group().size() > 100) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "group: longer than 100 bytes"};
  }
  const group::RoundOutcome o =
      coordinator_->OutcomeOf(request->group(), request->version(), request->round());
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
