// TCPStore server protocol tests: a C++ client speaking torch's wire format (VALIDATE, PING,
// the init/ ADD, SET/GET through WAIT, CHECK, COMPARE_SET, MULTI_*, CANCEL_WAIT), the
// unique-id key ProcessGroupNCCL reads, partial writes, and malformed requests.
#include <gtest/gtest.h>

#include <limits>
#include <thread>

#include "core/rendezvous/tcp_store_client.h"
#include "core/rendezvous/tcp_store_protocol.h"
#include "core/rendezvous/tcp_store_server.h"

namespace wpub::rendezvous {
namespace {

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

class TcpStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TcpStoreServerOptions o;
    o.bind_address = "127.0.0.1";
    o.max_item_bytes = 1 << 20;
    auto s = TcpStoreServer::Create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  std::unique_ptr<TcpStoreClient> Client(bool announce = true) {
    TcpStoreClientOptions o;
    o.port = server_->port();
    o.timeout = absl::Seconds(5);
    o.announce_worker = announce;
    auto c = TcpStoreClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  std::unique_ptr<TcpStoreServer> server_;
};

TEST_F(TcpStoreTest, HandshakeCountsWorkersLikeTorch) {
  auto a = Client();
  auto b = Client();
  ASSERT_TRUE(a && b);
  // Each torch client ADDs "init/" 1 on connect; values are ASCII decimal.
  EXPECT_EQ(server_->Get("init/"), Bytes("2"));
  EXPECT_EQ(*a->Ping(0xDEADBEEF), 0xDEADBEEFu);
  EXPECT_EQ(server_->stats().connections_open, 2u);
}

TEST_F(TcpStoreTest, UniqueIdKeyMatchesProcessGroupNccl) {
  auto key = UniqueIdKey(kDefaultUniqueIdKeyTemplate, "g");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "/g/g//cuda//0");
  EXPECT_EQ(*UniqueIdKey(kDefaultUniqueIdKeyTemplate, "wpub_update", 3),
            "/wpub_update/wpub_update//cuda//3");
  EXPECT_EQ(*UniqueIdKey("/{group}/nccl/{index}", "x", 1), "/x/nccl/1");
  EXPECT_FALSE(UniqueIdKey("/nccl/{index}", "x").ok());
  EXPECT_FALSE(UniqueIdKey(kDefaultUniqueIdKeyTemplate, "").ok());
}

TEST_F(TcpStoreTest, GetWaitsUntilPublisherSetsUniqueId) {
  auto c = Client();
  ASSERT_TRUE(c);
  const std::string key = *UniqueIdKey(kDefaultUniqueIdKeyTemplate, "g");
  std::vector<uint8_t> id(128);
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(i * 7 + 1);
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server_->Set(key, id);
  });
  const absl::Time t0 = absl::Now();
  auto got = c->Get(key);  // WAIT (blocks until the local Set), then GET
  setter.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, id);
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(90));
  const std::vector<std::string> awaited = server_->RecentlyAwaitedKeys();
  ASSERT_FALSE(awaited.empty());
  EXPECT_EQ(awaited.back(), key);
}

TEST_F(TcpStoreTest, SetGetAddCheckDeleteNumKeys) {
  auto a = Client(false);
  auto b = Client(false);
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->Set("/k", Bytes("value")).ok());
  EXPECT_EQ(*b->Get("/k"), Bytes("value"));
  EXPECT_EQ(*a->Add("/n", 5), 5);
  EXPECT_EQ(*b->Add("/n", -2), 3);
  EXPECT_EQ(server_->Get("/n"), Bytes("3"));
  EXPECT_EQ(*server_->Add("/n", 10), 13);
  EXPECT_TRUE(*a->Check({"/k", "/n"}));
  EXPECT_FALSE(*a->Check({"/k", "/missing"}));
  EXPECT_EQ(*a->NumKeys(), 2);
  EXPECT_TRUE(*a->DeleteKey("/k"));
  EXPECT_FALSE(*a->DeleteKey("/k"));
  EXPECT_EQ(*a->NumKeys(), 1);
  // ADD on a non-decimal value: the local API reports it, a client connection is closed.
  server_->Set("/text", Bytes("abc"));
  EXPECT_FALSE(server_->Add("/text", 1).ok());
  EXPECT_FALSE(b->Add("/text", 1).ok());
}

TEST_F(TcpStoreTest, AddBeyondInt64IsRefusedAndLeavesTheValue) {
  auto c = Client(false);
  ASSERT_TRUE(c);
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(*server_->Add("/n", kMax), kMax);
  absl::StatusOr<int64_t> local = server_->Add("/n", 1);
  ASSERT_FALSE(local.ok());
  EXPECT_NE(local.status().message().find("overflows int64"), std::string::npos) << local.status();
  EXPECT_FALSE(c->Add("/n", 1).ok());  // the server closes that connection
  EXPECT_TRUE(c->PeerClosed(absl::Seconds(2)));
  EXPECT_EQ(server_->Get("/n"), Bytes(std::to_string(kMax)));
  EXPECT_EQ(*server_->Add("/n", -kMax), 0);  // still a working counter
}

