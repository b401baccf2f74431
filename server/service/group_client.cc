// A member's side of Group.Join (RemoteVote) and the engine's GroupJoiner: member 0 joins the
// local coordinator, any other member its leader over gRPC.
#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include <grpcpp/create_channel.h>
#include <grpcpp/support/channel_arguments.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "server/common/log_escape.h"
#include "server/service/group_service.h"
#include "server/service/service_options.h"
#include "wire/convert.h"
#include "wire/status_map.h"

namespace wpub::server {
namespace {

namespace pb = ::wpub::v1;

// Names per parts message (a message stays far below the leader's message limit).
constexpr int kNamesPerMessage = 4096;

// The stream to the leader and what it said; shared by the vote and its reader thread, so it
// outlives whichever ends last.
struct Link {
  // Declared first, destroyed last: the stream needs its channel.
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Group::Stub> stub;
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<pb::GroupMemberMessage, pb::GroupLeaderMessage>> stream;
  std::string leader;
  std::string auth_token;
  std::function<void(absl::Status)> on_abort;

  std::mutex write_mu;  // serializes writes and WritesDone
  bool writes_done = false;

  std::mutex mu;
  std::condition_variable cv;
  bool accepted = false;
  uint64_t round = 0;  // GroupAccepted.round
  bool transfer = false;
  std::optional<absl::Status> decision;  // OK: commit
  bool others_sent = false;
  bool ended = false;  // the reader returned
  // This member sent `prepared`: from then on only the leader's decision ends the version here.
  bool prepared_sent = false;
  // The stream ended after `prepared` and before the decision (Prepare asks Group.Outcome).
  bool in_doubt = false;

  bool Write(const pb::GroupMemberMessage& m) {
    std::lock_guard lock(write_mu);
    if (writes_done) return false;
    return stream->Write(m);
  }
  void CloseWrites() {
    std::lock_guard lock(write_mu);
    if (writes_done) return;
    writes_done = true;
    stream->WritesDone();
  }

  // The reader thread: every leader message until the stream ends.
  void Read() {
    pb::GroupLeaderMessage msg;
    std::optional<absl::Status> aborted;
    while (stream->Read(&msg)) {
      std::lock_guard lock(mu);
      if (msg.has_accepted()) {
        accepted = true;
        round = msg.accepted().round();
      } else if (msg.has_transfer()) {
        transfer = true;
      } else if (msg.has_decision()) {
        const pb::GroupDecision& d = msg.decision();
        others_sent = d.others_sent();
        if (d.commit()) {
          decision = absl::OkStatus();
        } else {
          absl::StatusCode code = static_cast<absl::StatusCode>(d.code());
          if (code == absl::StatusCode::kOk) code = absl::StatusCode::kAborted;
          decision = absl::Status(code, d.reason());
          aborted = decision;
        }
      }
      cv.notify_all();
    }
    const grpc::Status finish = stream->Finish();
    {
      std::lock_guard lock(mu);
      ended = true;
      if (!decision.has_value() && prepared_sent) {
        // The vote binds: the version is in doubt, not aborted.
        in_doubt = true;
      } else if (!decision.has_value()) {
        if (!accepted) {
          decision = wire::ToAbslStatus(finish);
          if (decision->ok()) decision = absl::UnavailableError("the leader ended the stream");
        } else {
          decision = absl::UnavailableError(absl::StrCat("the connection to the group's leader ",
                                                         leader, " was lost before it decided (",
                                                         finish.error_message(), ")"));
        }
        if (accepted) aborted = decision;
      }
      cv.notify_all();
    }
    if (aborted.has_value() && on_abort) on_abort(*aborted);
  }
};

class RemoteVote final : public engine::GroupVote {
 public:
  RemoteVote(std::shared_ptr<Link> link, std::thread reader, engine::GroupSummary summary,
             const GroupClientOptions& options, std::shared_ptr<GroupJoinerImpl::Stop> stop)
      : link_(std::move(link)),
        reader_(std::move(reader)),
        summary_(std::move(summary)),
        options_(options),
        stop_(std::move(stop)) {}

  ~RemoteVote() override {
    Fail(absl::AbortedError("the member's publication ended before the decision"));
    link_->CloseWrites();
    bool decided;
    {
      std::lock_guard lock(link_->mu);
      decided = link_->decision.has_value();
    }
    if (!decided) link_->context.TryCancel();
    // The reader may be this very thread (its abort callback ended the publication).
    if (reader_.get_id() == std::this_thread::get_id()) {
      reader_.detach();
    } else {
      reader_.join();
    }
  }

