// ReceiverEndpoint: the HTTP routes (cpp-httplib) over a BucketReceiver, which owns the group,
// the GPUs and the receive path. Here: request bodies to arguments, results to SGLang's
// {"success", "message"} answers, /stats as JSON, and the server's start and ordered stop.
#include "clients/recv/nccl/receiver_endpoint.h"

#include <httplib.h>

#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "clients/recv/engine_listener.h"
#include "clients/recv/nccl/bucket_receiver.h"
#include "core/common/json_bounds.h"
#include "core/nccl/nccl_comm.h"
#include "nlohmann/json.hpp"

namespace wpub::recv::nccl {
namespace {

using json = nlohmann::json;

// A request body as JSON, or a discarded value when it is not JSON or exceeds the bounds of
// client JSON (core/common/json_bounds.h): the callers answer "not JSON" either way.
json ParseBody(const std::string& body) {
  constexpr JsonBounds kBounds{recv::kEngineMaxRequestBytes, kClientJsonBounds.max_depth};
  if (!CheckJsonBounds(body, "body", kBounds).ok()) return json(json::value_t::discarded);
  return json::parse(body, nullptr, /*allow_exceptions=*/false);
}

void Reply(httplib::Response& res, const absl::Status& s, const std::string& ok_message) {
  res.status = s.ok() ? 200 : 400;
  res.set_content(
      json({{"success", s.ok()}, {"message", s.ok() ? ok_message : std::string(s.message())}})
          .dump(),
      "application/json");
}

void Reply(httplib::Response& res, const absl::StatusOr<std::string>& message) {
  Reply(res, message.status(), message.ok() ? *message : std::string());
}

json StatsJson(const std::map<std::string, ReceiverVersionStats>& stats) {
  json j = json::object();
  for (const auto& [v, st] : stats) {
    j[v] = {{"buckets", st.buckets},
            {"bytes", st.bytes},
            {"checksums", st.checksums},
            {"decode_seconds", st.decode_seconds},
            {"wait_seconds", st.wait_seconds},
            {"receive_seconds", st.receive_seconds},
            {"receive_device_seconds", st.receive_device_seconds},
            {"last_verified_ns", st.last_verified_ns},
            {"patched_buckets", st.patched_buckets},
            {"patch_bytes", st.patch_bytes}};
  }
  return j;
}

}  // namespace

class ReceiverEndpoint::Impl {
 public:
  Impl(const ReceiverEndpointOptions& options, std::unique_ptr<BucketReceiver> receiver,
       std::function<void(const std::string&)> on_version)
      : options_(options), receiver_(std::move(receiver)), on_version_(std::move(on_version)) {}

  // Handlers blocked in a receive whose publisher is gone, or waiting for their turn, end
  // first; then the server stops (it joins its handlers); then the group and the GPUs' resources
  // go with the receiver.
  ~Impl() {
    receiver_->Stop();
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }

  absl::Status Start() {
    AddRoutes();
    absl::StatusOr<int> port =
        recv::ServeEngineHttp(server_, options_.host, options_.port, "receiver endpoint", &thread_);
    if (!port.ok()) return port.status();
    port_ = *port;
    return absl::OkStatus();
  }

  int port() const { return port_; }
  std::map<std::string, ReceiverVersionStats> stats() const { return receiver_->stats(); }

 private:
  void AddRoutes() {
    using Request = httplib::Request;
    using Response = httplib::Response;
    server_.Get("/health", [](const Request&, Response& res) {
      res.set_content(R"({"ok": true})", "application/json");
    });
    server_.Post("/init_weights_update_group",
                 [this](const Request& q, Response& r) { Join(q, r); });
    server_.Post("/destroy_weights_update_group", [this](const Request&, Response& r) {
      receiver_->Destroy();
      Reply(r, absl::OkStatus(), "destroyed");
    });
    server_.Post("/update_weights_from_distributed",
                 [this](const Request& q, Response& r) { Reply(r, receiver_->Update(q.body)); });
    server_.Post("/receive_raw", [this](const Request& q, Response& r) { ReceiveRaw(q, r); });
    server_.Post("/update_weight_version", [this](const Request& q, Response& r) {
      json j = ParseBody(q.body);
      const std::string v = j.is_object() ? j.value("new_version", std::string()) : "";
      if (on_version_) on_version_(v);
      {
        std::lock_guard lock(version_mu_);
        version_ = v;
      }
      Reply(r, absl::OkStatus(), "version " + v);
    });
    if (options_.keep_weights) {
      // As SGLang's /get_model_info reports it: the version the kept weights hold, as the last
      // /update_weight_version announced it (a process that restarted holds none, so the
      // publisher's engine watch finds it behind and gives it a whole version).
      server_.Get("/get_model_info", [this](const Request&, Response& r) {
        std::lock_guard lock(version_mu_);
        json j = {{"model_path", "wpub-recv"}};
        j["weight_version"] = version_.empty() ? json(nullptr) : json(version_);
        r.set_content(j.dump(), "application/json");
      });
    }
    // The engine's own account of every version it received (ReceiverVersionStats), for
    // tests and benchmarks that compare both sides of a publication.
    server_.Get("/stats", [this](const Request&, Response& r) {
      r.set_content(StatsJson(receiver_->stats()).dump(), "application/json");
    });
    auto ok = [](const Request&, Response& r) { Reply(r, absl::OkStatus(), "ok"); };
    for (const char* path : {"/pause_generation", "/begin_weight_update", "/end_weight_update",
                             "/continue_generation"}) {
      server_.Post(path, ok);
    }
    server_.Post("/flush_cache", ok);  // SGLang serves it for GET and POST
    server_.Get("/flush_cache", ok);
    // What a publisher's probe reads (SGLang's /server_info answers its release as "version"):
    // this engine stages every bucket under the weight_version its request carries and serves
    // nothing before the version is announced, so it asks for the version on every bucket; an
    // engine that keeps its weights takes format 3 bucket patches against them.
    server_.Get("/server_info", [keep = options_.keep_weights](const Request&, Response& r) {
      r.set_content(keep ? R"({"version": "wpub-recv", "wpub_bucket_versions": true, )"
                           R"("wpub_bucket_patches": [3]})"
                         : R"({"version": "wpub-recv", "wpub_bucket_versions": true})",
                    "application/json");
    });
    // As FastAPI answers a GET of a POST route: a probe finds each route served.
    for (const char* path :
         {"/init_weights_update_group", "/destroy_weights_update_group",
          "/update_weights_from_distributed", "/update_weight_version", "/pause_generation",
          "/begin_weight_update", "/end_weight_update", "/continue_generation"}) {
      recv::AnswerOtherMethods(server_, path);
    }
  }

