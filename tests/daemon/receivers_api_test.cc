// The Receivers API against hostile clients, through raw gRPC on an in-process daemon (engine +
// DaemonServer): a client that knows a receiver's name can neither pull nor acknowledge for it
// (a subscription token binds both to the stream), so the daemon never reports a receiver
// committed that did not acknowledge itself, and a wrong-checksum Ack under another name cannot
// abort a publication; receiver names are bounded and printable, client strings reach the log
// escaped, and PullBucket chunks are clamped from below.
#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>

#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/engine/engine.h"
#include "server/client/publisher_client.h"
#include "server/service/daemon_server.h"
#include "server/service/receivers_service.h"
#include "wpub/v1/receivers.grpc.pb.h"

namespace wpub::server {
namespace {

namespace pb = ::wpub::v1;

// A Subscribe stream read on its own thread; the events it got, for the test to wait on.
class RawSubscriber {
 public:
  RawSubscriber(pb::Receivers::Stub* stub, const std::string& name, uint64_t held_version = 0) {
    pb::SubscribeRequest request;
    request.set_receiver_name(name);
    request.set_held_version(held_version);
    reader_ = stub->Subscribe(&context_, request);
    thread_ = std::thread([this] {
      pb::ReceiverEvent event;
      while (reader_->Read(&event)) {
        std::lock_guard lock(mu_);
        events_.push_back(event);
        cv_.notify_all();
      }
      grpc::Status status = reader_->Finish();
      std::lock_guard lock(mu_);
      finish_ = status;
      ended_ = true;
      cv_.notify_all();
    });
  }
  ~RawSubscriber() { Leave(); }

  // Ends the stream (the daemon counts it as the receiver leaving).
  void Leave() {
    context_.TryCancel();
    if (thread_.joinable()) thread_.join();
  }

  // Waits until an event satisfies `pred` (true), or the stream ended (false). The bound only
  // turns a broken daemon into a failure instead of a hang.
  bool WaitFor(const std::function<bool(const pb::ReceiverEvent&)>& pred) {
    std::unique_lock lock(mu_);
    bool found = false;
    cv_.wait_for(lock, std::chrono::seconds(60), [&] {
      for (const auto& e : events_) found = found || pred(e);
      return found || ended_;
    });
    return found;
  }
  bool WaitForBucketReady(uint64_t version) {
    return WaitFor([&](const pb::ReceiverEvent& e) {
      return e.has_bucket_ready() && e.bucket_ready().version() == version;
    });
  }
  // The token of its group_info (waits for it).
  std::string Token() {
    EXPECT_TRUE(WaitFor([](const pb::ReceiverEvent& e) { return e.has_group_info(); }));
    std::lock_guard lock(mu_);
    return events_.empty() ? "" : events_.front().group_info().subscription_token();
  }
  // Whether the daemon took the subscription (its first event came) rather than ending it.
  bool Accepted() {
    return WaitFor([](const pb::ReceiverEvent& e) { return e.has_group_info(); });
  }
  pb::GroupInfo Info() {
    EXPECT_TRUE(WaitFor([](const pb::ReceiverEvent& e) { return e.has_group_info(); }));
    std::lock_guard lock(mu_);
    return events_.empty() ? pb::GroupInfo() : events_.front().group_info();
  }
  // The status the daemon ended the stream with (waits for the end).
  grpc::Status Finish() {
    WaitFor([](const pb::ReceiverEvent&) { return false; });
    std::lock_guard lock(mu_);
    return finish_;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<pb::ReceiverEvent>> reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<pb::ReceiverEvent> events_;
  bool ended_ = false;
  grpc::Status finish_;
  std::thread thread_;  // last: started after everything it touches exists
};

struct Pulled {
  grpc::Status status;
  std::string bytes;
  uint64_t checksum = 0;
  std::vector<size_t> chunk_sizes;
};

class ReceiversApiTest : public ::testing::Test {
 protected:
  void Start(uint64_t max_chunk_bytes = uint64_t{4} << 20, size_t max_subscriptions = 256) {
    auto engine = engine::Engine::Create(engine::EngineOptions{}, nullptr);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    DaemonServerOptions options;
    options.listen = "127.0.0.1:0";
    options.service.max_chunk_bytes = max_chunk_bytes;
    options.service.max_subscriptions = max_subscriptions;
    auto server = DaemonServer::Create(options, engine_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    const std::string target = absl::StrCat("127.0.0.1:", server_->port());
    stub_ = pb::Receivers::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    client::ClientOptions client_options;
    client_options.target = target;
    auto publisher = client::PublisherClient::Create(client_options);
    ASSERT_TRUE(publisher.ok()) << publisher.status();
    publisher_ = *std::move(publisher);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Now() + absl::Seconds(5));
    // Restored only once no server thread can log any more.
    if (previous_logger_) spdlog::set_default_logger(previous_logger_);
  }

