#include "clients/recv/staging.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace wpub::recv {

transport::PublicationManifest MergedManifest(const Assembly& a) {
  transport::PublicationManifest out;
  uint32_t next = 0;
  for (const auto& [member, part] : a.parts) {
    if (out.buckets.empty() && next == 0) {
      out.version = part.manifest.version;
      out.model_id = part.manifest.model_id;
      out.recipe = part.manifest.recipe;
      out.group = part.manifest.group;
      out.group_members = part.manifest.group_members;
    }
    for (transport::BucketManifest b : part.manifest.buckets) {
      b.index = next++;
      out.buckets.push_back(std::move(b));
    }
  }
  return out;
}

std::vector<SafetensorsEntry> EntriesOf(const transport::PublicationManifest& manifest,
                                        const std::vector<std::vector<uint8_t>>& buckets) {
  std::vector<SafetensorsEntry> entries;
  for (const transport::BucketManifest& b : manifest.buckets) {
    for (const transport::ManifestTensor& t : b.tensors) {
      entries.push_back({TensorDesc{t.name, t.dtype, t.shape},
                         absl::MakeConstSpan(buckets[b.index]).subspan(t.offset, t.nbytes)});
    }
  }
  return entries;
}

std::map<std::string, std::string> MetadataOf(const transport::PublicationManifest& manifest) {
  return {{"version", std::to_string(manifest.version)},
          {"model_id", manifest.model_id},
          {"recipe", manifest.recipe}};
}

absl::Status CheckOutputWritable(const std::string& path, const std::string& probe) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("output '", path, "' is a directory; give a file path"));
  }
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "output '", path, "' is not writable: cannot create ", probe, ": ", std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return absl::OkStatus();
}

uint64_t VersionInFile(const std::string& path) {
  absl::StatusOr<std::map<std::string, std::string>> metadata = ReadSafetensorsMetadata(path);
  if (!metadata.ok()) {
    if (!absl::IsNotFound(metadata.status())) {
      spdlog::warn("output {} is unreadable, so it holds no version: {}", path,
                   metadata.status().ToString());
    }
    return 0;
  }
  uint64_t version = 0;
  auto it = metadata->find("version");
  if (it == metadata->end() || !absl::SimpleAtoi(it->second, &version)) return 0;
  return version;
}

// staging.h says what is adopted and what removed.
uint64_t AdoptOrphanedStaging(const std::string& output_path, uint64_t held,
                              const std::string& mine) {
  const std::filesystem::path out(output_path);
  const std::filesystem::path dir = out.has_parent_path() ? out.parent_path() : ".";
  const std::string prefix = out.filename().string() + ".staging-";
  std::vector<std::pair<uint64_t, std::filesystem::path>> orphans;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    int pid = 0;
    if (!absl::SimpleAtoi(name.substr(prefix.size()), &pid) || pid <= 0) continue;
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    orphans.emplace_back(VersionInFile(entry.path().string()), entry.path());
  }
  std::sort(orphans.begin(), orphans.end());
  uint64_t adopted = 0;
  if (!orphans.empty() && orphans.back().first > held) {
    std::error_code mv;
    std::filesystem::rename(orphans.back().second, mine, mv);
    if (!mv) {
      adopted = orphans.back().first;
      spdlog::warn(
          "{} holds v{}, staged by a receiver process that is gone and not known to "
          "have committed: kept as {} until a daemon says whether it committed",
          orphans.back().second.string(), adopted, mine);
      orphans.pop_back();
    }
  }
  for (const auto& [version, path] : orphans) {
    std::error_code rm;
    if (std::filesystem::remove(path, rm)) {
      spdlog::warn("removed {}: the staging file of a receiver process that is gone ({})",
                   path.string(),
                   version == 0 ? std::string("incomplete")
                                : absl::StrCat("v", version, ", not above v", held));
    }
  }
  return adopted;
}

std::string StagePath(const std::string& output_path) {
  return absl::StrCat(output_path, ".staging-", ::getpid());
}

}  // namespace wpub::recv
