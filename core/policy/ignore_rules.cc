// Ignore-rule evaluators (literal snapshot, ordered scan with RE2) and their LRU cache.
#include "core/policy/ignore_rules.h"

#include <utility>

#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "re2/re2.h"

namespace wpub::policy {
namespace {

bool LiteralRuleMatches(absl::string_view rule, absl::string_view name) {
  return name == rule ||
         (name.size() > rule.size() && absl::StartsWith(name, rule) && name[rule.size()] == '.');
}

// Python reads `{,n}` as a repeat {0,n}; RE2 (like Perl) reads it as literal text. Refuse it
// rather than match something else than the trainer would.
bool HasPythonOnlyRepeat(absl::string_view pattern) {
  for (size_t i = 0; i + 1 < pattern.size(); ++i) {
    if (pattern[i] == '\\') {
      ++i;
      continue;
    }
    if (pattern[i] != '{' || pattern[i + 1] != ',') continue;
    size_t j = i + 2;
    while (j < pattern.size() && absl::ascii_isdigit(static_cast<unsigned char>(pattern[j]))) ++j;
    if (j < pattern.size() && pattern[j] == '}') return true;
  }
  return false;
}

}  // namespace

bool IsRegexRule(absl::string_view rule) { return absl::StartsWith(rule, kRegexRulePrefix); }

absl::StatusOr<LiteralRuleList> LiteralRuleList::Create(std::vector<std::string> rules) {
  for (size_t i = 0; i < rules.size(); ++i) {
    if (IsRegexRule(rules[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("ignore rule [", i, "] \"", rules[i],
                       "\" is a regex rule; a literal snapshot cannot serve it (use the ordered "
                       "scan)"));
    }
  }
  return LiteralRuleList(std::move(rules));
}

LiteralIgnoreSnapshot::LiteralIgnoreSnapshot(const LiteralRuleList& rules)
    : rules_(rules.rules().begin(), rules.rules().end()), filter_(65536 / 64, 0) {
  for (const std::string& r : rules_) {
    const size_t bit = FilterBit(r);
    filter_[bit >> 6] |= uint64_t{1} << (bit & 63);
  }
}

bool LiteralIgnoreSnapshot::Matches(absl::string_view name) const {
  // n matches r iff n == r or n starts with r + "."; the candidates r are therefore n itself
  // and n cut before each of its dots: one backward pass over the bytes visits them all.
  const char* data = name.data();
  for (size_t len = name.size();; --len) {
    if (len == name.size() || data[len] == '.') {
      const absl::string_view prefix(data, len);
      if (MayContain(prefix) && rules_.contains(prefix)) return true;
    }
    if (len == 0) return false;
  }
}

RegexIgnoreRules::RegexIgnoreRules(std::vector<std::string> rules) : rules_(std::move(rules)) {}
RegexIgnoreRules::RegexIgnoreRules(RegexIgnoreRules&&) noexcept = default;
RegexIgnoreRules& RegexIgnoreRules::operator=(RegexIgnoreRules&&) noexcept = default;
RegexIgnoreRules::~RegexIgnoreRules() = default;

namespace {

// The bounds of a client's rule list (ignore_rules.h), checked by both evaluators' factories.
absl::Status CheckRuleBounds(const std::vector<std::string>& rules) {
  if (rules.size() > kMaxIgnoreRules) {
    return absl::InvalidArgumentError(
        absl::StrCat(rules.size(), " ignore rules exceed the limit of ", kMaxIgnoreRules));
  }
  size_t regex = 0;
  for (size_t i = 0; i < rules.size(); ++i) {
    if (rules[i].size() > kMaxIgnoreRuleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("ignore rule [", i, "] is ", rules[i].size(),
                                                     " bytes long; the limit is ",
                                                     kMaxIgnoreRuleBytes));
    }
    regex += IsRegexRule(rules[i]) ? 1 : 0;
  }
  if (regex > kMaxRegexIgnoreRules) {
    return absl::InvalidArgumentError(
        absl::StrCat(regex, " `re:` ignore rules exceed the limit of ", kMaxRegexIgnoreRules,
                     " (literal rules are not limited this way)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RegexIgnoreRules> RegexIgnoreRules::Create(std::vector<std::string> rules) {
  WPUB_RETURN_IF_ERROR(CheckRuleBounds(rules));
  RegexIgnoreRules out(std::move(rules));
  out.compiled_.resize(out.rules_.size());
  RE2::Options options;
  options.set_log_errors(false);
  // RE2's default budget is 8 MiB per pattern (program and lazily built DFA).
  options.set_max_mem(kRegexRuleMaxMem);
  for (size_t i = 0; i < out.rules_.size(); ++i) {
    const std::string& rule = out.rules_[i];
    if (!IsRegexRule(rule)) continue;
    const absl::string_view pattern = absl::string_view(rule).substr(kRegexRulePrefix.size());
    if (HasPythonOnlyRepeat(pattern)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ignore rule [", i, "] \"", rule,
          "\" uses a {,n} repeat, which Python and RE2 read differently; write {0,n}"));
    }
    auto re = std::make_unique<RE2>(re2::StringPiece(pattern.data(), pattern.size()), options);
    if (!re->ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ignore rule [", i, "] \"", rule, "\" does not compile: ", re->error()));
    }
    // The object and its program (RE2 keeps forward and reverse programs, ~16 B/instruction).
    out.compiled_bytes_ += sizeof(RE2) + 1024 + 2 * 16 * static_cast<size_t>(re->ProgramSize());
    out.compiled_[i] = std::move(re);
  }
  return out;
}

std::optional<size_t> RegexIgnoreRules::FirstMatch(absl::string_view name) const {
  const re2::StringPiece text(name.data(), name.size());
  for (size_t i = 0; i < rules_.size(); ++i) {
    if (const RE2* re = compiled_[i].get()) {
      // Python re.match: anchored at the start only, any suffix may follow.
      if (re->Match(text, 0, text.size(), RE2::ANCHOR_START, nullptr, 0)) return i;
    } else if (LiteralRuleMatches(rules_[i], name)) {
      return i;
    }
  }
  return std::nullopt;
}

IgnoreMatcher::IgnoreMatcher(std::vector<std::string> rules,
                             std::variant<LiteralIgnoreSnapshot, RegexIgnoreRules> impl)
    : rules_(std::move(rules)), impl_(std::move(impl)) {}

absl::StatusOr<IgnoreMatcher> IgnoreMatcher::Create(std::vector<std::string> rules) {
  WPUB_RETURN_IF_ERROR(CheckRuleBounds(rules));
  absl::StatusOr<LiteralRuleList> literal = LiteralRuleList::Create(rules);
  if (literal.ok()) {
    return IgnoreMatcher(std::move(rules), LiteralIgnoreSnapshot(*literal));
  }
  WPUB_ASSIGN_OR_RETURN(RegexIgnoreRules scan, RegexIgnoreRules::Create(rules));
  return IgnoreMatcher(std::move(rules), std::move(scan));
}

bool IgnoreMatcher::IsIgnored(absl::string_view name) const {
  return std::visit([name](const auto& impl) { return impl.Matches(name); }, impl_);
}

size_t IgnoreMatcher::footprint_bytes() const {
  // Each rule is held by the list and by the snapshot's set (or the scan's list).
  size_t bytes = sizeof(*this);
  for (const std::string& r : rules_) bytes += 2 * (sizeof(std::string) + r.size());
  if (const auto* scan = std::get_if<RegexIgnoreRules>(&impl_)) {
    bytes += scan->compiled_bytes();
  } else {
    bytes += 65536 / 8;  // the snapshot's filter
  }
  return bytes;
}

bool IgnoreMatcher::uses_snapshot() const {
  return std::holds_alternative<LiteralIgnoreSnapshot>(impl_);
}

size_t IgnoreSnapshotCache::KeyHash::operator()(const std::vector<std::string>& key) const {
  return absl::Hash<std::vector<std::string>>{}(key);
}

absl::StatusOr<std::unique_ptr<IgnoreSnapshotCache>> IgnoreSnapshotCache::Create(
    const Options& options) {
  if (options.capacity < 1) {
    return absl::InvalidArgumentError("IgnoreSnapshotCache capacity must be >= 1");
  }
  if (options.max_bytes < 1) {
    return absl::InvalidArgumentError("IgnoreSnapshotCache max_bytes must be >= 1");
  }
  return std::unique_ptr<IgnoreSnapshotCache>(
      new IgnoreSnapshotCache(options.capacity, options.max_bytes));
}

size_t IgnoreSnapshotCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}

