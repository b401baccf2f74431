// Ignore-rule semantics (literal and regex), the type-level guarantee that the literal snapshot
// never serves a list with `re:` rules, and the LRU snapshot cache.
#include "core/policy/ignore_rules.h"

#include <thread>
#include <type_traits>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/policy/test_util.h"

namespace wpub::policy {
namespace {

using testing::HasSubstr;

// The literal fast path is only reachable through a LiteralRuleList, and a LiteralRuleList only
// through its checking factory.
static_assert(!std::is_constructible_v<LiteralRuleList, std::vector<std::string>>);
static_assert(!std::is_constructible_v<LiteralIgnoreSnapshot, std::vector<std::string>>);
static_assert(!std::is_constructible_v<LiteralIgnoreSnapshot, absl::Span<const std::string>>);
static_assert(std::is_constructible_v<LiteralIgnoreSnapshot, const LiteralRuleList&>);
static_assert(!std::is_default_constructible_v<IgnoreMatcher>);

TEST(PolicyIgnore, LiteralRuleListRefusesRegexRules) {
  auto list = LiteralRuleList::Create({"lm_head", "model.layers.0", "re:.*gate"});
  ASSERT_FALSE(list.ok());
  EXPECT_TRUE(HasSubstr(list.status(), "[2] \"re:.*gate\"")) << list.status();
  // "re" without the colon, or "re:" not at the start, is literal.
  EXPECT_TRUE(LiteralRuleList::Create({"re", "rex:a", " re:a", "RE:a"}).ok());
}

TEST(PolicyIgnore, LiteralRuleMatchesWholeNameOrDottedPrefix) {
  auto m = IgnoreMatcher::Create(
      {"lm_head", "model.layers.3.mlp.shared_experts", "model.layers.1.self_attn"});
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->uses_snapshot());
  EXPECT_TRUE(m->IsIgnored("lm_head"));
  EXPECT_TRUE(m->IsIgnored("lm_head.weight"));
  EXPECT_FALSE(m->IsIgnored("lm_head_weight"));
  EXPECT_FALSE(m->IsIgnored("model.lm_head.weight"));  // rules are prefixes, not substrings
  EXPECT_TRUE(m->IsIgnored("model.layers.3.mlp.shared_experts.gate_proj.weight"));
  EXPECT_FALSE(m->IsIgnored("model.layers.3.mlp.shared_experts_gate.weight"));
  EXPECT_FALSE(m->IsIgnored("model.layers.3.mlp.experts.0.gate_proj.weight"));
  EXPECT_TRUE(m->IsIgnored("model.layers.1.self_attn.q_proj.weight"));
  EXPECT_FALSE(m->IsIgnored("model.layers.11.self_attn.q_proj.weight"));  // a.b vs a.bc
  EXPECT_FALSE(m->IsIgnored("model.layers.1"));
  EXPECT_FALSE(m->IsIgnored("Model.layers.1.self_attn.q_proj.weight"));  // case-sensitive
}

TEST(PolicyIgnore, EdgeRulesEmptyTrailingAndConsecutiveDots) {
  for (const auto& rules : {std::vector<std::string>{""}, std::vector<std::string>{"a."},
                            std::vector<std::string>{"a..b"}}) {
    auto snap = IgnoreMatcher::Create(rules);
    auto scan = RegexIgnoreRules::Create(rules);
    ASSERT_TRUE(snap.ok() && scan.ok());
    for (const char* n : {"", ".", "a", "a.", "a..", "a.b", "a..b", "a..b.c", ".a", "a...b"}) {
      EXPECT_EQ(snap->IsIgnored(n), scan->Matches(n))
          << "rule '" << rules[0] << "' name '" << n << "'";
    }
  }
  // The empty rule matches the empty name and names starting with a dot, nothing else.
  auto m = IgnoreMatcher::Create({""});
  EXPECT_TRUE(m->IsIgnored(""));
  EXPECT_TRUE(m->IsIgnored(".x"));
  EXPECT_FALSE(m->IsIgnored("x"));
  // A trailing-dot rule matches names with a double dot after it.
  m = IgnoreMatcher::Create({"a."});
  EXPECT_TRUE(m->IsIgnored("a."));
  EXPECT_TRUE(m->IsIgnored("a..b"));
  EXPECT_FALSE(m->IsIgnored("a.b"));
}

TEST(PolicyIgnore, RegexRulesAreAnchoredAtTheStartLikePythonReMatch) {
  auto m = IgnoreMatcher::Create({R"(re:model\.layers\.\d+\.mlp\.gate)"});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->uses_snapshot());
  EXPECT_TRUE(m->IsIgnored("model.layers.12.mlp.gate.weight"));       // prefix match suffices
  EXPECT_TRUE(m->IsIgnored("model.layers.12.mlp.gate_proj.weight"));  // no implicit dot boundary
  EXPECT_FALSE(m->IsIgnored("x.model.layers.12.mlp.gate.weight"));    // not a search
  m = IgnoreMatcher::Create({"re:.*shared_expert"});
  EXPECT_TRUE(m->IsIgnored("model.layers.3.mlp.shared_experts.up_proj.weight"));
  m = IgnoreMatcher::Create({"re:lm_head$"});
  EXPECT_TRUE(m->IsIgnored("lm_head"));
  EXPECT_FALSE(m->IsIgnored("lm_head.weight"));
}

