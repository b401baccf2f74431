// Child-process harness, settings and scraping helpers for the daemon tests.
#include "tests/daemon/harness.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/common/status.h"

#ifndef WPUBD_PATH
#error "WPUBD_PATH must be defined by the build (the built wpubd binary)"
#endif
#ifndef WPUB_RECV_PATH
#error "WPUB_RECV_PATH must be defined by the build (the built wpub-recv binary)"
#endif

namespace wpub::testing {

std::string WpubdPath() {
  const char* env = getenv("WPUB_TEST_WPUBD");
  return env != nullptr && *env != '\0' ? env : WPUBD_PATH;
}

absl::StatusOr<std::unique_ptr<DaemonHarness>> DaemonHarness::Start(const HarnessOptions& options) {
  std::unique_ptr<DaemonHarness> h(new DaemonHarness());
  h->options_ = options;
  char tmpl[] = "/tmp/wpub-daemon-test-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  h->dir_ = tmpl;
  const std::string ready = h->dir_ + "/ready.json";
  std::vector<std::string> args = {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                                   absl::StrCat("--ready_file=", ready), "--log_level=debug"};
  args.insert(args.end(), options.daemon_flags.begin(), options.daemon_flags.end());
  if (const char* extra = getenv("WPUB_TEST_WPUBD_ARGS"); extra != nullptr) {
    for (absl::string_view a : absl::StrSplit(extra, ' ', absl::SkipEmpty())) {
      args.emplace_back(a);
    }
  }
  client::ClientOptions client_options;
  if (!options.auth_token_file.empty()) {
    args.push_back("--auth_token_file=" + options.auth_token_file);
    std::ifstream in(options.auth_token_file);
    std::getline(in, client_options.auth_token);
  }
  WPUB_ASSIGN_OR_RETURN(h->daemon_,
                        client::ChildProcess::Spawn({WpubdPath(), args, h->dir_ + "/wpubd.log"}));
  WPUB_ASSIGN_OR_RETURN(h->ports_,
                        client::WaitForReadyFile(ready, h->daemon_.get(), absl::Seconds(30)));
  h->target_ = absl::StrCat("127.0.0.1:", h->ports_.grpc_port);
  client_options.target = h->target_;
  WPUB_ASSIGN_OR_RETURN(h->client_, client::PublisherClient::Create(client_options));
  h->receivers_.resize(options.receivers);
  for (int i = 0; i < options.receivers; ++i) WPUB_RETURN_IF_ERROR(h->StartReceiver(i));
  WPUB_RETURN_IF_ERROR(h->WaitForReceivers(options.receivers));
  return h;
}

DaemonHarness::~DaemonHarness() {
  for (auto& r : receivers_) {
    if (r) r->Stop();
  }
  if (daemon_) daemon_->Stop(absl::Seconds(30));
  // WPUB_TEST_LOGS=1 prints the processes' logs of passing tests too.
  if (::testing::Test::HasFailure() || getenv("WPUB_TEST_LOGS") != nullptr) {
    std::cerr << "---- logs of " << dir_ << " ----\n" << ReadLog("wpubd");
    for (size_t i = 0; i < receivers_.size(); ++i) {
      std::cerr << ReadLog(absl::StrCat("recv-", i));
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::string DaemonHarness::recv_output(int i) const {
  return absl::StrCat(dir_, "/recv-", i, ".safetensors");
}

std::string DaemonHarness::ReadLog(const std::string& name) const {
  std::ifstream in(absl::StrCat(dir_, "/", name, ".log"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status DaemonHarness::StartReceiver(int i, const std::vector<std::string>& extra) {
  if (receivers_[i]) receivers_[i]->Stop();
  const std::string name = absl::StrCat("recv-", i);
  std::vector<std::string> args = {absl::StrCat("--target=", target_),
                                   absl::StrCat("--name=", name),
                                   absl::StrCat("--output=", recv_output(i))};
  if (!options_.auth_token_file.empty()) {
    args.push_back("--auth_token_file=" + options_.auth_token_file);
  }
  if (i < static_cast<int>(options_.recv_flags.size())) {
    args.insert(args.end(), options_.recv_flags[i].begin(), options_.recv_flags[i].end());
  }
  args.insert(args.end(), extra.begin(), extra.end());
  WPUB_ASSIGN_OR_RETURN(receivers_[i], client::ChildProcess::Spawn(
                                           {WPUB_RECV_PATH, args, dir_ + "/" + name + ".log"}));
  return absl::OkStatus();
}

absl::Status DaemonHarness::WaitForReceivers(int n, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    WPUB_ASSIGN_OR_RETURN(wpub::v1::GetStatusResponse s, client_->GetStatus());
    int connected = 0;
    for (const auto& r : s.receivers()) connected += r.state() != "left" ? 1 : 0;
    if (connected == n) return absl::OkStatus();
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("expected ", n, " receivers, daemon lists ", connected));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

absl::Status DaemonHarness::WaitForReceiversAt(uint64_t version, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    WPUB_ASSIGN_OR_RETURN(wpub::v1::GetStatusResponse s, client_->GetStatus());
    bool all = s.receivers_size() > 0;
    for (const auto& r : s.receivers()) all = all && r.last_committed_version() == version;
    if (all) return absl::OkStatus();
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("receivers not at v", version));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

absl::StatusOr<recv::SafetensorsFile> WaitForFileVersion(const std::string& path, uint64_t version,
                                                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<recv::SafetensorsFile> file = recv::ReadSafetensors(path);
    if (file.ok() && file->metadata["version"] == std::to_string(version)) return file;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(path, " never reached v", version, ": ",
                       file.ok() ? "v" + file->metadata["version"] : file.status().ToString()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

policy::PolicySettings TestSettings() {
  policy::PolicySettings s;
  s.recipe = policy::Recipe::kNvfp4;
  s.quantization.quant_algo = "NVFP4";
  s.quantization.quant_method = "modelopt";
  s.quantization.ignore_rules = {"lm_head", "model.layers.2.mlp.experts.1",
                                 "re:model\\.layers\\.\\d+\\.self_attn\\."};
  return s;
}

wpub::v1::PublicationHeader MakeHeader(const policy::PolicySettings& settings, uint64_t version,
                                       const std::string& recipe_override) {
  wpub::v1::PublicationHeader h;
  h.set_version(version);
  h.set_model_id("small-glm");
  h.set_recipe(recipe_override.empty() ? std::string(policy::RecipeName(settings.recipe))
                                       : recipe_override);
  nlohmann::json q = nlohmann::json::object();
  if (!settings.quantization.quant_algo.empty()) q["quant_algo"] = settings.quantization.quant_algo;
  if (!settings.quantization.quant_method.empty()) {
    q["quant_method"] = settings.quantization.quant_method;
  }
  q["ignore"] = settings.quantization.ignore_rules;
  h.set_quantization_config_json(q.dump());
  const policy::PrecisionExceptions& e = settings.exceptions;
  auto* pe = h.mutable_precision_exceptions();
  for (const auto& s : e.extra_high_precision_layers_megatron) {
    pe->add_extra_high_precision_layers_megatron(s);
  }
  pe->set_first_last_layers_bf16(e.first_last_layers_bf16);
  pe->set_num_layers(static_cast<uint32_t>(e.num_layers));
  pe->set_num_layers_at_start_in_bf16(static_cast<uint32_t>(e.num_layers_at_start_in_bf16));
  pe->set_num_layers_at_end_in_bf16(static_cast<uint32_t>(e.num_layers_at_end_in_bf16));
  return h;
}

absl::StatusOr<std::map<std::string, double>> ScrapeMetrics(int port) {
  httplib::Client http("127.0.0.1", port);
  http.set_connection_timeout(5);
  auto res = http.Get("/metrics");
  if (!res) return absl::UnavailableError(absl::StrCat("GET /metrics on port ", port, " failed"));
  if (res->status != 200) {
    return absl::UnavailableError(absl::StrCat("GET /metrics: HTTP ", res->status));
  }
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(res->body, '\n')) {
    if (line.empty() || line.front() == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    double value = 0;
    if (!absl::SimpleAtod(line.substr(space + 1), &value)) continue;
    out[std::string(line.substr(0, space))] = value;
  }
  return out;
}

absl::StatusOr<int> HealthCheck(const std::string& target, const std::string& service) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  // HealthCheckRequest{string service = 1}, encoded by hand (no generated health stubs).
  std::string request;
  if (!service.empty()) {
    request.push_back(0x0a);
    request.push_back(static_cast<char>(service.size()));  // services here are < 128 bytes
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request_buffer, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // HealthCheckResponse{ServingStatus status = 1}: 0x08 <varint>; empty = UNKNOWN (0).
  if (bytes.size() >= 2 && bytes[0] == 0x08) return static_cast<int>(bytes[1]);
  return 0;
}

}  // namespace wpub::testing
