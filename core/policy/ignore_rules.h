// Ignore rules (`quantization_config.ignore` + `exclude_modules`) and how a name is tested
// against them. Two evaluators with identical results:
//  - LiteralIgnoreSnapshot: a hash set plus a dotted-ancestor walk, O(name depth). It can only
//    be built from a LiteralRuleList, which can only be made from a list proven to hold no
//    `re:` rule, so the regex path can never be skipped by mistake.
//  - RegexIgnoreRules: the ordered scan (literal and `re:` rules, first match wins), RE2
//    anchored at the start of the name (Python `re.match` semantics: a prefix match).
// IgnoreMatcher holds exactly one of them, chosen from the rule list. IgnoreSnapshotCache keeps
// the most recently used matchers keyed by rule-list content, bounded by count and by their
// estimated memory.
//
// Rule lists come from clients, so their cost is bounded: at most kMaxIgnoreRules rules of at
// most kMaxIgnoreRuleBytes bytes each, of which at most kMaxRegexIgnoreRules are `re:` rules
// (each compiled with a memory budget of kRegexRuleMaxMem bytes). INVALID_ARGUMENT beyond.
//
// Literal rule r matches name n iff n == r or n starts with r + ".". Names and rules are byte
// strings (UTF-8 in practice); matching is case-sensitive.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace re2 {
class RE2;
}

namespace wpub::policy {

inline constexpr size_t kMaxIgnoreRules = 65536;
inline constexpr size_t kMaxIgnoreRuleBytes = 1024;
inline constexpr size_t kMaxRegexIgnoreRules = 1024;
inline constexpr int64_t kRegexRuleMaxMem = int64_t{1} << 20;

// The prefix that marks a regex rule.
inline constexpr absl::string_view kRegexRulePrefix = "re:";

// True iff `rule` starts with "re:".
bool IsRegexRule(absl::string_view rule);

// A rule list with no `re:` rule. The only way to get one is Create, which checks that.
class LiteralRuleList {
 public:
  // INVALID_ARGUMENT naming the first `re:` rule and its index if there is one.
  static absl::StatusOr<LiteralRuleList> Create(std::vector<std::string> rules);

  const std::vector<std::string>& rules() const { return rules_; }

 private:
  explicit LiteralRuleList(std::vector<std::string> rules) : rules_(std::move(rules)) {}
  std::vector<std::string> rules_;
};

// Hash-set snapshot of a literal rule list. Immutable; thread-safe for concurrent Matches.
class LiteralIgnoreSnapshot {
 public:
  explicit LiteralIgnoreSnapshot(const LiteralRuleList& rules);

  // Looks up `name`, then each dotted ancestor (`a.b.c` -> `a.b` -> `a`; every '.' position,
  // so consecutive and trailing dots behave exactly as the literal rule definition says).
  bool Matches(absl::string_view name) const;

  // Distinct rules in the set.
  size_t size() const { return rules_.size(); }

 private:
  // Conservative pre-filter: bit (len % 256, last byte) is set for every rule, so a candidate
  // prefix whose bit is clear cannot be a rule and is not hashed. Most ancestors of a weight
  // name are rejected here (8 KiB, stays in L1).
  static size_t FilterBit(absl::string_view s) {
    return (s.size() & 0xFF) << 8 | (s.empty() ? 0 : static_cast<unsigned char>(s.back()));
  }
  bool MayContain(absl::string_view s) const {
    const size_t bit = FilterBit(s);
    return (filter_[bit >> 6] >> (bit & 63)) & 1;
  }

  absl::flat_hash_set<std::string> rules_;
  std::vector<uint64_t> filter_;  // 65536 bits
};

// Ordered scan over any rule list. Immutable after Create; thread-safe for concurrent calls.
class RegexIgnoreRules {
 public:
  // Compiles every `re:` rule up front (a bad pattern fails the whole list even if an earlier
  // rule would have matched every name). INVALID_ARGUMENT quoting the rule text and RE2's
  // reason when a pattern does not compile (including Python-only syntax RE2 cannot express,
  // such as backreferences and lookaround), and for a `{,n}` repeat, which RE2 would read as
  // literal text. RE2's \d \w \s \b are ASCII-only (Python's are Unicode).
  static absl::StatusOr<RegexIgnoreRules> Create(std::vector<std::string> rules);

