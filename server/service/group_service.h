// The gRPC side of publication groups (proto/wpub/v1/group.proto).
// - GroupService: served by every wpubd; joins the streams of the members that reach this
//   daemon as their leader to the coordinator's rounds (core/group).
// - GroupJoinerImpl: the engine's GroupJoiner. Member 0's publication joins the local
//   coordinator; any other member's opens a stream to its leader (RemoteVote in
//   group_client.cc) that lives until the decision. A member whose stream ends after it voted
//   prepared and before the decision holds the version in doubt: it asks the leader
//   (Group.Outcome) until it learns the decision, and obeys that and nothing else.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/time/time.h"
#include "core/engine/group_vote.h"
#include "core/group/coordinator.h"
#include "core/group/stall_watch.h"
#include "server/service/service_options.h"
#include "wire/tls.h"
#include "wpub/v1/group.grpc.pb.h"

namespace wpub::server {

// A CALLBACK service, no thread per stream: each Join stream is a reactor fed by its round's
// callbacks (Round::OnTransfer / OnDecision), and the progress timeout of the rounds they wait
// on is one StallWatch's. Streams are bounded by ServiceOptions::max_group_streams.
class GroupService final : public wpub::v1::Group::CallbackService {
 public:
  // `coordinator` must outlive the service.
  GroupService(group::Coordinator* coordinator, ServiceOptions options);

  grpc::ServerBidiReactor<wpub::v1::GroupMemberMessage, wpub::v1::GroupLeaderMessage>* Join(
      grpc::CallbackServerContext* context) override;
  // What the coordinator knows of a round (a member in doubt asks).
  grpc::ServerUnaryReactor* Outcome(grpc::CallbackServerContext* context,
                                    const wpub::v1::GroupOutcomeRequest* request,
                                    wpub::v1::GroupOutcome* response) override;

  // For the Join reactors.
  group::Coordinator* coordinator() const { return coordinator_; }
  group::StallWatch& stall_watch() { return stall_watch_; }
  void StreamEnded() { --open_streams_; }
  // Join streams being served.
  size_t open_streams() const { return open_streams_.load(); }

 private:
  grpc::Status Answer(const grpc::CallbackServerContext& context,
                      const wpub::v1::GroupOutcomeRequest& request,
                      wpub::v1::GroupOutcome* response) const;

  group::Coordinator* const coordinator_;
  const ServiceOptions options_;
  std::atomic<size_t> open_streams_{0};  // Join streams being served (max_group_streams)
  group::StallWatch stall_watch_;        // last: its thread checks rounds until destroyed
};

struct GroupClientOptions {
  // Sent to the leader as a bearer token (the group's daemons share one); empty: none.
  std::string auth_token;
  // TLS to the leader (plaintext unless ca_file is set).
  wire::ClientTls tls;
  // How long a member waits for the leader to accept its join.
  absl::Duration join_timeout = absl::Seconds(30);
  // HTTP/2 keepalive on the stream to the leader: a leader that stops answering pings is
  // found within time + timeout -- before this member prepared, the version aborts on it;
  // after, it holds the version in doubt and asks the leader for the decision.
  absl::Duration keepalive_time = absl::Seconds(10);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  // In doubt: the first and the longest pause between two Group.Outcome calls (doubling), and
  // each call's deadline.
  absl::Duration outcome_retry_min = absl::Milliseconds(100);
  absl::Duration outcome_retry_max = absl::Seconds(2);
  absl::Duration outcome_call_timeout = absl::Seconds(5);
};

class GroupJoinerImpl final : public engine::GroupJoiner {
 public:
  // `coordinator` must outlive the joiner.
  GroupJoinerImpl(group::Coordinator* coordinator, GroupClientOptions options);
  absl::StatusOr<std::unique_ptr<engine::GroupVote>> Join(
      const engine::PublicationHeader& header, std::function<void(absl::Status)> on_abort) override;
  // The daemon is stopping: a vote in doubt stops asking its leader (its publication ends
  // UNAVAILABLE on this member; its receivers were told nothing). Idempotent.
  void Shutdown();

  // Shared by the joiner and its votes (a vote may outlive the joiner's last call).
  struct Stop {
    std::mutex mu;
    std::condition_variable cv;
    bool stopping = false;
  };

 private:
  static constexpr size_t kMaxLeaderChannels = 16;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> ChannelTo(const std::string& leader);
  absl::StatusOr<std::unique_ptr<engine::GroupVote>> JoinOver(
      std::shared_ptr<grpc::Channel> channel, const engine::PublicationHeader& header,
      std::function<void(absl::Status)> on_abort);

  group::Coordinator* const coordinator_;
  const GroupClientOptions options_;
  const std::shared_ptr<Stop> stop_ = std::make_shared<Stop>();
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;  // guarded by mu_
};

}  // namespace wpub::server
