// The gRPC listener's bounds against a real wpubd with raw gRPC clients: an oversized message
// costs the daemon at most about its memory quota (gRPC's HTTP/2 transport buffers a whole
// message before the size limit is checked) and the daemon keeps serving; server reflection
// needs the bearer token when one is configured, health checking does not.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/daemon/harness.h"
#include "tests/daemon/proc_status.h"

namespace wpub::testing {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Waits for the one event on `cq` (the calls below run one operation at a time).
bool Await(grpc::CompletionQueue* cq) {
  void* tag = nullptr;
  bool ok = false;
  return cq->Next(&tag, &ok) && ok;
}

// One raw unary call of `method` with `request` as the body: the status, and the reply bytes.
grpc::Status RawUnary(const std::string& target, const std::string& method,
                      const grpc::Slice& request, std::string* reply_bytes,
                      const std::string& token = "") {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  grpc::ByteBuffer request_buffer(&request, 1);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&context, method, request_buffer, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  Await(&cq);
  cq.Shutdown();
  while (Await(&cq)) {
  }
  std::vector<grpc::Slice> slices;
  if (status.ok() && response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) reply_bytes->append(s.begin(), s.end());
  }
  return status;
}

// grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo with one list_services
// request, raw: the final status, and the bytes of every reply.
grpc::Status ReflectionListServices(const std::string& target, const std::string& token,
                                    std::string* replies) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  bool ok = Await(&cq);
  // ServerReflectionRequest{list_services = 7: "*"}.
  const std::string request = std::string("\x3a\x01*", 3);
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  if (ok) {
    call->Write(request_buffer, reinterpret_cast<void*>(2));
    ok = Await(&cq);
  }
  if (ok) {
    call->WritesDone(reinterpret_cast<void*>(3));
    ok = Await(&cq);
  }
  while (ok) {
    grpc::ByteBuffer reply;
    call->Read(&reply, reinterpret_cast<void*>(4));
    if (!Await(&cq)) break;
    std::vector<grpc::Slice> slices;
    if (reply.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) replies->append(s.begin(), s.end());
    }
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  Await(&cq);
  cq.Shutdown();
  while (Await(&cq)) {
  }
  return status;
}

TEST(GrpcBounds, OversizedMessageCostsAtMostTheMemoryQuotaAndTheDaemonKeepsServing) {
  HarnessOptions options;
  options.receivers = 0;
  options.daemon_flags = {absl::StrCat("--grpc_memory_bytes=", 64 * kMiB)};
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();
  const pid_t pid = (*h)->daemon().pid();
  const int64_t peak_before = ProcStatusBytes(pid, "VmHWM");
  ASSERT_GT(peak_before, 0);

  // One unauthenticated 512 MiB message, far over --max_message_bytes (8 MiB).
  std::string reply;
  grpc::Status status = RawUnary((*h)->target(), "/wpub.v1.Publisher/GetStatus",
                                 grpc::Slice(static_cast<size_t>(512 * kMiB)), &reply);
  EXPECT_FALSE(status.ok());
  const int64_t growth = ProcStatusBytes(pid, "VmHWM") - peak_before;
  // Without the quota the daemon buffered the whole message (growth >= 512 MiB). With a
  // 64 MiB quota the stream is cancelled once its buffers reach it; the bound is generous.
  EXPECT_LT(growth, 256 * kMiB) << "peak RSS grew by " << growth / kMiB << " MiB ("
                                << status.error_code() << " " << status.error_message() << ")";

  // The daemon keeps serving, an ordinary call included.
  EXPECT_TRUE((*h)->daemon().Running());
  EXPECT_EQ(HealthCheck((*h)->target()).value_or(-1), 1);
  auto s = (*h)->client().GetStatus();
  EXPECT_TRUE(s.ok()) << s.status();
  reply.clear();
  EXPECT_TRUE(RawUnary((*h)->target(), "/wpub.v1.Publisher/GetStatus", grpc::Slice(), &reply).ok());
}

TEST(GrpcBounds, ReflectionNeedsTheTokenHealthDoesNot) {
  char tmpl[] = "/tmp/wpub-token-XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  const std::string token = "s3cret-token";
  std::ofstream(tmpl) << token << "\n";
  HarnessOptions options;
  options.receivers = 0;
  options.auth_token_file = tmpl;
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();

  std::string replies;
  grpc::Status without = ReflectionListServices((*h)->target(), "", &replies);
  EXPECT_FALSE(without.ok());
  EXPECT_EQ(replies.find("wpub.v1.Publisher"), std::string::npos) << "reflection answered";
  replies.clear();
  grpc::Status wrong = ReflectionListServices((*h)->target(), "wrong", &replies);
  EXPECT_FALSE(wrong.ok());
  EXPECT_EQ(replies.find("wpub.v1.Publisher"), std::string::npos) << "reflection answered";

  replies.clear();
  grpc::Status with = ReflectionListServices((*h)->target(), token, &replies);
  EXPECT_TRUE(with.ok()) << with.error_code() << " " << with.error_message();
  EXPECT_NE(replies.find("wpub.v1.Publisher"), std::string::npos);
  EXPECT_NE(replies.find("wpub.v1.Receivers"), std::string::npos);

  // Probes need no token.
  EXPECT_EQ(HealthCheck((*h)->target()).value_or(-1), 1);
  EXPECT_EQ(HealthCheck((*h)->target(), "wpub.v1.Publisher").value_or(-1), 1);
  std::remove(tmpl);
}

}  // namespace
}  // namespace wpub::testing
