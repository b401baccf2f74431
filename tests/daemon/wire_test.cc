// In-process tests of the server-side pieces: status mapping, wire conversions and their
// errors, loopback detection, safetensors I/O, tensor splitting, and a whole DaemonServer with
// an in-process wpub-recv Receiver (bearer-token checks included).
#include <cmath>
#include <fstream>
#include <thread>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"
#include "clients/recv/receiver.h"
#include "clients/recv/safetensors.h"
#include "core/engine/engine.h"
#include "core/metrics/metrics.h"
#include "server/client/publisher_client.h"
#include "server/service/daemon_server.h"
#include "wire/convert.h"
#include "wire/status_map.h"

namespace wpub::server {
namespace {

namespace pb = ::wpub::v1;

TEST(StatusMap, EveryCodeRoundTripsWithItsMessage) {
  for (int c = 0; c <= 16; ++c) {
    const auto code = static_cast<absl::StatusCode>(c);
    absl::Status s(code, c == 0 ? "" : absl::StrCat("tensor t", c));
    grpc::Status g = wire::ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    if (c != 0) {
      EXPECT_EQ(g.error_message(), absl::StrCat("tensor t", c));
    }
    EXPECT_EQ(wire::ToAbslStatus(g), s);
  }
}

pb::Batch OneTensorBatch() {
  pb::Batch b;
  b.set_megatron_name("decoder.layers.0.self_attention.linear_proj.weight");
  pb::TensorDescriptor* t = b.add_tensors();
  t->set_name("model.layers.0.self_attn.o_proj.weight");
  t->set_dtype("bfloat16");
  t->add_shape(8);
  t->add_shape(32);
  pb::TensorPart* p = t->add_parts();
  p->add_shape(8);
  p->add_shape(32);
  p->mutable_inline_();
  return b;
}

TEST(Convert, BatchWithEverySourceKind) {
  pb::Batch b = OneTensorBatch();
  pb::TensorDescriptor* t = b.mutable_tensors(0);
  t->set_concat_dim(1);
  pb::TensorPart* shm = t->add_parts();
  shm->add_shape(8);
  shm->add_shape(16);
  shm->mutable_shm()->set_name("/seg");
  shm->mutable_shm()->set_offset(64);
  shm->mutable_shm()->set_length(256);
  pb::TensorPart* ipc = t->add_parts();
  ipc->mutable_cuda_ipc()->set_handle(std::string(64, '\x07'));
  ipc->mutable_cuda_ipc()->set_device_uuid("GPU-1");
  absl::StatusOr<engine::BatchInput> in = wire::FromProto(b);
  ASSERT_TRUE(in.ok()) << in.status();
  ASSERT_EQ(in->tensors.size(), 1u);
  const engine::TensorInput& ti = in->tensors[0];
  EXPECT_EQ(ti.desc.dtype, DType::kBFloat16);
  EXPECT_EQ(ti.desc.shape, (Shape{8, 32}));
  EXPECT_EQ(ti.concat_dim, 1);
  ASSERT_EQ(ti.parts.size(), 3u);
  EXPECT_TRUE(std::holds_alternative<engine::InlineSource>(ti.parts[0].source));
  const auto& s = std::get<engine::ShmSource>(ti.parts[1].source);
  EXPECT_EQ(s.name, "/seg");
  EXPECT_EQ(s.offset, 64u);
  EXPECT_EQ(s.length, 256u);
  const auto& c = std::get<engine::CudaIpcSource>(ti.parts[2].source);
  EXPECT_EQ(c.handle[63], 7);
  EXPECT_EQ(c.device_uuid, "GPU-1");
}

TEST(Convert, ErrorsNameTheTensorAndField) {
  {
    pb::Batch b = OneTensorBatch();
    b.mutable_tensors(0)->set_dtype("float7");
    auto s = wire::FromProto(b).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("o_proj.weight"), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find("float7"), absl::string_view::npos) << s;
  }
  {
    pb::Batch b = OneTensorBatch();
    b.mutable_tensors(0)->mutable_parts(0)->clear_source();
    auto s = wire::FromProto(b).status();
    EXPECT_NE(s.message().find("no source"), absl::string_view::npos) << s;
  }
  {
    pb::Batch b = OneTensorBatch();
    b.mutable_tensors(0)->set_concat_dim(3);
    EXPECT_NE(wire::FromProto(b).status().message().find("concat_dim"), absl::string_view::npos);
  }
  {
    pb::Batch b = OneTensorBatch();
    b.mutable_tensors(0)->set_shape(0, -2);
    EXPECT_NE(wire::FromProto(b).status().message().find("negative"), absl::string_view::npos);
  }
  {
    pb::Batch b = OneTensorBatch();
    b.mutable_tensors(0)->mutable_parts(0)->mutable_cuda_ipc()->set_handle("short");
    EXPECT_NE(wire::FromProto(b).status().message().find("cuda_ipc.handle"),
              absl::string_view::npos);
  }
  {
    pb::PublicationHeader h;
    EXPECT_NE(wire::FromProto(h).status().message().find("header.version"),
              absl::string_view::npos);
  }
}

TEST(Convert, HeaderAndPrecisionExceptions) {
  pb::PublicationHeader h;
  h.set_version(7);
  h.set_recipe("bf16");
  h.set_bucket_bytes(4096);
  h.set_queue(true);
  h.set_release_gpu_memory(true);
  auto* e = h.mutable_precision_exceptions();
  e->add_extra_high_precision_layers_megatron("layers.0.");
  e->set_first_last_layers_bf16(true);
  e->set_num_layers(10);
  e->set_num_layers_at_end_in_bf16(2);
  auto out = wire::FromProto(h);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->version, 7u);
  EXPECT_EQ(out->recipe, "bf16");
  EXPECT_EQ(out->bucket_bytes, 4096u);
  EXPECT_TRUE(out->queue);
  EXPECT_TRUE(out->release_backend_memory);
  EXPECT_EQ(
      out->policy_json,
      R"({"extra_high_precision_layers_megatron":["layers.0."],"first_last_layers_bf16":true,)"
      R"("num_layers":10,"num_layers_at_end_in_bf16":2})");
  EXPECT_EQ(wire::PrecisionExceptionsJson(pb::PrecisionExceptions()), "");
}