  absl::Status Stage(const engine::StagedParts& parts) override {
    // The names in messages of kNamesPerMessage; the last one (also for no names) with totals.
    size_t next = 0;
    bool last = false;
    while (!last) {
      pb::GroupMemberMessage msg;
      pb::GroupParts* p = msg.mutable_parts();
      const size_t end = std::min(parts.tensors.size(), next + kNamesPerMessage);
      for (; next < end; ++next) p->add_tensors(parts.tensors[next]);
      last = next == parts.tensors.size();
      if (last) {
        p->set_last(true);
        p->set_bytes_in(parts.bytes_in);
        p->set_bytes_out(parts.bytes_out);
        p->set_buckets(parts.buckets);
        p->set_engines(parts.engines);
      }
      link_->Write(msg);  // a broken stream shows as the decision below
    }
    std::unique_lock lock(link_->mu);
    link_->cv.wait(lock, [&] { return link_->transfer || link_->decision.has_value(); });
    if (link_->decision.has_value() && !link_->decision->ok()) return *link_->decision;
    return absl::OkStatus();
  }

  absl::Status Prepare(const engine::PreparedParts& parts) override {
    pb::GroupMemberMessage msg;
    pb::GroupPrepared* p = msg.mutable_prepared();
    for (const std::string& r : parts.receivers) p->add_receivers(r);
    p->set_bytes_out(parts.bytes_out);
    wire::ToProto(parts.phases, p->mutable_phases());
    {
      std::lock_guard lock(link_->mu);
      // A stream that ended already ended before the leader could hold this vote.
      if (link_->decision.has_value()) return *link_->decision;
      link_->prepared_sent = true;
    }
    link_->Write(msg);  // a broken stream shows as the version in doubt
    std::unique_lock lock(link_->mu);
    link_->cv.wait(lock, [&] { return link_->decision.has_value() || link_->in_doubt; });
    if (link_->decision.has_value()) return *link_->decision;
    lock.unlock();
    return Resolve();
  }

  void Fail(const absl::Status& why) override {
    {
      std::lock_guard lock(link_->mu);
      // After `prepared` the vote binds: only the leader's decision ends the version.
      if (link_->decision.has_value() || link_->prepared_sent || failed_) return;
      failed_ = true;
    }
    pb::GroupMemberMessage msg;
    msg.mutable_failed()->set_code(static_cast<int32_t>(why.code()));
    msg.mutable_failed()->set_reason(std::string(why.message()));
    link_->Write(msg);
  }

  bool others_may_have_sent() const override {
    std::lock_guard lock(link_->mu);
    return link_->others_sent;
  }

  engine::GroupSummary Summary() const override {
    engine::GroupSummary s = summary_;
    std::lock_guard lock(link_->mu);
    if (!link_->decision.has_value()) {
      s.outcome = link_->in_doubt ? "in doubt" : "open";
    } else if (link_->decision->ok()) {
      s.outcome = "committed";
    } else {
      s.outcome = "aborted";
      s.error = std::string(link_->decision->message());
    }
    return s;
  }

 private:
  // In doubt: asks the leader for the round's decision until it has one (the leader back, or
  // reachable again), pausing outcome_retry_min doubling to outcome_retry_max between calls.
  // Nothing else ends the version on this member: not its trainer, not a timeout.
  absl::Status Resolve() {
    uint64_t round;
    {
      std::lock_guard lock(link_->mu);
      round = link_->round;
    }
    spdlog::warn(
        "group '{}' v{}: the stream to the leader {} ended after this member prepared "
        "and before the decision: the version is in doubt here until the leader says "
        "(round {})",
        LogEscape(summary_.group), summary_.version, LogEscape(link_->leader), round);
    pb::GroupOutcomeRequest req;
    req.set_group(summary_.group);
    req.set_version(summary_.version);
    req.set_round(round);
    absl::Duration pause = options_.outcome_retry_min;
    std::string last;
    for (int asked = 1;; ++asked) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.outcome_call_timeout));
      if (!link_->auth_token.empty()) {
        ctx.AddMetadata("authorization", absl::StrCat("Bearer ", link_->auth_token));
      }
      pb::GroupOutcome out;
      const grpc::Status s = link_->stub->Outcome(&ctx, req, &out);
      std::optional<absl::Status> decided;
      if (s.ok() && out.state() == pb::GroupOutcome::COMMITTED) {
        decided = absl::OkStatus();
      } else if (s.ok() && out.state() == pb::GroupOutcome::ABORTED) {
        absl::StatusCode code = static_cast<absl::StatusCode>(out.code());
        if (code == absl::StatusCode::kOk) code = absl::StatusCode::kAborted;
        decided = absl::Status(code, out.reason());
      }
      if (decided.has_value()) {
        spdlog::info("group '{}' v{}: the leader decided {} (learned after {} question(s))",
                     LogEscape(summary_.group), summary_.version,
                     decided->ok() ? "commit" : "abort", asked);
        std::lock_guard lock(link_->mu);
        link_->decision = decided;
        link_->cv.notify_all();
        return *decided;
      }
      const std::string now = s.ok() ? absl::StrCat(pb::GroupOutcome::State_Name(out.state()),
                                                    out.reason().empty() ? "" : ": ", out.reason())
                                     : absl::StrCat("no answer: ", s.error_message());
      if (now != last) {
        spdlog::warn("group '{}' v{}: still in doubt ({})", LogEscape(summary_.group),
                     summary_.version, LogEscape(now));
        last = now;
      }
      {
        std::unique_lock lock(stop_->mu);
        if (stop_->cv.wait_for(lock, absl::ToChronoNanoseconds(pause),
                               [&] { return stop_->stopping; })) {
          return absl::UnavailableError(absl::StrCat(
              "the daemon stopped while group '", summary_.group, "' version ", summary_.version,
              " was in doubt here (prepared; the leader's decision not learned: ", now,
              "); its receivers learn it from the group's other members"));
        }
      }
      pause = std::min(pause * 2, options_.outcome_retry_max);
    }
  }

  const std::shared_ptr<Link> link_;
  std::thread reader_;
  const engine::GroupSummary summary_;  // the membership; the outcome is read from the link
  const GroupClientOptions options_;
  const std::shared_ptr<GroupJoinerImpl::Stop> stop_;
  bool failed_ = false;  // guarded by link_->mu
};

}  // namespace