  RegexIgnoreRules(RegexIgnoreRules&&) noexcept;
  RegexIgnoreRules& operator=(RegexIgnoreRules&&) noexcept;
  ~RegexIgnoreRules();

  // Index of the first rule (in list order) that matches `name`; nullopt if none does.
  std::optional<size_t> FirstMatch(absl::string_view name) const;
  bool Matches(absl::string_view name) const { return FirstMatch(name).has_value(); }

  const std::vector<std::string>& rules() const { return rules_; }
  // Estimated memory of the compiled rules (RE2 objects and programs), in bytes.
  size_t compiled_bytes() const { return compiled_bytes_; }

 private:
  explicit RegexIgnoreRules(std::vector<std::string> rules);
  size_t compiled_bytes_ = 0;
  std::vector<std::string> rules_;
  // compiled_[i] is set iff rules_[i] is a `re:` rule.
  std::vector<std::unique_ptr<re2::RE2>> compiled_;
};

// The ignore decision for one rule list: the literal snapshot when the list has no `re:` rule,
// the ordered scan otherwise. Immutable; thread-safe for concurrent calls.
class IgnoreMatcher {
 public:
  // Picks the evaluator from the content of `rules`. INVALID_ARGUMENT for a bad `re:` pattern
  // and for a list beyond the bounds above (naming the bound and the count or the rule).
  static absl::StatusOr<IgnoreMatcher> Create(std::vector<std::string> rules);

  bool IsIgnored(absl::string_view name) const;
  // True when the literal snapshot serves this list.
  bool uses_snapshot() const;
  // The rule list, in order.
  const std::vector<std::string>& rules() const { return rules_; }
  // Estimated memory this matcher holds (rules, hash set or compiled regexes), in bytes.
  size_t footprint_bytes() const;

 private:
  IgnoreMatcher(std::vector<std::string> rules,
                std::variant<LiteralIgnoreSnapshot, RegexIgnoreRules> impl);
  std::vector<std::string> rules_;
  std::variant<LiteralIgnoreSnapshot, RegexIgnoreRules> impl_;
};

// LRU cache of IgnoreMatchers keyed by rule-list content (the ordered list of strings), so one
// publication of 96,000 names against 1,888 rules builds its snapshot once, and the next
// publication with the same rules builds none. Thread-safe: Get may be called concurrently.
// The lock is not held while a matcher is built; two threads missing on the same list may both
// build it (both count a miss) and one result is kept.
class IgnoreSnapshotCache {
 public:
  struct Options {
    size_t capacity = 16;  // entries; must be >= 1
    // Sum of the cached matchers' footprint_bytes (and of their keys); least recently used
    // entries are evicted beyond it, and a matcher larger than it alone is returned without
    // being cached. Must be >= 1.
    size_t max_bytes = size_t{64} << 20;
  };

  static absl::StatusOr<std::unique_ptr<IgnoreSnapshotCache>> Create(const Options& options);

  // The matcher for `rules`, built on a miss. A failed build (bad regex) is returned and not
  // cached, and counts as a miss. The returned matcher stays valid after eviction.
  absl::StatusOr<std::shared_ptr<const IgnoreMatcher>> Get(absl::Span<const std::string> rules);

  // Monotonic counters for metrics (wpub_ignore_snapshot_cache_{hits,misses}_total).
  uint64_t hits() const { return hits_.load(std::memory_order_relaxed); }
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }
  size_t size() const;
  size_t capacity() const { return capacity_; }
  // Estimated bytes held by the cached entries (<= Options::max_bytes).
  size_t bytes() const;

 private:
  IgnoreSnapshotCache(size_t capacity, size_t max_bytes)
      : capacity_(capacity), max_bytes_(max_bytes) {}

  struct KeyHash {
    size_t operator()(const std::vector<std::string>& key) const;
  };
  struct Entry {
    std::vector<std::string> key;
    std::shared_ptr<const IgnoreMatcher> matcher;
    size_t bytes = 0;  // key and matcher
  };

  const size_t capacity_;
  const size_t max_bytes_;
  mutable std::mutex mu_;
  size_t bytes_ = 0;      // guarded by mu_
  std::list<Entry> lru_;  // front = most recently used; guarded by mu_
  std::unordered_map<std::vector<std::string>, std::list<Entry>::iterator, KeyHash>
      index_;  // guarded by mu_
  std::atomic<uint64_t> hits_{0};
  std::atomic<uint64_t> misses_{0};
};

}  // namespace wpub::policy
