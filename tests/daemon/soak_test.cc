// Allocator soak with real processes: many publications through one wpubd and one wpub-recv;
// the daemon's RSS over the last publications must stay within a bound of its RSS over early
// ones (after the first two, which fill the daemon's caches and pools). With glibc's default
// arenas (8 per core) every RPC thread's arena keeps its own freed pages and RSS keeps
// growing (+20 MiB over this test's 100 publications on 2 cores, 24 -> 97 MB over 1,000 on a
// larger host); wpubd bounds the arenas (--malloc_arena_max=2) and fixes glibc's mmap threshold
// (--malloc_mmap_threshold=1M: the adaptive one let RSS move by up to 14 MiB over 100
// publications even with two arenas), and RSS stays flat.
// WPUB_SOAK_PUBLICATIONS, WPUB_SOAK_ARENA_MAX and WPUB_SOAK_TRACE_EVERY override the count,
// the setting and the trace interval for measurements (bench/results/hardening.md).
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/daemon/harness.h"
#include "tests/daemon/proc_status.h"

namespace wpub::testing {
namespace {

namespace pb = ::wpub::v1;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int kWindow = 10;  // publications averaged per RSS figure (RSS moves by a few MiB)
constexpr int kWarmUp = 2;   // publications that fill caches and pools before "early"

int EnvInt(const char* name, int fallback) {
  int value = fallback;
  const char* env = std::getenv(name);
  return env != nullptr && absl::SimpleAtoi(env, &value) ? value : fallback;
}

double MeanMiB(const std::vector<int64_t>& rss, size_t begin, size_t end) {
  return std::accumulate(rss.begin() + begin, rss.begin() + end, 0.0) / (end - begin) / kMiB;
}

TEST(AllocatorSoak, RssStaysFlatOverManyPublications) {
  const int publications = std::max(4 * kWindow, EnvInt("WPUB_SOAK_PUBLICATIONS", 100));
  const int trace_every = EnvInt("WPUB_SOAK_TRACE_EVERY", publications);
  HarnessOptions options;
  options.receivers = 1;
  options.daemon_flags = {"--log_level=warn"};
  if (const char* arenas = std::getenv("WPUB_SOAK_ARENA_MAX"); arenas != nullptr) {
    options.daemon_flags.push_back(absl::StrCat("--malloc_arena_max=", arenas));
  }
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();
  // A few MB of weights per publication, one bucket: 0.1-0.2 s each on 2 cores.
  synthetic::ModelShape shape = synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm, 2);
  shape.num_experts = 8;
  shape.hidden_size = 256;
  shape.moe_intermediate_size = 128;
  auto model = synthetic::SyntheticModel::Create(shape);
  ASSERT_TRUE(model.ok()) << model.status();
  const pid_t pid = (*h)->daemon().pid();

  const int64_t start = ProcStatusBytes(pid, "VmRSS");
  std::vector<int64_t> rss;  // after each publication
  for (int v = 1; v <= publications; ++v) {
    auto report = (*h)->client().Publish(MakeHeader(TestSettings(), v), model->batches(),
                                         client::SyntheticFiller(v), {});
    ASSERT_TRUE(report.ok()) << "v" << v << ": " << report.status();
    ASSERT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
    rss.push_back(ProcStatusBytes(pid, "VmRSS"));
    ASSERT_GT(rss.back(), 0);
    if (v % trace_every == 0)
      std::cout << "soak: v" << v << " RSS " << rss.back() / kMiB << " MiB\n";
  }
  const double early = MeanMiB(rss, kWarmUp, kWarmUp + kWindow);
  const double last = MeanMiB(rss, rss.size() - kWindow, rss.size());
  std::cout << "soak: " << publications << " publications, RSS start " << start / kMiB << " MiB, v"
            << kWarmUp + 1 << "-v" << kWarmUp + kWindow << " " << early << " MiB, last " << kWindow
            << " " << last << " MiB, end " << rss.back() / kMiB << " MiB (peak "
            << ProcStatusBytes(pid, "VmHWM") / kMiB << " MiB)\n";
  EXPECT_LT(last - early, 10.0) << "RSS grew from " << early << " to " << last << " MiB";
}

}  // namespace
}  // namespace wpub::testing