TEST(PolicyIgnore, OrderedScanReportsTheFirstMatchingRule) {
  auto scan = RegexIgnoreRules::Create({"model.layers.0", R"(re:model\.layers\.\d+\.self_attn)",
                                        "model.layers.5.self_attn", "re:model", "lm_head"});
  ASSERT_TRUE(scan.ok());
  EXPECT_EQ(scan->FirstMatch("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(scan->FirstMatch("model.layers.5.self_attn.q_proj.weight"), 1u);
  EXPECT_EQ(scan->FirstMatch("model.layers.5.mlp.gate.weight"), 3u);
  EXPECT_EQ(scan->FirstMatch("lm_head.weight"), 4u);
  EXPECT_EQ(scan->FirstMatch("embed.weight"), std::nullopt);
  // A literal list through the scan behaves as through the snapshot.
  auto lit = RegexIgnoreRules::Create({"a.b", "a"});
  EXPECT_EQ(lit->FirstMatch("a.b.c"), 0u);
  EXPECT_EQ(lit->FirstMatch("a.bc"), 1u);
}

TEST(PolicyIgnore, InvalidRegexIsReportedWithTheRuleText) {
  // Even when an earlier literal would have matched every name: the list is rejected as a whole.
  for (const std::string bad : {"re:model.layers.(", "re:(?<=a)b", R"(re:(a)\1)", "re:[z-a]"}) {
    auto m = IgnoreMatcher::Create({"model", "lm_head", bad});
    ASSERT_FALSE(m.ok()) << bad;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(HasSubstr(m.status(), absl::StrCat("[2] \"", bad, "\""))) << m.status();
  }
}

TEST(PolicyIgnore, PatternsPythonAndRe2ReadDifferentlyAreRefused) {
  // Python: "a{,2}b" is a repeat; RE2: literal text. Refused with the rule quoted.
  auto m = IgnoreMatcher::Create({"re:model\\.layers\\.1{,2}\\."});
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(HasSubstr(m.status(), "{0,n}")) << m.status();
  EXPECT_TRUE(HasSubstr(m.status(), "re:model\\.layers\\.1{,2}\\.")) << m.status();
  // An escaped brace is literal in both, and {0,2} / {2,} are read alike.
  EXPECT_TRUE(IgnoreMatcher::Create({"re:a\\{,2}", "re:a{0,2}b", "re:a{2,}"}).ok());
  // Python-only syntax RE2 cannot parse is an error too, never skipped.
  EXPECT_FALSE(IgnoreMatcher::Create({"re:lm_head\\Z"}).ok());
  EXPECT_FALSE(IgnoreMatcher::Create({"re:(?=model)"}).ok());
}

TEST(PolicyIgnore, UnicodeAndCaseAreComparedByteForByte) {
  auto m = IgnoreMatcher::Create({"模型.层", "Model.Layers"});
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->IsIgnored("模型.层.0.weight"));
  EXPECT_FALSE(m->IsIgnored("模型.层0.weight"));
  EXPECT_TRUE(m->IsIgnored("Model.Layers.0"));
  EXPECT_FALSE(m->IsIgnored("model.layers.0"));
  auto re = IgnoreMatcher::Create({"re:模.\\.层"});
  ASSERT_TRUE(re.ok()) << re.status();
  EXPECT_TRUE(re->IsIgnored("模型.层.0"));  // '.' matches one code point, as in Python
}

std::vector<std::string> NumberedRules(int i) {
  return {absl::StrCat("model.layers.", i, ".self_attn"), "lm_head"};
}

TEST(PolicyIgnoreCache, SeventeenthDistinctListEvictsTheLeastRecentlyUsed) {
  auto cache = IgnoreSnapshotCache::Create({});
  ASSERT_TRUE(cache.ok());
  IgnoreSnapshotCache& c = **cache;
  EXPECT_EQ(c.capacity(), 16u);
  std::vector<std::shared_ptr<const IgnoreMatcher>> first(16);
  for (int i = 0; i < 16; ++i) {
    auto m = c.Get(NumberedRules(i));
    ASSERT_TRUE(m.ok());
    first[i] = *m;
  }
  EXPECT_EQ(c.misses(), 16u);
  EXPECT_EQ(c.hits(), 0u);
  EXPECT_EQ(c.size(), 16u);
  // Touch list 0 (a hit returns the very same matcher), making list 1 the least recently used.
  auto again = c.Get(NumberedRules(0));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), first[0].get());
  EXPECT_EQ(c.hits(), 1u);
  // The 17th distinct list evicts list 1.
  ASSERT_TRUE(c.Get(NumberedRules(16)).ok());
  EXPECT_EQ(c.misses(), 17u);
  EXPECT_EQ(c.size(), 16u);
  // Lists 0 and 2..16 are still cached.
  for (int i : {0, 2, 3, 15, 16}) {
    auto m = c.Get(NumberedRules(i));
    ASSERT_TRUE(m.ok());
    if (i < 16) {
      EXPECT_EQ(m->get(), first[i].get()) << i;
    }
  }
  EXPECT_EQ(c.hits(), 6u);
  EXPECT_EQ(c.misses(), 17u);
  // List 1 was evicted: a miss that builds a new matcher (the old one stays valid for holders).
  auto rebuilt = c.Get(NumberedRules(1));
  ASSERT_TRUE(rebuilt.ok());
  EXPECT_NE(rebuilt->get(), first[1].get());
  EXPECT_TRUE(first[1]->IsIgnored("model.layers.1.self_attn.o_proj.weight"));
  EXPECT_EQ(c.misses(), 18u);
  EXPECT_EQ(c.size(), 16u);
  // Re-inserting list 1 evicted the then least recently used list: 4 (0, 2, 3 were touched).
  auto four = c.Get(NumberedRules(4));
  ASSERT_TRUE(four.ok());
  EXPECT_NE(four->get(), first[4].get());
  EXPECT_EQ(c.misses(), 19u);
}