TEST_F(TcpStoreTest, CompareSetAppendMulti) {
  auto c = Client(false);
  ASSERT_TRUE(c);
  // Missing key, empty expectation: sets and returns the desired value.
  EXPECT_EQ(*c->CompareSet("/cas", {}, Bytes("one")), Bytes("one"));
  // Wrong expectation: unchanged.
  EXPECT_EQ(*c->CompareSet("/cas", Bytes("zzz"), Bytes("two")), Bytes("one"));
  EXPECT_EQ(*c->CompareSet("/cas", Bytes("one"), Bytes("two")), Bytes("two"));
  // Missing key, non-empty expectation: torch answers the expectation and sets nothing.
  EXPECT_EQ(*c->CompareSet("/none", Bytes("x"), Bytes("y")), Bytes("x"));
  EXPECT_FALSE(server_->Get("/none").has_value());
  ASSERT_TRUE(c->Append("/log", Bytes("ab")).ok());
  ASSERT_TRUE(c->Append("/log", Bytes("cd")).ok());
  ASSERT_TRUE(c->MultiSet({"/m1", "/m2"}, {Bytes("1"), Bytes("22")}).ok());
  auto mg = c->MultiGet({"/log", "/m1", "/m2"});
  ASSERT_TRUE(mg.ok()) << mg.status();
  EXPECT_EQ((*mg)[0], Bytes("abcd"));
  EXPECT_EQ((*mg)[1], Bytes("1"));
  EXPECT_EQ((*mg)[2], Bytes("22"));
}

TEST_F(TcpStoreTest, WaitOnSeveralKeysAndCancel) {
  auto waiter = Client(false);
  auto setter = Client(false);
  ASSERT_TRUE(waiter && setter);
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE(setter->Set("/a", Bytes("1")).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE(setter->Add("/b", 1).ok());  // ADD also wakes waiters
  });
  EXPECT_TRUE(waiter->Wait({"/a", "/b"}, absl::Seconds(5)).ok());
  t.join();
  // A WAIT that times out is cancelled (CANCEL_WAIT -> WAIT_CANCELED) and the connection stays
  // usable.
  const absl::Status s = waiter->Wait({"/never"}, absl::Milliseconds(100));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_EQ(*waiter->Ping(7), 7u);
  // Setting the key later does not send a stray STOP_WAITING to the cancelled waiter.
  server_->Set("/never", Bytes("x"));
  EXPECT_EQ(*waiter->Ping(8), 8u);
}

TEST_F(TcpStoreTest, RequestsSplitAcrossWritesAreReassembled) {
  auto c = Client(false);
  ASSERT_TRUE(c);
  WireWriter w;
  w.Value(QueryType::kSet).String("/split").Vector(Bytes("payload-bytes"));
  const auto& b = w.bytes();
  for (size_t i = 0; i < b.size(); ++i) {
    ASSERT_TRUE(c->SendRaw({b[i]}).ok());
    if (i % 5 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(*c->Get("/split"), Bytes("payload-bytes"));
}

TEST_F(TcpStoreTest, MalformedRequestsCloseOnlyThatConnection) {
  auto good = Client(false);
  ASSERT_TRUE(good);
  {
    auto bad = Client(false);
    ASSERT_TRUE(bad);
    ASSERT_TRUE(bad->SendRaw({0xEE}).ok());  // unknown query type
    EXPECT_TRUE(bad->PeerClosed(absl::Seconds(2)));
  }
  {
    auto bad = Client(false);
    WireWriter w;
    w.Value(QueryType::kValidate).Value<uint32_t>(0x12345678);  // wrong magic
    ASSERT_TRUE(bad->SendRaw(w.bytes()).ok());
    EXPECT_TRUE(bad->PeerClosed(absl::Seconds(2)));
  }
  {
    auto bad = Client(false);
    WireWriter w;
    w.Value(QueryType::kGet).String("/absent");  // GET of a missing key (torch closes too)
    ASSERT_TRUE(bad->SendRaw(w.bytes()).ok());
    EXPECT_TRUE(bad->PeerClosed(absl::Seconds(2)));
  }
  {
    auto bad = Client(false);
    WireWriter w;
    w.Value(QueryType::kSet).Value<uint64_t>(uint64_t{1} << 40);  // oversized key length
    ASSERT_TRUE(bad->SendRaw(w.bytes()).ok());
    EXPECT_TRUE(bad->PeerClosed(absl::Seconds(2)));
  }
  EXPECT_GE(server_->stats().protocol_errors, 4u);
  EXPECT_EQ(*good->Ping(42), 42u);
  ASSERT_TRUE(good->Set("/still", Bytes("ok")).ok());
  EXPECT_EQ(*good->Get("/still"), Bytes("ok"));
}

TEST_F(TcpStoreTest, ClientTimesOutAgainstClosedPort) {
  const uint16_t port = server_->port();
  server_.reset();
  TcpStoreClientOptions o;
  o.port = port;
  o.timeout = absl::Milliseconds(200);
  auto c = TcpStoreClient::Connect(o);
  EXPECT_TRUE(absl::IsDeadlineExceeded(c.status())) << c.status();
}

TEST(TcpStoreServerCreate, RejectsBadOptions) {
  TcpStoreServerOptions o;
  o.bind_address = "not-an-ip";
  EXPECT_TRUE(absl::IsInvalidArgument(TcpStoreServer::Create(o).status()));
  o.bind_address = "127.0.0.1";
  auto a = TcpStoreServer::Create(o);
  ASSERT_TRUE(a.ok());
  o.port = (*a)->port();
  EXPECT_TRUE(absl::IsUnavailable(TcpStoreServer::Create(o).status()));
}

}  // namespace
}  // namespace wpub::rendezvous