TEST(Convert, ManifestRoundTrip) {
  transport::PublicationManifest m;
  m.version = 3;
  m.model_id = "m";
  m.recipe = "nvfp4";
  transport::BucketManifest b;
  b.index = 0;
  b.nbytes = 40;
  b.checksum = 0xfeedfacecafebeefull;
  b.tensors.push_back({"a.weight", DType::kFloat32, {2, 4}, 0, 32});
  b.tensors.push_back({"a.weight_scale", DType::kFloat8E4M3, {2, 4}, 32, 8});
  m.buckets.push_back(b);
  pb::ReceiverEvent event;
  wire::ToProto(transport::ReceiverEvent(transport::ManifestEvent{m}), &event);
  ASSERT_TRUE(event.has_manifest());
  EXPECT_EQ(event.manifest().total_bytes(), 40u);
  EXPECT_EQ(event.manifest().buckets(0).tensors(1).dtype(), "float8_e4m3fn");
  auto back = wire::FromProto(event.manifest());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->buckets, m.buckets);
  EXPECT_EQ(back->version, 3u);
}

TEST(Convert, ConnectEnginesRequestAndGroup) {
  pb::ConnectEnginesRequest r;
  r.add_engines()->set_url("http://a:1");  // gpus unset: 1
  auto* b = r.add_engines();
  b->set_url("http://b:2");
  b->set_gpus(4);
  r.set_group_name("run7");
  r.set_timeout_seconds(2.5);
  auto e = wire::FromProto(r);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_EQ(e->engines.size(), 2u);
  EXPECT_EQ(e->engines[0].gpus, 1);
  EXPECT_EQ(e->engines[1].gpus, 4);
  EXPECT_EQ(e->group_name, "run7");
  EXPECT_EQ(e->timeout, absl::Milliseconds(2500));
  for (double bad : {-1.0, 1e9, std::nan("")}) {
    r.set_timeout_seconds(bad);
    auto s = wire::FromProto(r).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad;
    EXPECT_NE(s.message().find("timeout_seconds"), std::string::npos) << s;
  }

  engine::RolloutGroupInfo g;
  g.group_name = "run7_3";
  g.world_size = 6;
  g.generation = 3;
  g.healthy = true;
  g.store_address = "10.0.0.5:29500";
  g.engines = {{"http://a:1", 1, 1, transport::ReceiverState::kIdle, 0, {}},
               {"http://b:2", 4, 2, transport::ReceiverState::kFailed, 0, {}}};
  pb::EngineGroup status;
  wire::ToProto(g, &status);
  EXPECT_EQ(status.group_name(), "run7_3");
  EXPECT_EQ(status.world_size(), 6u);
  EXPECT_EQ(status.generation(), 3u);
  EXPECT_TRUE(status.healthy());
  EXPECT_EQ(status.store_address(), "10.0.0.5:29500");
  ASSERT_EQ(status.engines_size(), 2);
  EXPECT_EQ(status.engines(1).rank_offset(), 2u);
  EXPECT_EQ(status.engines(1).gpus(), 4u);
  EXPECT_EQ(status.engines(1).state(), "failed");
  pb::ConnectEnginesResponse reply;
  wire::ToProto(g, &reply);
  EXPECT_EQ(reply.group_name(), "run7_3");
  EXPECT_EQ(reply.world_size(), 6u);
  EXPECT_EQ(reply.generation(), 3u);
  ASSERT_EQ(reply.engines_size(), 2);
  EXPECT_EQ(reply.engines(0).url(), "http://a:1");
  EXPECT_EQ(reply.engines(0).rank_offset(), 1u);
}

