// LogEscape, and a client-controlled string with a newline through a real wpubd: the daemon's
// log shows it escaped on one line and no forged line appears.
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "server/common/log_escape.h"
#include "tests/daemon/harness.h"

namespace wpub::testing {
namespace {

using server::LogEscape;

TEST(LogEscape, KeepsOrdinaryNamesAndEscapesControlCharacters) {
  EXPECT_EQ(LogEscape("model.layers.0.mlp.experts.7.gate_proj.weight"),
            "model.layers.0.mlp.experts.7.gate_proj.weight");
  EXPECT_EQ(LogEscape("cannot listen on 'x': \"y\""), "cannot listen on 'x': \"y\"");
  EXPECT_EQ(LogEscape("a\nb"), "a\\nb");
  EXPECT_EQ(LogEscape("a\rb\tc"), "a\\rb\\tc");
  EXPECT_EQ(LogEscape("\x1b[31mred"), "\\x1b[31mred");
  EXPECT_EQ(LogEscape(std::string("nul\0x", 5)), "nul\\x00x");
  EXPECT_EQ(LogEscape("back\\slash"), "back\\\\slash");
  EXPECT_EQ(LogEscape("\xff"), "\\xff");
}

TEST(LogEscape, NewlineInAModelIdDoesNotForgeALogLine) {
  HarnessOptions options;
  options.receivers = 1;
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();
  auto model = synthetic::SyntheticModel::Create(
      synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm, 2));
  ASSERT_TRUE(model.ok()) << model.status();
  constexpr char kForged[] = "2030-01-01T00:00:00.000 critical [wpubd] FORGED";
  wpub::v1::PublicationHeader header = MakeHeader(TestSettings(), 1);
  header.set_model_id(absl::StrCat("m\n", kForged));
  auto report = (*h)->client().Publish(header, model->batches(), client::SyntheticFiller(1), {});
  ASSERT_TRUE(report.ok()) << report.status();
  (*h)->daemon().Stop(absl::Seconds(30));
  const std::string log = (*h)->ReadLog("wpubd");
  int escaped = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    EXPECT_FALSE(absl::StartsWith(line, kForged)) << "forged line: " << line;
    if (absl::StrContains(line, absl::StrCat("m\\n", kForged))) ++escaped;
  }
  EXPECT_GE(escaped, 1) << log;
}

}  // namespace
}  // namespace wpub::testing