  // Sends the service's log lines to captured_ from now until TearDown (call before Start).
  void CaptureLog() {
    previous_logger_ = spdlog::default_logger();
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(captured_);
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  }

  // Publishes `version` (one bf16 tensor of rows x 512, one bucket) on another thread.
  std::future<absl::StatusOr<pb::PublicationReport>> PublishAsync(uint64_t version,
                                                                  int64_t rows = 64) {
    return std::async(std::launch::async, [this, version, rows] {
      synthetic::ConversionBatch batch;
      batch.megatron_name = "embedding.word_embeddings.weight";
      batch.tensors.push_back({"model.embed_tokens.weight", DType::kBFloat16, {rows, 512}});
      pb::PublicationHeader header;
      header.set_version(version);
      header.set_recipe("bf16");
      client::StreamOptions stream;
      stream.chunk_bytes = 8 << 10;  // within every max_chunk_bytes the tests use
      return publisher_->Publish(header, {batch}, client::SyntheticFiller(version), stream);
    });
  }

  Pulled Pull(const std::string& name, const std::string& token, uint64_t version,
              uint64_t chunk_bytes = 0) {
    grpc::ClientContext context;
    pb::PullBucketRequest request;
    request.set_receiver_name(name);
    request.set_subscription_token(token);
    request.set_version(version);
    request.set_index(0);
    request.set_chunk_bytes(chunk_bytes);
    auto reader = stub_->PullBucket(&context, request);
    Pulled out;
    pb::BucketChunk chunk;
    while (reader->Read(&chunk)) {
      if (chunk.offset() == 0) out.checksum = chunk.checksum();
      out.bytes += chunk.data();
      out.chunk_sizes.push_back(chunk.data().size());
    }
    out.status = reader->Finish();
    return out;
  }

  grpc::Status Ack(const std::string& name, const std::string& token, uint64_t version,
                   uint64_t checksum) {
    grpc::ClientContext context;
    pb::AckRequest request;
    request.set_receiver_name(name);
    request.set_subscription_token(token);
    request.set_version(version);
    request.set_index(0);
    request.set_checksum(checksum);
    pb::AckResponse response;
    return stub_->Ack(&context, request, &response);
  }

  // The daemon's view of receiver `name` ("" when it does not list it).
  std::string StateOf(const std::string& name) {
    auto status = publisher_->GetStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    if (!status.ok()) return "";
    for (const auto& r : status->receivers()) {
      if (r.name() == name) return r.state();
    }
    return "";
  }

