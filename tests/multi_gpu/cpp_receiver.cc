// A C++ receiving engine for the multi-GPU tests: SGLang's weight-update HTTP routes over
// nccl::GroupMember (the NCCL data path a C++ receiver such as wpub-recv uses), so wpub is
// tested end to end without Python or SGLang. Each flattened bucket is received into device
// memory, copied back and checksummed (core/engine/checksum.h); GET /stats returns
// {"<version>": {"buckets": n, "bytes": b, "checksums": [...]}}.
// Usage: multi_gpu_cpp_receiver <port> <gpu>
#include <cuda_runtime_api.h>
#include <httplib.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "core/common/tensor.h"
#include "core/engine/checksum.h"
#include "core/nccl/group_member.h"
#include "nlohmann/json.hpp"

namespace {

using json = nlohmann::json;

void Reply(httplib::Response& res, bool ok, const std::string& message) {
  res.status = ok ? 200 : 400;
  res.set_content(json({{"success", ok}, {"message", message}}).dump(), "application/json");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s port gpu\n", argv[0]);
    return 2;
  }
  const int port = std::atoi(argv[1]);
  const int gpu = std::atoi(argv[2]);
  if (cudaSetDevice(gpu) != cudaSuccess) return 3;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  std::mutex mu;  // one weight update at a time, as SGLang
  std::unique_ptr<wpub::nccl::GroupMember> member;
  void* buf = nullptr;
  uint64_t buf_bytes = 0;
  json stats = json::object();

  httplib::Server srv;
  srv.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"ok": true})", "application/json");
  });
  srv.Get("/stats", [&](const httplib::Request&, httplib::Response& res) {
    std::lock_guard lock(mu);
    res.set_content(stats.dump(), "application/json");
  });
  srv.Post("/init_weights_update_group", [&](const httplib::Request& req, httplib::Response& res) {
    std::lock_guard lock(mu);
    json j = json::parse(req.body, nullptr, false);
    wpub::nccl::GroupMemberOptions o;
    o.master_address = j.value("master_address", std::string("127.0.0.1"));
    o.master_port = j.value("master_port", 0);
    o.group_name = j.value("group_name", std::string());
    o.rank = j.value("rank_offset", 1);
    o.world_size = j.value("world_size", 2);
    o.device = gpu;
    o.timeout = absl::Seconds(60);
    auto m = wpub::nccl::GroupMember::Join(o);
    if (!m.ok()) return Reply(res, false, m.status().ToString());
    member = std::move(*m);
    Reply(res, true, "joined " + o.group_name);
  });
  srv.Post("/destroy_weights_update_group", [&](const httplib::Request&, httplib::Response& res) {
    std::lock_guard lock(mu);
    member.reset();
    Reply(res, true, "destroyed");
  });
  srv.Post("/update_weights_from_distributed",
           [&](const httplib::Request& req, httplib::Response& res) {
             std::lock_guard lock(mu);
             if (!member) return Reply(res, false, "no weight-update group");
             json j = json::parse(req.body, nullptr, false);
             uint64_t total = 0;
             for (size_t i = 0; i < j["dtypes"].size(); ++i) {
               auto dt = wpub::ParseDType(j["dtypes"][i].get<std::string>());
               if (!dt.ok()) return Reply(res, false, dt.status().ToString());
               uint64_t n = static_cast<uint64_t>(wpub::DTypeSize(*dt));
               for (const auto& d : j["shapes"][i]) n *= d.get<uint64_t>();
               total += n;
             }
             if (total > buf_bytes) {
               cudaFree(buf);
               if (cudaMalloc(&buf, total) != cudaSuccess) return Reply(res, false, "cudaMalloc");
               buf_bytes = total;
             }
             if (absl::Status s = member->Receive(buf, total, stream); !s.ok()) {
               return Reply(res, false, s.ToString());
             }
             std::vector<uint8_t> host(total);
             if (cudaStreamSynchronize(stream) != cudaSuccess ||
                 cudaMemcpy(host.data(), buf, total, cudaMemcpyDeviceToHost) != cudaSuccess) {
               return Reply(res, false, "receive failed on the device");
             }
             const std::string v = j.value("weight_version", std::string("?"));
             json& e = stats[v];
             if (e.is_null()) e = {{"buckets", 0}, {"bytes", 0}, {"checksums", json::array()}};
             e["buckets"] = e["buckets"].get<uint64_t>() + 1;
             e["bytes"] = e["bytes"].get<uint64_t>() + total;
             e["checksums"].push_back(wpub::engine::Checksum(host.data(), total));
             Reply(res, true, "received");
           });
  for (const char* path :
       {"/pause_generation", "/flush_cache", "/begin_weight_update", "/update_weight_version",
        "/end_weight_update", "/continue_generation"}) {
    srv.Post(path, [](const httplib::Request&, httplib::Response& res) { Reply(res, true, "ok"); });
    srv.Get(path, [](const httplib::Request&, httplib::Response& res) { Reply(res, true, "ok"); });
  }
  std::printf("cpp receiver on :%d gpu %d\n", port, gpu);
  std::fflush(stdout);
  srv.listen("127.0.0.1", port);
  return 0;
}
