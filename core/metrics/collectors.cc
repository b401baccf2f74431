// ProcessCollector (/proc/self/stat, /proc/stat's btime, /proc/self/fd, RLIMIT_NOFILE) and
// StatusCollector (engine::EngineStatus).
#include "core/metrics/collectors.h"

#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace wpub::metrics {
namespace {

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

void Add(prometheus::MetricFamily& f, double value,
         std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (f.type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
}

// /proc/self/stat's fields after the command name (field 3 onwards), or empty.
std::vector<std::string> StatFields() {
  std::ifstream in("/proc/self/stat");
  std::string line;
  if (!std::getline(in, line)) return {};
  const size_t close = line.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos || close + 2 > line.size()) return {};
  return absl::StrSplit(line.substr(close + 2), ' ', absl::SkipEmpty());
}

double BootTimeSeconds() {
  std::ifstream in("/proc/stat");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("btime ", 0) == 0) return std::stod(line.substr(6));
  }
  return 0;
}

}  // namespace

std::vector<prometheus::MetricFamily> ProcessCollector::Collect() const {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> out;
  const std::vector<std::string> f = StatFields();
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  // Fields 14 utime, 15 stime, 22 starttime, 23 vsize, 24 rss; f[0] is field 3.
  if (f.size() > 21 && ticks > 0) {
    auto cpu = Family("process_cpu_seconds_total", "User and system CPU time spent in seconds.",
                      MetricType::Counter);
    Add(cpu, (std::stod(f[11]) + std::stod(f[12])) / ticks);
    out.push_back(std::move(cpu));
    auto start =
        Family("process_start_time_seconds",
               "Start time of the process since unix epoch in seconds.", MetricType::Gauge);
    Add(start, BootTimeSeconds() + std::stod(f[19]) / ticks);
    out.push_back(std::move(start));
    auto vsize =
        Family("process_virtual_memory_bytes", "Virtual memory size in bytes.", MetricType::Gauge);
    Add(vsize, std::stod(f[20]));
    out.push_back(std::move(vsize));
    auto rss = Family("process_resident_memory_bytes", "Resident memory size in bytes.",
                      MetricType::Gauge);
    Add(rss, std::stod(f[21]) * page);
    out.push_back(std::move(rss));
  }
  std::error_code ec;
  double fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++fds;
  }
  auto open = Family("process_open_fds", "Number of open file descriptors.", MetricType::Gauge);
  Add(open, fds);
  out.push_back(std::move(open));
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    auto max =
        Family("process_max_fds", "Maximum number of open file descriptors.", MetricType::Gauge);
    Add(max, static_cast<double>(lim.rlim_cur));
    out.push_back(std::move(max));
  }
  return out;
}

void StatusCollector::Detach() {
  std::lock_guard lock(mu_);
  status_ = nullptr;
}