  // Every way a foreign client may try to pull or acknowledge as `victim`: each is refused
  // with PERMISSION_DENIED naming it.
  void ExpectForeignCallsRefused(const std::string& victim, const std::string& attacker_token,
                                 uint64_t version, uint64_t checksum) {
    for (const std::string& token : {std::string(), attacker_token, std::string(64, '0')}) {
      SCOPED_TRACE(token);
      Pulled p = Pull(victim, token, version);
      EXPECT_EQ(p.status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
          << p.status.error_message();
      EXPECT_TRUE(absl::StrContains(p.status.error_message(), victim)) << p.status.error_message();
      EXPECT_TRUE(p.bytes.empty());
      for (uint64_t sum : {checksum, checksum ^ 1}) {
        grpc::Status a = Ack(victim, token, version, sum);
        EXPECT_EQ(a.error_code(), grpc::StatusCode::PERMISSION_DENIED) << a.error_message();
        EXPECT_TRUE(absl::StrContains(a.error_message(), victim)) << a.error_message();
      }
    }
  }

  std::ostringstream captured_;  // outlives every server thread
  std::shared_ptr<spdlog::logger> previous_logger_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<DaemonServer> server_;
  std::unique_ptr<pb::Receivers::Stub> stub_;
  std::unique_ptr<client::PublisherClient> publisher_;
};

// The chunk sizes of `total` bytes sent `chunk` at a time.
std::vector<size_t> Chunks(size_t total, size_t chunk) {
  std::vector<size_t> sizes;
  for (size_t at = 0; at < total; at += chunk) sizes.push_back(std::min(chunk, total - at));
  return sizes;
}

const pb::ReceiverOutcome* OutcomeOf(const pb::PublicationReport& report, const std::string& name) {
  for (const auto& r : report.receivers()) {
    if (r.name() == name) return &r;
  }
  return nullptr;
}

// A foreign client echoing the daemon's own checksum under engine-1's name is refused; so is a
// wrong checksum under that name, which therefore cannot abort the publication: it commits once
// engine-1 acknowledges for itself.
TEST_F(ReceiversApiTest, ForeignPullsAndAcksAreRefusedAndChangeNothing) {
  Start();
  RawSubscriber victim(stub_.get(), "engine-1");
  RawSubscriber attacker(stub_.get(), "attacker");
  const std::string victim_token = victim.Token();
  const std::string attacker_token = attacker.Token();
  EXPECT_EQ(victim_token.size(), 64u);
  EXPECT_NE(victim_token, attacker_token);
  auto publication = PublishAsync(1);
  ASSERT_TRUE(attacker.WaitForBucketReady(1));
  // The attacker pulls its own copy legitimately: it knows the bytes and the checksum.
  Pulled own = Pull("attacker", attacker_token, 1);
  ASSERT_TRUE(own.status.ok()) << own.status.error_message();
  ASSERT_TRUE(Ack("attacker", attacker_token, 1, own.checksum).ok());

  ExpectForeignCallsRefused("engine-1", attacker_token, 1, own.checksum);
  EXPECT_EQ(StateOf("engine-1"), "receiving");  // not staged, not failed
  EXPECT_EQ(StateOf("attacker"), "staged");

  ASSERT_TRUE(victim.WaitForBucketReady(1));
  Pulled mine = Pull("engine-1", victim_token, 1);
  ASSERT_TRUE(mine.status.ok()) << mine.status.error_message();
  EXPECT_EQ(mine.bytes, own.bytes);
  ASSERT_TRUE(Ack("engine-1", victim_token, 1, mine.checksum).ok());
  auto report = publication.get();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
  for (const char* name : {"engine-1", "attacker"}) {
    const pb::ReceiverOutcome* o = OutcomeOf(*report, name);
    ASSERT_NE(o, nullptr) << name;
    EXPECT_TRUE(o->committed()) << name;
  }
}

// A receiver that never acknowledged is never reported committed, whatever others send in its
// name: when it leaves, the publication aborts.
TEST_F(ReceiversApiTest, AReceiverIsNotReportedCommittedUnlessItAcknowledgedItself) {
  Start();
  RawSubscriber victim(stub_.get(), "engine-1");
  RawSubscriber attacker(stub_.get(), "attacker");
  victim.Token();
  const std::string attacker_token = attacker.Token();
  auto publication = PublishAsync(1);
  ASSERT_TRUE(attacker.WaitForBucketReady(1));
  Pulled own = Pull("attacker", attacker_token, 1);
  ASSERT_TRUE(own.status.ok()) << own.status.error_message();
  ASSERT_TRUE(Ack("attacker", attacker_token, 1, own.checksum).ok());
  ExpectForeignCallsRefused("engine-1", attacker_token, 1, own.checksum);

  victim.Leave();
  auto report = publication.get();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_ABORTED);
  const pb::ReceiverOutcome* o = OutcomeOf(*report, "engine-1");
  ASSERT_NE(o, nullptr);
  EXPECT_FALSE(o->committed());
  EXPECT_EQ(o->failure(), "disconnected");
  EXPECT_EQ(engine_->GetStatus().committed_version, 0u);
}

TEST_F(ReceiversApiTest, ReceiverNamesAreBoundedAndPrintable) {
  Start();
  const std::string longest(transport::kMaxReceiverNameBytes, 'n');
  RawSubscriber ok(stub_.get(), longest);
  EXPECT_EQ(ok.Info().receiver_name(), longest);
  for (const std::string& bad : {longest + "n", std::string("two\nlines"), std::string("a b"),
                                 std::string(), std::string(1 << 20, 'x')}) {
    RawSubscriber sub(stub_.get(), bad);
    grpc::Status s = sub.Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.substr(0, 40);
    EXPECT_TRUE(absl::StrContains(s.error_message(), "receiver_name")) << s.error_message();
    EXPECT_LT(s.error_message().size(), 1000u);
    // PullBucket and Ack check the name the same way, before anything else.
    EXPECT_EQ(Pull(bad, "", 1).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(Ack(bad, "", 1, 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
}

// Subscriptions are bounded: past the bound one more is refused at once (RESOURCE_EXHAUSTED)
// and the ones connected are untouched; a leaving receiver frees its slot.
TEST_F(ReceiversApiTest, SubscriptionsAreBounded) {
  Start(uint64_t{4} << 20, /*max_subscriptions=*/2);
  auto a = std::make_unique<RawSubscriber>(stub_.get(), "a");
  RawSubscriber b(stub_.get(), "b");
  EXPECT_EQ(a->Info().receiver_name(), "a");
  EXPECT_EQ(b.Info().receiver_name(), "b");
  {
    RawSubscriber c(stub_.get(), "c");
    grpc::Status s = c.Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "2 receivers are subscribed"))
        << s.error_message();
  }
  EXPECT_EQ(StateOf("a"), "idle");
  a.reset();  // leaves: its slot is free once the daemon finished its stream
  bool taken = false;
  for (int i = 0; i < 500 && !taken; ++i) {
    RawSubscriber d(stub_.get(), "d");
    taken = d.Accepted();
    if (!taken) {
      EXPECT_EQ(d.Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  EXPECT_TRUE(taken) << "the slot of a receiver that left was never freed";
}

size_t ThreadsOfThisProcess() {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    (void)e;
    ++n;
  }
  return n;
}

// No thread per stream: 200 receivers subscribed at once (read by the test on one completion
// queue over 4 connections, so its own threads do not grow either) each get their group info
// and are listed,
// and the process holds about as many threads as with none.
TEST_F(ReceiversApiTest, SubscriptionsHoldNoThreadEach) {
  Start();
  {  // gRPC's own threads start with the first stream.
    RawSubscriber warm(stub_.get(), "warm");
    ASSERT_TRUE(warm.Accepted());
  }
  const size_t before = ThreadsOfThisProcess();
  constexpr size_t kStreams = 200;
  struct Stream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientAsyncReader<pb::ReceiverEvent>> reader;
    pb::ReceiverEvent event;
    grpc::Status status;
  };
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<Stream>> streams;
  // 50 streams per connection (the daemon's HTTP/2 concurrent-stream bound is per connection).
  std::vector<std::unique_ptr<pb::Receivers::Stub>> stubs;
  for (size_t c = 0; c < kStreams / 50; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stubs.push_back(pb::Receivers::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials(), args)));
  }
  // Tags: 3 * stream + (0 started, 1 read, 2 finished).
  const auto tag = [](size_t i, size_t what) { return reinterpret_cast<void*>(3 * i + what + 3); };
  for (size_t i = 0; i < kStreams; ++i) {
    auto s = std::make_unique<Stream>();
    pb::SubscribeRequest request;
    request.set_receiver_name(absl::StrCat("r", i));
    s->reader = stubs[i / 50]->PrepareAsyncSubscribe(&s->context, request, &cq);
    s->reader->StartCall(tag(i, 0));
    streams.push_back(std::move(s));
  }
  size_t infos = 0;
  void* got = nullptr;
  bool ok = false;
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(60);
  while (infos < kStreams &&
         cq.AsyncNext(&got, &ok, deadline) == grpc::CompletionQueue::GOT_EVENT) {
    const size_t i = (reinterpret_cast<size_t>(got) - 3) / 3;
    const size_t what = (reinterpret_cast<size_t>(got) - 3) % 3;
    ASSERT_TRUE(ok) << "stream r" << i << " ended before its group info";
    if (what == 0) {
      streams[i]->reader->Read(&streams[i]->event, tag(i, 1));
    } else if (what == 1) {
      EXPECT_TRUE(streams[i]->event.has_group_info());
      ++infos;
    }
  }
  ASSERT_EQ(infos, kStreams);
  auto status = publisher_->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(static_cast<size_t>(status->receivers_size()), kStreams);
  const size_t during = ThreadsOfThisProcess();
  EXPECT_LT(during, before + 16) << before << " threads before " << kStreams << " subscriptions, "
                                 << during << " with them";
  // Each leaves; the daemon ends every stream CANCELLED.
  for (size_t i = 0; i < kStreams; ++i) {
    streams[i]->context.TryCancel();
    streams[i]->reader->Finish(&streams[i]->status, tag(i, 2));
  }
  size_t finished = 0;
  while (finished < kStreams &&
         cq.AsyncNext(&got, &ok, deadline) == grpc::CompletionQueue::GOT_EVENT) {
    if ((reinterpret_cast<size_t>(got) - 3) % 3 == 2) ++finished;
  }
  EXPECT_EQ(finished, kStreams);
  cq.Shutdown();
  while (cq.Next(&got, &ok)) {
  }
}

// A name (or any client string) with a newline cannot forge a log line: every line the service
// logs about it holds the escaped bytes.
TEST_F(ReceiversApiTest, ClientStringsAreEscapedInTheLog) {
  CaptureLog();
  Start();
  const std::string forged = "2026-01-01T00:00:00.000 info [wpubd] FORGED commit of v9";
  {
    RawSubscriber sub(stub_.get(), "evil\n" + forged);
    sub.Finish();
  }
  Pull("x\n" + forged, "", 1);
  Ack("x\r\n" + forged, "", 1, 0);
  RawSubscriber honest(stub_.get(), "honest");
  honest.Token();
  Pull("honest", "not-the-token\n" + forged, 1);
  honest.Leave();
  // Read once no server thread can still be writing.
  server_->Shutdown(absl::Now() + absl::Seconds(5));
  const std::string log = captured_.str();
  int refusals = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    EXPECT_FALSE(absl::StartsWith(line, "2026-01-01")) << "forged line in:\n" << log;
    refusals += absl::StrContains(line, "refused") ? 1 : 0;
  }
  EXPECT_EQ(refusals, 4) << log;
  EXPECT_TRUE(absl::StrContains(log, "evil\\n2026-01-01")) << log;
}

// 1-byte chunks would cost a message per byte: chunks are at least kMinPullChunkBytes (or the
// daemon's limit when that is smaller), and never above the limit.
TEST_F(ReceiversApiTest, PullChunksAreClampedFromBelow) {
  Start(/*max_chunk_bytes=*/uint64_t{128} << 10);
  RawSubscriber sub(stub_.get(), "r");
  const std::string token = sub.Token();
  const int64_t rows = 256;  // 256 x 512 bf16: a 256 KiB bucket
  auto publication = PublishAsync(1, rows);
  ASSERT_TRUE(sub.WaitForBucketReady(1));
  const size_t nbytes = rows * 512 * 2;
  for (uint64_t asked : {uint64_t{1}, uint64_t{1000}, kMinPullChunkBytes}) {
    Pulled p = Pull("r", token, 1, asked);
    ASSERT_TRUE(p.status.ok()) << p.status.error_message();
    EXPECT_GE(p.bytes.size(), nbytes);
    EXPECT_EQ(p.chunk_sizes, Chunks(p.bytes.size(), kMinPullChunkBytes)) << asked;
  }
  for (uint64_t asked : {uint64_t{0}, uint64_t{1} << 30}) {
    Pulled p = Pull("r", token, 1, asked);
    ASSERT_TRUE(p.status.ok()) << p.status.error_message();
    EXPECT_EQ(p.chunk_sizes, Chunks(p.bytes.size(), 128 << 10)) << asked;
  }
  Pulled p = Pull("r", token, 1);
  ASSERT_TRUE(Ack("r", token, 1, p.checksum).ok());
  auto report = publication.get();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
  EXPECT_EQ(sub.Info().max_chunk_bytes(), 128u << 10);
}

TEST_F(ReceiversApiTest, ALimitBelowTheMinimumChunkWins) {
  Start(/*max_chunk_bytes=*/uint64_t{16} << 10);
  RawSubscriber sub(stub_.get(), "r");
  const std::string token = sub.Token();
  auto publication = PublishAsync(1, 64);  // 64 KiB
  ASSERT_TRUE(sub.WaitForBucketReady(1));
  Pulled p = Pull("r", token, 1, 1);
  ASSERT_TRUE(p.status.ok()) << p.status.error_message();
  EXPECT_EQ(p.chunk_sizes, Chunks(p.bytes.size(), 16 << 10));
  EXPECT_GE(p.chunk_sizes.size(), 4u);
  ASSERT_TRUE(Ack("r", token, 1, p.checksum).ok());
  auto report = publication.get();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
}

// The version a receiver says it holds stops a daemon from publishing one at or below it.
TEST_F(ReceiversApiTest, AVersionAReceiverHoldsIsRefused) {
  Start();
  RawSubscriber sub(stub_.get(), "engine-0", /*held_version=*/5);
  const std::string token = sub.Token();
  auto refused = PublishAsync(1).get();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "engine-0")) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "version 5")) << refused.status();
  auto publication = PublishAsync(6);
  ASSERT_TRUE(sub.WaitForBucketReady(6));
  Pulled p = Pull("engine-0", token, 6);
  ASSERT_TRUE(p.status.ok()) << p.status.error_message();
  ASSERT_TRUE(Ack("engine-0", token, 6, p.checksum).ok());
  auto report = publication.get();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
}

}  // namespace
}  // namespace wpub::server