TEST(DaemonServer, LoopbackDetection) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:1"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:50151"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:50151"));
  EXPECT_TRUE(IsLoopbackAddress("unix:/run/wpubd.sock"));
  EXPECT_FALSE(IsLoopbackAddress("0.0.0.0:50151"));
  EXPECT_FALSE(IsLoopbackAddress("[::]:50151"));
  EXPECT_FALSE(IsLoopbackAddress("10.1.2.3:50151"));
  // gRPC's peer strings (who may join a group without a token).
  EXPECT_TRUE(IsLoopbackPeer("ipv4:127.0.0.1:41234"));
  EXPECT_TRUE(IsLoopbackPeer("ipv4:127.3.2.1:1"));
  EXPECT_TRUE(IsLoopbackPeer("ipv6:[::1]:41234"));
  EXPECT_TRUE(IsLoopbackPeer("ipv6:[::ffff:127.0.0.1]:41234"));
  EXPECT_TRUE(IsLoopbackPeer("unix:/run/wpub/wpubd.sock"));
  EXPECT_TRUE(IsLoopbackPeer("unix-abstract:wpub"));
  EXPECT_FALSE(IsLoopbackPeer("ipv4:10.1.2.3:41234"));
  EXPECT_FALSE(IsLoopbackPeer("ipv6:[::ffff:10.0.0.1]:1"));
  EXPECT_FALSE(IsLoopbackPeer("ipv6:[fe80::1]:1"));
  EXPECT_FALSE(IsLoopbackPeer("ipv4:1127.0.0.1:1"));
  EXPECT_FALSE(IsLoopbackPeer(""));
}

TEST(Safetensors, RoundTripWithTorchToSafetensorsDtypes) {
  const std::string path = ::testing::TempDir() + "/wire_test.safetensors";
  std::vector<uint8_t> a(2 * 3 * 2, 0x11), b(5, 0x22), c(4, 0x33);
  ASSERT_TRUE(recv::WriteSafetensors(path,
                                     {{{"x.weight", DType::kBFloat16, {2, 3}}, a},
                                      {{"x.weight_scale", DType::kFloat8E4M3, {5}}, b},
                                      {{"x.weight_scale_2", DType::kFloat32, {}}, c}},
                                     {{"version", "9"}})
                  .ok());
  auto f = recv::ReadSafetensors(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata["version"], "9");
  EXPECT_EQ(f->tensors["x.weight"].dtype, "BF16");
  EXPECT_EQ(f->tensors["x.weight_scale"].dtype, "F8_E4M3");
  EXPECT_EQ(f->tensors["x.weight_scale_2"].dtype, "F32");
  EXPECT_EQ(f->tensors["x.weight_scale_2"].shape, Shape{});
  EXPECT_EQ(f->tensors["x.weight"].bytes, a);
  EXPECT_EQ(f->order, (std::vector<std::string>{"x.weight", "x.weight_scale", "x.weight_scale_2"}));
  // The 8-byte length prefix is little-endian and the header is padded to 8 bytes.
  std::ifstream in(path, std::ios::binary);
  uint8_t len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{len[i]} << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_FALSE(recv::WriteSafetensors(path, {{{"y", DType::kBFloat16, {4}}, b}}, {}).ok());
}

TEST(PublisherClient, CopyPartSplitsAlongEitherDim) {
  // A [2, 4] uint8 tensor 0..7 split in two along dim 1: rows {0,1 | 4,5} and {2,3 | 6,7}.
  TensorDesc d{"t", DType::kUInt8, {2, 4}};
  std::vector<uint8_t> full = {0, 1, 2, 3, 4, 5, 6, 7}, part;
  client::CopyPart(d, full, 1, 2, 1, &part);
  EXPECT_EQ(part, (std::vector<uint8_t>{2, 3, 6, 7}));
  client::CopyPart(d, full, 0, 2, 1, &part);
  EXPECT_EQ(part, (std::vector<uint8_t>{4, 5, 6, 7}));
  client::StreamOptions o;
  o.parts = 3;
  EXPECT_EQ(client::PartsFor(d, o), 1);  // 2 rows are not divisible by 3
}

