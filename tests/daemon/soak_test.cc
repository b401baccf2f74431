// Allocator soak with real processes: many small publications through one wpubd and one
// wpub-recv; the daemon's RSS after the last publication must stay within a bound of its RSS
// after an early one (glibc's default arenas grew it about 4x over 1,000 publications; wpubd
// bounds them with --malloc_arena_max). WPUB_SOAK_PUBLICATIONS and WPUB_SOAK_ARENA_MAX
// override the count and the setting for measurements (bench/results/hardening.md).
#include <cstdlib>
#include <iostream>

#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/daemon/harness.h"
#include "tests/daemon/proc_status.h"

namespace wpub::testing {
namespace {

namespace pb = ::wpub::v1;

constexpr int64_t kMiB = int64_t{1} << 20;

int EnvInt(const char* name, int fallback) {
  int value = fallback;
  const char* env = std::getenv(name);
  return env != nullptr && absl::SimpleAtoi(env, &value) ? value : fallback;
}

TEST(AllocatorSoak, RssStaysFlatOverManyPublications) {
  const int publications = EnvInt("WPUB_SOAK_PUBLICATIONS", 300);
  const int early = std::min(30, publications / 4);
  HarnessOptions options;
  options.receivers = 1;
  options.daemon_flags = {"--bucket_bytes=65536", "--log_level=warn"};
  if (const char* arenas = std::getenv("WPUB_SOAK_ARENA_MAX"); arenas != nullptr) {
    options.daemon_flags.push_back(absl::StrCat("--malloc_arena_max=", arenas));
  }
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();
  auto model = synthetic::SyntheticModel::Create(SmallGlmShape());
  ASSERT_TRUE(model.ok()) << model.status();
  const pid_t pid = (*h)->daemon().pid();

  const int64_t start = ProcStatusBytes(pid, "VmRSS");
  int64_t at_early = 0;
  for (int v = 1; v <= publications; ++v) {
    auto report = (*h)->client().Publish(MakeHeader(TestSettings(), v), model->batches(),
                                         client::SyntheticFiller(v), {});
    ASSERT_TRUE(report.ok()) << "v" << v << ": " << report.status();
    ASSERT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
    if (v == early) at_early = ProcStatusBytes(pid, "VmRSS");
  }
  const int64_t end = ProcStatusBytes(pid, "VmRSS");
  std::cout << "soak: " << publications << " publications, RSS start " << start / kMiB
            << " MiB, after v" << early << " " << at_early / kMiB << " MiB, end " << end / kMiB
            << " MiB (peak " << ProcStatusBytes(pid, "VmHWM") / kMiB << " MiB)\n";
  ASSERT_GT(at_early, 0);
  EXPECT_LT(end - at_early, 16 * kMiB)
      << "RSS grew from " << at_early / kMiB << " to " << end / kMiB << " MiB";
}

}  // namespace
}  // namespace wpub::testing
