#include "core/group/decision_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace wpub::group {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxReasonBytes = 1024;

std::string Errno() { return std::strerror(errno); }

std::string Line(const RoundDecision& d) {
  json j = {{"group", d.group},
            {"version", d.version},
            {"round", d.round},
            {"commit", d.commit},
            {"code", static_cast<int>(d.code)},
            {"reason", d.reason}};
  return j.dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace) + "\n";
}

std::optional<RoundDecision> Parse(const std::string& line) {
  json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  RoundDecision d;
  try {
    d.group = j.at("group").get<std::string>();
    d.version = j.at("version").get<uint64_t>();
    d.round = j.at("round").get<uint64_t>();
    d.commit = j.at("commit").get<bool>();
    d.code = static_cast<absl::StatusCode>(j.at("code").get<int>());
    d.reason = j.at("reason").get<std::string>();
  } catch (const json::exception&) {
    return std::nullopt;
  }
  return d;
}

absl::Status WriteAll(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::InternalError(absl::StrCat("cannot write ", path, ": ", Errno()));
    done += static_cast<size_t>(n);
  }
  if (::fdatasync(fd) != 0) {
    return absl::InternalError(absl::StrCat("cannot flush ", path, ": ", Errno()));
  }
  return absl::OkStatus();
}

}  // namespace

DecisionLog::DecisionLog() = default;

DecisionLog::DecisionLog(std::string path, size_t capacity)
    : path_(std::move(path)), capacity_(capacity == 0 ? 1 : capacity) {}

DecisionLog::~DecisionLog() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::unique_ptr<DecisionLog>> DecisionLog::Open(const std::string& path,
                                                               size_t capacity) {
  if (path.empty()) return absl::InvalidArgumentError("the decision log needs a path");
  std::unique_ptr<DecisionLog> log(new DecisionLog(path, capacity));
  {
    std::ifstream in(path);
    std::string line;
    while (in && std::getline(in, line)) {
      ++log->lines_;
      if (std::optional<RoundDecision> d = Parse(line)) log->KeepLocked(*std::move(d));
    }
  }
  log->fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log->fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open the group decision log ", path, ": ", Errno()));
  }
  std::lock_guard lock(log->mu_);
  // A torn last line (no newline) would join the next record: start from a clean file.
  if (absl::Status s = log->CompactLocked(); !s.ok()) {
    return absl::FailedPreconditionError(s.message());
  }
  return log;
}

void DecisionLog::KeepLocked(RoundDecision d) {
  if (d.reason.size() > kMaxReasonBytes) d.reason.resize(kMaxReasonBytes);
  kept_.push_back(std::move(d));
  while (kept_.size() > capacity_) kept_.pop_front();
}

absl::Status DecisionLog::Record(RoundDecision d) {
  std::lock_guard lock(mu_);
  KeepLocked(std::move(d));
  if (path_.empty()) return absl::OkStatus();
  if (absl::Status s = WriteAll(fd_, Line(kept_.back()), path_); !s.ok()) return s;
  ++lines_;
  if (lines_ >= 2 * capacity_) return CompactLocked();
  return absl::OkStatus();
}

absl::Status DecisionLog::CompactLocked() {
  const std::string tmp = path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot create ", tmp, ": ", Errno()));
  std::string all;
  for (const RoundDecision& d : kept_) all += Line(d);
  absl::Status s = WriteAll(fd, all, tmp);
  ::close(fd);
  if (!s.ok()) return s;
  if (::rename(tmp.c_str(), path_.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot replace ", path_, ": ", Errno()));
  }
  std::string dir = std::filesystem::path(path_).parent_path().string();
  if (dir.empty()) dir = ".";
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  const int appended = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (appended < 0) return absl::InternalError(absl::StrCat("cannot open ", path_, ": ", Errno()));
  if (fd_ >= 0) ::close(fd_);
  fd_ = appended;
  lines_ = kept_.size();
  return absl::OkStatus();
}

std::optional<RoundDecision> DecisionLog::Find(uint64_t round) const {
  std::lock_guard lock(mu_);
  for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
    if (it->round == round) return *it;
  }
  return std::nullopt;
}

size_t DecisionLog::size() const {
  std::lock_guard lock(mu_);
  return kept_.size();
}

}  // namespace wpub::group
