// Bounds on client-controlled ignore rules: a list of 20,000 regexes once cost ~43 MB per
// cached snapshot (16 cached); the count, rule length and compiled size are bounded and the
// snapshot cache is bounded by bytes as well as entries.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/policy/ignore_rules.h"

namespace wpub::policy {
namespace {

std::vector<std::string> RegexRules(size_t n, const std::string& tag = "") {
  std::vector<std::string> rules;
  for (size_t i = 0; i < n; ++i) {
    rules.push_back(absl::StrCat("re:model\\.layers\\.", i, tag, "\\.mlp\\.experts\\.[0-9]+"));
  }
  return rules;
}

TEST(PolicyIgnoreBoundsTest, TooManyRegexRulesAreRefusedNamingTheLimit) {
  auto ok = IgnoreMatcher::Create(RegexRules(kMaxRegexIgnoreRules));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(ok->IsIgnored("model.layers.7.mlp.experts.3.up_proj.weight"));
  auto many = IgnoreMatcher::Create(RegexRules(20000));
  ASSERT_FALSE(many.ok());
  EXPECT_EQ(many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(many.status().message().find("20000 `re:` ignore rules"), std::string::npos)
      << many.status();
}

TEST(PolicyIgnoreBoundsTest, LiteralRulesAreBoundedByCountAndLength) {
  std::vector<std::string> literal(kMaxIgnoreRules + 1, "lm_head");
  auto many = IgnoreMatcher::Create(literal);
  ASSERT_FALSE(many.ok());
  EXPECT_NE(many.status().message().find("exceed the limit"), std::string::npos);
  auto longer = IgnoreMatcher::Create({"lm_head", std::string(kMaxIgnoreRuleBytes + 1, 'a')});
  ASSERT_FALSE(longer.ok());
  EXPECT_NE(longer.status().message().find("ignore rule [1]"), std::string::npos);
  EXPECT_TRUE(IgnoreMatcher::Create(std::vector<std::string>(1888, "model.mtp")).ok());
}

TEST(PolicyIgnoreBoundsTest, ARegexBeyondItsMemoryBudgetDoesNotCompile) {
  // A counted repeat of a class expands into a program far beyond the per-rule budget.
  auto huge = IgnoreMatcher::Create({"re:((a|b|c|d)[0-9a-f]{1000}){1000}"});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("does not compile"), std::string::npos);
}

TEST(PolicyIgnoreBoundsTest, TheSnapshotCacheIsBoundedByBytes) {
  auto probe = IgnoreMatcher::Create(RegexRules(512, "a"));
  ASSERT_TRUE(probe.ok());
  const size_t one = probe->footprint_bytes();
  EXPECT_GT(one, 512u * 1024u);  // each compiled regex costs at least its object and program
  IgnoreSnapshotCache::Options options;
  options.capacity = 16;
  options.max_bytes = 3 * one;
  auto cache = IgnoreSnapshotCache::Create(options);
  ASSERT_TRUE(cache.ok());
  for (int i = 0; i < 10; ++i) {
    auto m = (*cache)->Get(RegexRules(512, absl::StrCat("x", i)));
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_LE((*cache)->bytes(), options.max_bytes);
  }
  EXPECT_GE((*cache)->size(), 1u);
  EXPECT_LE((*cache)->size(), 3u);
  // The most recent list is cached (a hit), the first was evicted (a miss).
  const uint64_t misses = (*cache)->misses();
  ASSERT_TRUE((*cache)->Get(RegexRules(512, "x9")).ok());
  EXPECT_EQ((*cache)->misses(), misses);
  ASSERT_TRUE((*cache)->Get(RegexRules(512, "x0")).ok());
  EXPECT_EQ((*cache)->misses(), misses + 1);
  // A matcher larger than the whole budget is served but not kept.
  options.max_bytes = one / 2;
  auto small = IgnoreSnapshotCache::Create(options);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE((*small)->Get(RegexRules(512, "a")).ok());
  EXPECT_EQ((*small)->size(), 0u);
  EXPECT_EQ((*small)->bytes(), 0u);
  EXPECT_FALSE(IgnoreSnapshotCache::Create({.capacity = 1, .max_bytes = 0}).ok());
}

}  // namespace
}  // namespace wpub::policy