TEST(PolicyIgnoreCache, KeyedByContentInOrder) {
  auto cache = IgnoreSnapshotCache::Create({.capacity = 4});
  ASSERT_TRUE(cache.ok());
  IgnoreSnapshotCache& c = **cache;
  std::vector<std::string> a = {"x", "y"};
  std::vector<std::string> a_copy = a;
  std::vector<std::string> reversed = {"y", "x"};
  auto m1 = c.Get(a);
  auto m2 = c.Get(a_copy);
  ASSERT_TRUE(m1.ok() && m2.ok());
  EXPECT_EQ(m1->get(), m2->get());
  ASSERT_TRUE(c.Get(reversed).ok());
  ASSERT_TRUE(c.Get({}).ok());
  EXPECT_EQ(c.hits(), 1u);
  EXPECT_EQ(c.misses(), 3u);
  // A list that fails to build is an error, counts as a miss and is not cached.
  EXPECT_FALSE(c.Get({"re:("}).ok());
  EXPECT_FALSE(c.Get({"re:("}).ok());
  EXPECT_EQ(c.misses(), 5u);
  EXPECT_EQ(c.size(), 3u);
  EXPECT_FALSE(IgnoreSnapshotCache::Create({.capacity = 0}).ok());
}

TEST(PolicyIgnoreCache, ConcurrentGetsAreCountedAndBounded) {
  auto cache = IgnoreSnapshotCache::Create({});
  ASSERT_TRUE(cache.ok());
  IgnoreSnapshotCache& c = **cache;
  constexpr int kThreads = 4;
  constexpr int kGets = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&c, t] {
      for (int i = 0; i < kGets; ++i) {
        auto m = c.Get(NumberedRules((i * 7 + t) % 20));
        ASSERT_TRUE(m.ok());
        EXPECT_TRUE((*m)->IsIgnored("lm_head.weight"));
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(c.hits() + c.misses(), static_cast<uint64_t>(kThreads * kGets));
  EXPECT_GE(c.misses(), 20u);
  EXPECT_LE(c.size(), 16u);
}

}  // namespace
}  // namespace wpub::policy
