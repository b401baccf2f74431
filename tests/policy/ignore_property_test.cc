// Randomized equivalence of the ignore-rule evaluators against a deliberately naive reference
// written here (the rule definition, verbatim): the literal snapshot and the ordered scan must
// agree with it on adversarial names and rules (empty rules, trailing and consecutive dots,
// `a.b` vs `a.bc`, case differences, multi-byte UTF-8). Fixed seeds: failures reproduce.
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/policy/ignore_rules.h"

namespace wpub::policy {
namespace {

// Python: name == rule or name.startswith(f"{rule}.") -- for literal rules;
// re.match(rule[3:], name) for regex rules. First match in list order.
std::optional<size_t> ReferenceFirstMatch(const std::vector<std::string>& rules,
                                          const std::string& name) {
  for (size_t i = 0; i < rules.size(); ++i) {
    const std::string& rule = rules[i];
    if (rule.rfind("re:", 0) == 0) {
      const std::regex re(rule.substr(3));
      if (std::regex_search(name, re, std::regex_constants::match_continuous)) return i;
      continue;
    }
    if (name == rule) return i;
    const std::string with_dot = rule + ".";
    if (name.size() >= with_dot.size() && name.substr(0, with_dot.size()) == with_dot) return i;
  }
  return std::nullopt;
}

class Generator {
 public:
  explicit Generator(uint64_t seed) : rng_(seed) {}

  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool Chance(int percent) { return Uniform(0, 99) < percent; }

  std::string Name() {
    static const std::vector<std::string> kSegments = {
        "a",   "b",       "bc", "A", "B",  "model", "layers",    "0",       "1",      "10",
        "mlp", "experts", "",   "é", "层", "x",     "gate_proj", "up_proj", "weight", "a.b"};
    std::string n;
    if (Chance(5)) n += ".";
    const int parts = Uniform(1, 6);
    for (int i = 0; i < parts; ++i) {
      if (i > 0) n += Chance(10) ? ".." : ".";
      n += kSegments[Uniform(0, static_cast<int>(kSegments.size()) - 1)];
    }
    if (Chance(5)) n += ".";
    return n;
  }

  // A rule related to `name` most of the time, so both outcomes are frequent.
  std::string RuleFor(const std::string& name) {
    switch (Uniform(0, 5)) {
      case 0:
        return name;
      case 1: {  // any prefix, cut at a dot or mid-segment (a.b vs a.bc), maybe empty
        return name.substr(0, Uniform(0, static_cast<int>(name.size())));
      }
      case 2: {  // the prefix before some dot, plus the dot (a trailing-dot rule)
        const size_t dot = name.find('.', Uniform(0, static_cast<int>(name.size())));
        return dot == std::string::npos ? name + "." : name.substr(0, dot + 1);
      }
      case 3: {  // case flip of one ASCII letter
        std::string r = name;
        for (char& c : r) {
          if (std::isalpha(static_cast<unsigned char>(c)) && Chance(50)) {
            c = std::isupper(static_cast<unsigned char>(c)) ? std::tolower(c) : std::toupper(c);
            break;
          }
        }
        return r;
      }
      case 4:
        return "";
      default:
        return Name();
    }
  }

  // A name that extends `rule` with or without a separating dot.
  std::string NameFrom(const std::string& rule) {
    switch (Uniform(0, 3)) {
      case 0:
        return rule;
      case 1:
        return rule + "." + Name();
      case 2:
        return rule + Name();
      default:
        return Name();
    }
  }