std::vector<prometheus::MetricFamily> StatusCollector::Collect() const {
  using prometheus::MetricType;
  engine::EngineStatus s;
  {
    std::lock_guard lock(mu_);
    if (!status_) return {};
    s = status_();
  }
  std::vector<prometheus::MetricFamily> out;
  auto in_flight =
      Family("wpub_publication_in_flight", "1 while a publication is open or transferring, else 0",
             MetricType::Gauge);
  auto version = Family("wpub_publication_in_flight_version",
                        "The version of the publication in flight (0: none)", MetricType::Gauge);
  auto age =
      Family("wpub_publication_in_flight_age_seconds",
             "Seconds since the publication in flight was opened (0: none)", MetricType::Gauge);
  auto bytes = Family("wpub_publication_in_flight_bytes",
                      "Bytes of the publication in flight so far: ingested from the trainer, "
                      "sent in buckets",
                      MetricType::Gauge);
  const bool active = s.active.has_value();
  Add(in_flight, active ? 1 : 0);
  Add(version, active ? static_cast<double>(s.active->version) : 0);
  Add(age, active ? absl::ToDoubleSeconds(absl::Now() - s.active->opened_at) : 0);
  Add(bytes, active ? static_cast<double>(s.active->bytes_ingested) : 0, {{"stage", "ingested"}});
  Add(bytes, active ? static_cast<double>(s.active->bytes_sent) : 0, {{"stage", "sent"}});
  for (auto* f : {&in_flight, &version, &age, &bytes}) out.push_back(std::move(*f));

  std::map<std::string, const transport::ReceiverInfo*> by_name;
  for (const transport::ReceiverInfo& r : s.receivers) by_name.emplace(r.name, &r);
  auto last =
      Family("wpub_receiver_last_committed_version",
             "The last version each receiver (engine) was told to commit", MetricType::Gauge);
  auto state =
      Family("wpub_receiver_state", "Each receiver's (engine's) state: 1 on its current state",
             MetricType::Gauge);
  auto held = Family("wpub_receiver_held_version",
                     "The version each receiver (engine) holds whole, as the daemon knows it "
                     "(0: none or unknown)",
                     MetricType::Gauge);
  auto behind = Family("wpub_receiver_versions_behind",
                       "How many versions each receiver (engine) is behind the committed one "
                       "(committed - held; 0 when it holds it; a dirty engine counts as holding "
                       "none)",
                       MetricType::Gauge);
  size_t listed = 0;
  for (const auto& [name, r] : by_name) {
    if (listed++ == kMaxReceiverSeries) break;
    Add(last, static_cast<double>(r->last_committed_version), {{"receiver", name}});
    const uint64_t holds = r->state == transport::ReceiverState::kDirty ? 0 : r->held_version;
    Add(held, static_cast<double>(holds), {{"receiver", name}});
    Add(behind, holds < s.committed_version ? static_cast<double>(s.committed_version - holds) : 0,
        {{"receiver", name}});
    for (transport::ReceiverState st :
         {transport::ReceiverState::kIdle, transport::ReceiverState::kReceiving,
          transport::ReceiverState::kStaged, transport::ReceiverState::kFailed,
          transport::ReceiverState::kLeft, transport::ReceiverState::kDirty}) {
      Add(state, r->state == st ? 1 : 0,
          {{"receiver", name}, {"state", transport::ReceiverStateName(st)}});
    }
  }
  auto unlisted =
      Family("wpub_receivers_unlisted",
             "Receivers beyond the per-receiver series bound (64), not listed", MetricType::Gauge);
  Add(unlisted, by_name.size() > kMaxReceiverSeries
                    ? static_cast<double>(by_name.size() - kMaxReceiverSeries)
                    : 0);
  out.push_back(std::move(last));
  out.push_back(std::move(state));
  out.push_back(std::move(unlisted));
  out.push_back(std::move(held));
  out.push_back(std::move(behind));

  auto retained_bytes = Family("wpub_retained_bytes",
                               "Bytes of the retained copy of the committed version, by where it "
                               "lives (--retain)",
                               MetricType::Gauge);
  auto retained_version = Family(
      "wpub_retained_version", "The version the retained copy holds (0: none)", MetricType::Gauge);
  Add(retained_bytes, static_cast<double>(s.retained.bytes),
      {{"where", transport::RetainWhereName(s.retained.where)}});
  Add(retained_version, static_cast<double>(s.retained.version));
  auto retained_held = Family("wpub_retained_held_bytes",
                              "Memory the retained copy holds now, by where it lives: for device "
                              "and pinned up to two versions' worth (the retained one and the one "
                              "being staged) plus the replay's bounce buffers",
                              MetricType::Gauge);
  Add(retained_held, static_cast<double>(s.retained.held_bytes),
      {{"where", transport::RetainWhereName(s.retained.where)}});
  auto backend_held = Family("wpub_backend_held_bytes",
                             "Memory the backend keeps between publications (the GPU backend's "
                             "staging buffers, scratch and bounce buffers; 0 after "
                             "--release_gpu_memory or a publication's release_gpu_memory "
                             "freed them)",
                             MetricType::Gauge);
  Add(backend_held, static_cast<double>(s.backend_held_bytes));
  out.push_back(std::move(backend_held));
  out.push_back(std::move(retained_bytes));
  out.push_back(std::move(retained_version));
  out.push_back(std::move(retained_held));
  return out;
}

}  // namespace wpub::metrics
