// The SGLang driver's HTTP round trips against a local engine stand-in (httplib, SGLang's
// lifecycle and update routes answering at once): per publication, the wall clock of the
// lifecycle calls at its end (version, end, continue: what a publication waits for after its
// last bucket) and of a whole publication's requests (pause, flush, begin, one update per
// bucket, version, end, continue), for an engine server that closes a connection after
// httplib's default 5 requests and for one that keeps it (what wpub::recv::nccl::ReceiverEndpoint
// does). A program, not a test. Usage: driver_bench [--publications 200] [--buckets 17] [--lanes 3]
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/rollout/sglang_driver.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  double median_us, p90_us, max_us;
};

Stats Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[us.size() * 9 / 10], us.back()};
}

int Run(size_t keep_alive_max, int publications, int buckets, int lanes) {
  httplib::Server server;
  server.set_tcp_nodelay(true);
  server.set_keep_alive_max_count(keep_alive_max);
  const auto ok = [](const httplib::Request&, httplib::Response& r) {
    r.set_content(R"({"success": true, "message": "ok"})", "application/json");
  };
  for (const char* path : {"/pause_generation", "/flush_cache", "/begin_weight_update",
                           "/update_weights_from_distributed", "/update_weight_version",
                           "/end_weight_update", "/continue_generation"}) {
    server.Post(path, ok);
    server.Get(path, ok);
  }
  const int port = server.bind_to_any_port("127.0.0.1");
  if (port <= 0) {
    std::fprintf(stderr, "cannot bind a local port\n");
    return 1;
  }
  std::thread listener([&] { server.listen_after_bind(); });
  while (!server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));

  wpub::rollout::SglangDriverOptions o;
  o.engines.push_back({"http://127.0.0.1:" + std::to_string(port), 1});
  o.master_port = 29500;  // never contacted: no engine joins a group here
  o.requests_in_flight = lanes;
  auto driver = wpub::rollout::SglangDriver::Create(o);
  if (!driver.ok()) {
    std::fprintf(stderr, "%s\n", std::string(driver.status().message()).c_str());
    server.stop();
    listener.join();
    return 1;
  }
  wpub::transport::BucketManifest bucket;
  bucket.tensors.push_back({"w", wpub::DType::kUInt8, {1024}, 0, 1024});
  bucket.nbytes = 1024;
  std::vector<double> lifecycle, whole;
  for (int p = 0; p < publications + 5; ++p) {  // the first 5: warm-up
    const auto t0 = Clock::now();
    (*driver)->BeginPublication(p + 1, /*lifecycle_calls=*/true);
    for (int b = 0; b < buckets; ++b) {
      bucket.index = b;
      (*driver)->PostBucket(bucket);
    }
    if (!(*driver)->WaitIdle(absl::Now() + absl::Seconds(10)).ok()) return 1;
    const auto t1 = Clock::now();
    (*driver)->EndPublication();
    if (!(*driver)->WaitIdle(absl::Now() + absl::Seconds(10)).ok()) return 1;
    const auto t2 = Clock::now();
    if (p < 5) continue;
    lifecycle.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    whole.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
  }
  driver->reset();
  server.stop();
  listener.join();
  const Stats l = Summarize(lifecycle), w = Summarize(whole);
  std::printf(
      "engine keep-alive %7zu requests/connection, %d lanes: end of publication (3 calls) median "
      "%.0f us p90 %.0f max %.0f; whole publication (%d requests) median %.0f us p90 %.0f\n",
      keep_alive_max, lanes, l.median_us, l.p90_us, l.max_us, buckets + 6, w.median_us, w.p90_us);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int publications = 200, buckets = 17, lanes = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--publications") {
      publications = v;
    } else if (k == "--buckets") {
      buckets = v;
    } else if (k == "--lanes") {
      lanes = v;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (publications < 1 || buckets < 0 || lanes < 1) return 2;
  for (const size_t keep : {size_t{5}, size_t{1} << 20}) {
    if (int rc = Run(keep, publications, buckets, lanes); rc != 0) return rc;
  }
  return 0;
}
