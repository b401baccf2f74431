// The gRPC side of publication groups (proto/wpub/v1/group.proto).
// - GroupService: served by every wpubd; joins the streams of the members that reach this
//   daemon as their leader to the coordinator's rounds (core/group).
// - GroupJoinerImpl: the engine's GroupJoiner. Member 0's publication joins the local
//   coordinator; any other member's opens a stream to its leader (RemoteVote in
//   group_client.cc) that lives until the decision.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/time/time.h"
#include "core/engine/group_vote.h"
#include "core/group/coordinator.h"
#include "server/service/service_options.h"
#include "wire/tls.h"
#include "wpub/v1/group.grpc.pb.h"

namespace wpub::server {

class GroupService final : public wpub::v1::Group::Service {
 public:
  // `coordinator` must outlive the service.
  GroupService(group::Coordinator* coordinator, ServiceOptions options);

  grpc::Status Join(grpc::ServerContext* context,
                    grpc::ServerReaderWriter<wpub::v1::GroupLeaderMessage,
                                             wpub::v1::GroupMemberMessage>* stream) override;

 private:
  group::Coordinator* const coordinator_;
  const ServiceOptions options_;
  std::atomic<size_t> open_streams_{0};  // Join streams being served (max_group_streams)
};

struct GroupClientOptions {
  // Sent to the leader as a bearer token (the group's daemons share one); empty: none.
  std::string auth_token;
  // TLS to the leader (plaintext unless ca_file is set).
  client::ClientTls tls;
  // How long a member waits for the leader to accept its join.
  absl::Duration join_timeout = absl::Seconds(30);
  // HTTP/2 keepalive on the stream to the leader: a leader that stops answering pings is
  // found within time + timeout, and the version aborts on this member.
  absl::Duration keepalive_time = absl::Seconds(10);
  absl::Duration keepalive_timeout = absl::Seconds(10);
};

class GroupJoinerImpl final : public engine::GroupJoiner {
 public:
  // `coordinator` must outlive the joiner.
  GroupJoinerImpl(group::Coordinator* coordinator, GroupClientOptions options);
  absl::StatusOr<std::unique_ptr<engine::GroupVote>> Join(
      const engine::PublicationHeader& header, std::function<void(absl::Status)> on_abort) override;

 private:
  static constexpr size_t kMaxLeaderChannels = 16;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> ChannelTo(const std::string& leader);
  absl::StatusOr<std::unique_ptr<engine::GroupVote>> JoinOver(
      std::shared_ptr<grpc::Channel> channel, const engine::PublicationHeader& header,
      std::function<void(absl::Status)> on_abort);

  group::Coordinator* const coordinator_;
  const GroupClientOptions options_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;  // guarded by mu_
};

}  // namespace wpub::server