  // POST /init_weights_update_group {master_address, master_port, group_name, rank_offset,
  // world_size}, SGLang's fields and defaults.
  void Join(const httplib::Request& q, httplib::Response& r) {
    json j = ParseBody(q.body);
    if (!j.is_object()) return Reply(r, absl::InvalidArgumentError("body is not JSON"), "");
    GroupMemberOptions o;
    o.master_address = j.value("master_address", std::string("127.0.0.1"));
    o.master_port = j.value("master_port", 0);
    o.group_name = j.value("group_name", std::string());
    const int rank_offset = j.value("rank_offset", 1);
    o.world_size = j.value("world_size", 2);
    const std::string group = o.group_name;
    if (absl::Status s = receiver_->Join(std::move(o), rank_offset); !s.ok()) {
      return Reply(r, s, "");
    }
    Reply(r, absl::OkStatus(),
          absl::StrCat("joined ", group, " as ranks ", rank_offset, "..",
                       rank_offset + static_cast<int>(receiver_->ranks()) - 1));
  }

  // POST /receive_raw {"nbytes": n, "count": c}: c broadcasts of n bytes from rank 0 back to
  // back, no decoding and no checksum: the group's transfer limit, for benchmarks that compare a
  // publication with a plain broadcast of its bytes through the same group.
  void ReceiveRaw(const httplib::Request& q, httplib::Response& r) {
    json j = ParseBody(q.body);
    if (!j.is_object() || !j.contains("nbytes") || !j["nbytes"].is_number_unsigned() ||
        (j.contains("count") && !j["count"].is_number_unsigned())) {
      return Reply(r, absl::InvalidArgumentError("nbytes and count must be unsigned integers"), "");
    }
    const uint64_t n = j["nbytes"].get<uint64_t>();
    const uint64_t count = j.value("count", uint64_t{1});
    if (n == 0 || count == 0 || count > (uint64_t{1} << 20)) {
      return Reply(r, absl::InvalidArgumentError("nbytes must be > 0 and count in [1, 2^20]"), "");
    }
    Reply(r, receiver_->ReceiveRaw(n, count));
  }

  const ReceiverEndpointOptions options_;
  const std::unique_ptr<BucketReceiver> receiver_;
  const std::function<void(const std::string&)> on_version_;
  std::mutex version_mu_;
  std::string version_;  // guarded by version_mu_: the last /update_weight_version
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
};

absl::StatusOr<std::unique_ptr<ReceiverEndpoint>> ReceiverEndpoint::Start(
    const ReceiverEndpointOptions& options, Callbacks callbacks) {
  if (absl::Status s = wpub::nccl::CheckCtas(options.nccl_ctas, "receiver endpoint: nccl_ctas");
      !s.ok()) {
    return s;
  }
  absl::StatusOr<std::unique_ptr<BucketReceiver>> receiver =
      BucketReceiver::Create(options, std::move(callbacks.on_bucket));
  if (!receiver.ok()) return receiver.status();
  auto impl =
      std::make_unique<Impl>(options, *std::move(receiver), std::move(callbacks.on_version));
  if (absl::Status s = impl->Start(); !s.ok()) return s;
  return std::unique_ptr<ReceiverEndpoint>(new ReceiverEndpoint(std::move(impl)));
}

ReceiverEndpoint::ReceiverEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ReceiverEndpoint::~ReceiverEndpoint() = default;
int ReceiverEndpoint::port() const { return impl_->port(); }
std::map<std::string, ReceiverVersionStats> ReceiverEndpoint::stats() const {
  return impl_->stats();
}

}  // namespace wpub::recv::nccl