// A whole server in process: engine + DaemonServer + an in-process Receiver, with a token.
TEST(DaemonServer, InProcessPublicationWithBearerToken) {
  prometheus::Registry registry;
  engine::EngineOptions engine_options;
  engine_options.min_receivers = 1;
  auto metrics = metrics::EngineMetrics::Create(&registry);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  auto eng = engine::Engine::Create(engine_options, metrics->get());
  ASSERT_TRUE(eng.ok()) << eng.status();
  DaemonServerOptions options;
  options.listen = "127.0.0.1:0";
  options.service.auth_token = "s3cret";
  auto server = DaemonServer::Create(options, eng->get());
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = absl::StrCat("127.0.0.1:", (*server)->port());

  DaemonServerOptions open_options;
  open_options.listen = "0.0.0.0:0";
  EXPECT_EQ(DaemonServer::Create(open_options, eng->get()).status().code(),
            absl::StatusCode::kPermissionDenied);

  recv::ReceiverOptions recv_options;
  recv_options.target = target;
  recv_options.name = "inproc";
  recv_options.auth_token = "s3cret";
  recv_options.exit_after_versions = 1;
  auto receiver = recv::Receiver::Create(recv_options);
  ASSERT_TRUE(receiver.ok());
  absl::Status recv_status;
  std::thread recv_thread([&] { recv_status = (*receiver)->Run(); });

  client::ClientOptions client_options;
  client_options.target = target;
  auto anonymous = client::PublisherClient::Create(client_options);
  ASSERT_TRUE(anonymous.ok());
  EXPECT_EQ((*anonymous)->GetStatus().status().code(), absl::StatusCode::kUnauthenticated);
  client_options.auth_token = "s3cret";
  auto client = client::PublisherClient::Create(client_options);
  ASSERT_TRUE(client.ok());
  for (int i = 0; i < 500; ++i) {
    auto s = (*client)->GetStatus();
    ASSERT_TRUE(s.ok()) << s.status();
    if (s->receivers_size() == 1) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  synthetic::ConversionBatch batch;
  batch.megatron_name = "embedding.word_embeddings.weight";
  batch.tensors.push_back({"model.embed_tokens.weight", DType::kBFloat16, {64, 32}});
  pb::PublicationHeader header;
  header.set_version(1);
  header.set_recipe("bf16");
  auto report = (*client)->Publish(header, {batch}, client::SyntheticFiller(5), {});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
  recv_thread.join();
  EXPECT_TRUE(recv_status.ok()) << recv_status;
  auto model = (*receiver)->committed();
  ASSERT_NE(model, nullptr);
  std::vector<uint8_t> want(64 * 32 * 2);
  ASSERT_TRUE(synthetic::FillTensor(batch.tensors[0], 5, absl::MakeSpan(want)).ok());
  absl::Span<const uint8_t> got = model->TensorBytes("model.embed_tokens.weight");
  EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin(), want.end()));
  EXPECT_EQ((*receiver)->stats().checksum_mismatches, 0u);

  (*server)->Shutdown(absl::Now() + absl::Seconds(5));
}

// Waits for the next completion-queue event; false when it failed.
bool Await(grpc::CompletionQueue* cq) {
  void* tag = nullptr;
  bool ok = false;
  return cq->Next(&tag, &ok) && ok;
}

// Server reflection answers list_services with both wpub services (what grpcurl relies on).
TEST(DaemonServer, ReflectionListsTheServices) {
  auto eng = engine::Engine::Create({}, nullptr);
  ASSERT_TRUE(eng.ok()) << eng.status();
  DaemonServerOptions options;
  options.listen = "127.0.0.1:0";
  auto server = DaemonServer::Create(options, eng->get());
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(nullptr);
  ASSERT_TRUE(Await(&cq));
  // ServerReflectionRequest{list_services = ""}: field 7, length-delimited, empty.
  const std::string request("\x3a\x00", 2);
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  call->Write(request_buffer, nullptr);
  ASSERT_TRUE(Await(&cq));
  call->WritesDone(nullptr);
  ASSERT_TRUE(Await(&cq));
  grpc::ByteBuffer response;
  call->Read(&response, nullptr);
  ASSERT_TRUE(Await(&cq));
  grpc::Status status;
  call->Finish(&status, nullptr);
  Await(&cq);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& sl : slices) {
    bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  EXPECT_NE(bytes.find("wpub.v1.Publisher"), std::string::npos);
  EXPECT_NE(bytes.find("wpub.v1.Receivers"), std::string::npos);
  EXPECT_NE(bytes.find("grpc.health.v1.Health"), std::string::npos);
  (*server)->Shutdown(absl::Now() + absl::Seconds(5));
  cq.Shutdown();
  while (Await(&cq)) {
  }
}

}  // namespace
}  // namespace wpub::server