GroupJoinerImpl::GroupJoinerImpl(group::Coordinator* coordinator, GroupClientOptions options)
    : coordinator_(coordinator), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<engine::GroupVote>> GroupJoinerImpl::Join(
    const engine::PublicationHeader& header, std::function<void(absl::Status)> on_abort) {
  const engine::GroupMembership& gm = *header.group;
  if (gm.member == 0) return coordinator_->JoinLocal(header, std::move(on_abort));
  // An unauthenticated group forms on loopback only (the leader refuses such a member from
  // another host, and a member does not hand its parts to a leader it cannot authenticate).
  if (options_.auth_token.empty() && options_.tls.cert_file.empty() &&
      !IsLoopbackAddress(gm.leader)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the group's leader ", gm.leader,
        " is not on this host and this daemon has no token: an unauthenticated group forms on "
        "loopback only -- give every daemon of the group the same --auth_token_file (or mutual "
        "TLS)"));
  }

  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = ChannelTo(gm.leader);
  if (!channel.ok()) return channel.status();
  return JoinOver(*std::move(channel), header, std::move(on_abort));
}

void GroupJoinerImpl::Shutdown() {
  std::lock_guard lock(stop_->mu);
  stop_->stopping = true;
  stop_->cv.notify_all();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> GroupJoinerImpl::ChannelTo(
    const std::string& leader) {
  std::lock_guard lock(mu_);
  if (auto it = channels_.find(leader); it != channels_.end()) return it->second;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      wire::ChannelCredentialsFor(options_.tls);
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options_.keepalive_time)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options_.keepalive_timeout)));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(leader, *std::move(credentials), args);
  // One connection per leader, kept across versions (a member's leader rarely changes; the
  // map is bounded, its oldest entries dropped).
  if (channels_.size() >= kMaxLeaderChannels) channels_.erase(channels_.begin());
  channels_[leader] = channel;
  return channel;
}

absl::StatusOr<std::unique_ptr<engine::GroupVote>> GroupJoinerImpl::JoinOver(
    std::shared_ptr<grpc::Channel> channel, const engine::PublicationHeader& header,
    std::function<void(absl::Status)> on_abort) {
  const engine::GroupMembership& gm = *header.group;
  const absl::Time deadline = absl::Now() + options_.join_timeout;
  if (!channel->WaitForConnected(absl::ToChronoTime(deadline))) {
    return absl::UnavailableError(absl::StrCat("cannot reach the group's leader at ", gm.leader,
                                               " within ",
                                               absl::FormatDuration(options_.join_timeout)));
  }
  auto link = std::make_shared<Link>();
  link->leader = gm.leader;
  link->auth_token = options_.auth_token;
  link->on_abort = std::move(on_abort);
  if (!options_.auth_token.empty()) {
    link->context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.auth_token));
  }
  link->channel = channel;
  link->stub = pb::Group::NewStub(channel);
  link->stream = link->stub->Join(&link->context);
  pb::GroupMemberMessage join;
  pb::GroupJoin* j = join.mutable_join();
  j->set_group(gm.group);
  j->set_members(gm.members);
  j->set_member(gm.member);
  j->set_publisher(gm.publisher);
  j->set_version(header.version);
  j->set_recipe(header.recipe);
  j->set_timeout_seconds(absl::ToDoubleSeconds(gm.timeout));
  link->Write(join);
  std::thread reader([link] { link->Read(); });
  {
    std::unique_lock lock(link->mu);
    const bool answered = link->cv.wait_until(lock, absl::ToChronoTime(deadline), [&] {
      return link->accepted || link->decision.has_value();
    });
    if (!answered || !link->accepted) {
      absl::Status why =
          !answered ? absl::DeadlineExceededError(absl::StrCat(
                          "the group's leader at ", gm.leader, " did not accept the join within ",
                          absl::FormatDuration(options_.join_timeout)))
                    : *link->decision;
      lock.unlock();
      link->context.TryCancel();
      reader.join();
      return why;
    }
  }
  engine::GroupSummary summary;
  summary.group = gm.group;
  summary.version = header.version;
  summary.members = gm.members;
  summary.member = gm.member;
  summary.leader = gm.leader;
  return std::unique_ptr<engine::GroupVote>(
      new RemoteVote(std::move(link), std::move(reader), std::move(summary), options_, stop_));
}

}  // namespace wpub::server
