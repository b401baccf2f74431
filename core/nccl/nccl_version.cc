// NCCL versions: the loaded library, and NCCL's mismatch message read back.
#include "core/nccl/nccl_version.h"

#include <dlfcn.h>
#include <nccl.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "re2/re2.h"

namespace wpub::nccl {

std::string NcclVersionName(int code) {
  if (code <= 0) return absl::StrCat("(version code ", code, ")");
  // NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z before 2.9, X*10000+Y*100+Z from 2.9 (nccl.h).
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? (code % 10000) / 100 : (code % 1000) / 100;
  const int patch = code % 100;
  return absl::StrCat(major, ".", minor, ".", patch);
}

std::string LoadedNccl() {
  int code = 0;
  std::string out =
      ncclGetVersion(&code) == ncclSuccess ? NcclVersionName(code) : std::string("(unknown)");
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) != 0 && info.dli_fname != nullptr) {
    absl::StrAppend(&out, " (", info.dli_fname, ")");
  }
  return out;
}

std::optional<std::string> ExplainVersionMismatch(std::string_view nccl_error,
                                                  const std::function<std::string(int)>& who) {
  // NCCL's init.cc: "Mismatched NCCL version detected : rank %d version %d rank %d version %d"
  // (the peer first, then the rank that reports it).
  static const LazyRE2 kMismatch = {
      R"(Mismatched NCCL version detected\s*:\s*rank (\d+) version (\d+) rank (\d+) version (\d+))"};
  int peer = 0, peer_code = 0, self = 0, self_code = 0;
  if (!RE2::PartialMatch(nccl_error, *kMismatch, &peer, &peer_code, &self, &self_code)) {
    return std::nullopt;
  }
  const auto name = [&](int rank) {
    std::string n = who ? who(rank) : std::string();
    return n.empty() ? absl::StrCat("rank ", rank) : absl::StrCat(n, " (rank ", rank, ")");
  };
  return absl::StrCat(name(peer), " loads NCCL ", NcclVersionName(peer_code), ", ", name(self),
                      " loads NCCL ", NcclVersionName(self_code),
                      ": every rank of a weight-update group must load the same NCCL -- start "
                      "wpubd with LD_LIBRARY_PATH naming the folder of the engines' libnccl.so.2 "
                      "(their torch's: python3 -c 'import nvidia.nccl, os; "
                      "print(os.path.join(nvidia.nccl.__path__[0], \"lib\"))')");
}

}  // namespace wpub::nccl