size_t IgnoreSnapshotCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

absl::StatusOr<std::shared_ptr<const IgnoreMatcher>> IgnoreSnapshotCache::Get(
    absl::Span<const std::string> rules) {
  std::vector<std::string> key(rules.begin(), rules.end());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      hits_.fetch_add(1, std::memory_order_relaxed);
      return it->second->matcher;
    }
  }
  misses_.fetch_add(1, std::memory_order_relaxed);
  // Built without the lock: compiling regexes or hashing thousands of rules must not stall
  // other publications' lookups.
  WPUB_ASSIGN_OR_RETURN(IgnoreMatcher built, IgnoreMatcher::Create(key));
  auto matcher = std::make_shared<const IgnoreMatcher>(std::move(built));

  size_t entry_bytes = matcher->footprint_bytes();
  for (const std::string& r : key) entry_bytes += sizeof(std::string) + r.size();
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = index_.find(key); it != index_.end()) {
    // Another thread built the same list meanwhile; keep one copy.
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->matcher;
  }
  if (entry_bytes > max_bytes_) return matcher;  // used by this publication, not kept
  lru_.push_front(Entry{key, matcher, entry_bytes});
  index_.emplace(std::move(key), lru_.begin());
  bytes_ += entry_bytes;
  while (lru_.size() > capacity_ || bytes_ > max_bytes_) {
    bytes_ -= lru_.back().bytes;
    index_.erase(lru_.back().key);
    lru_.pop_back();
  }
  return matcher;
}

}  // namespace wpub::policy