 private:
  std::mt19937_64 rng_;
};

TEST(PolicyIgnoreProperty, SnapshotEqualsOrderedScanEqualsReference) {
  Generator gen(0x5EED2026);
  constexpr int kLists = 25000;
  constexpr int kNamesPerList = 6;
  int64_t cases = 0;
  int64_t matched = 0;
  for (int l = 0; l < kLists; ++l) {
    std::vector<std::string> rules;
    const std::string anchor = gen.Name();
    const int n_rules = gen.Uniform(0, 8);
    for (int r = 0; r < n_rules; ++r) rules.push_back(gen.RuleFor(anchor));
    auto literal = LiteralRuleList::Create(rules);
    ASSERT_TRUE(literal.ok());
    const LiteralIgnoreSnapshot snapshot(*literal);
    auto scan = RegexIgnoreRules::Create(rules);
    ASSERT_TRUE(scan.ok());
    auto matcher = IgnoreMatcher::Create(rules);
    ASSERT_TRUE(matcher.ok());
    ASSERT_TRUE(matcher->uses_snapshot());
    for (int k = 0; k < kNamesPerList; ++k) {
      const std::string name = rules.empty() || gen.Chance(30)
                                   ? gen.NameFrom(anchor)
                                   : gen.NameFrom(rules[gen.Uniform(0, n_rules - 1)]);
      const std::optional<size_t> want = ReferenceFirstMatch(rules, name);
      ++cases;
      matched += want.has_value();
      ASSERT_EQ(snapshot.Matches(name), want.has_value())
          << "name '" << name << "' rules[" << rules.size() << "] first '"
          << (rules.empty() ? "" : rules[0]) << "'";
      ASSERT_EQ(scan->FirstMatch(name), want) << "name '" << name << "'";
      ASSERT_EQ(matcher->IsIgnored(name), want.has_value());
    }
  }
  EXPECT_GE(cases, 100000);
  // Both outcomes must be well represented, or the comparison proves little.
  EXPECT_GT(matched, cases / 10) << matched << " of " << cases;
  EXPECT_LT(matched, cases * 9 / 10) << matched << " of " << cases;
}

TEST(PolicyIgnoreProperty, RegexListsKeepFirstMatchOrder) {
  // Patterns on which RE2 and ECMAScript agree (no single '.' that could meet multi-byte text).
  const std::vector<std::string> kPatterns = {R"(re:a\.b)",
                                              R"(re:model\.layers\.[0-9]+\.mlp)",
                                              "re:.*experts",
                                              "re:A|a",
                                              R"(re:(a|b)\.)",
                                              "re:x$",
                                              "re:layers",
                                              R"(re:[0-9]+\.)",
                                              R"(re:\.)",
                                              "re:.*(gate|up)_proj",
                                              "re:"};
  Generator gen(0xF1257);
  int64_t cases = 0;
  int64_t matched = 0;
  for (int l = 0; l < 4000; ++l) {
    std::vector<std::string> rules;
    const std::string anchor = gen.Name();
    const int n_rules = gen.Uniform(1, 6);
    for (int r = 0; r < n_rules; ++r) {
      rules.push_back(gen.Chance(50) ? kPatterns[gen.Uniform(0, kPatterns.size() - 1)]
                                     : gen.RuleFor(anchor));
    }
    auto matcher = IgnoreMatcher::Create(rules);
    ASSERT_TRUE(matcher.ok()) << matcher.status();
    auto scan = RegexIgnoreRules::Create(rules);
    ASSERT_TRUE(scan.ok());
    const bool has_regex = std::any_of(rules.begin(), rules.end(), IsRegexRule);
    EXPECT_EQ(matcher->uses_snapshot(), !has_regex);
    for (int k = 0; k < 6; ++k) {
      const std::string name = gen.NameFrom(anchor);
      const std::optional<size_t> want = ReferenceFirstMatch(rules, name);
      ++cases;
      matched += want.has_value();
      ASSERT_EQ(scan->FirstMatch(name), want) << "name '" << name << "'";
      ASSERT_EQ(matcher->IsIgnored(name), want.has_value()) << "name '" << name << "'";
    }
  }
  EXPECT_GT(matched, cases / 10);
  EXPECT_LT(matched, cases * 9 / 10);
}

}  // namespace
}  // namespace wpub::policy
