// Which NCCL this process loaded, and what a version mismatch between the ranks of a group
// means. NCCL refuses to form a communicator whose ranks load different NCCL versions (each rank
// compares every peer's version during init and fails with ncclInvalidUsage, recording
// "Mismatched NCCL version detected : rank A version X rank B version Y" as the communicator's
// last error). The engines load their torch's NCCL; wpubd loads whatever libnccl.so.2 the dynamic
// linker finds first, so an operator makes the two agree through LD_LIBRARY_PATH
// (deploy/README.md, "NCCL").
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace wpub::nccl {

// NCCL's version code (NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9, major*1000
// + minor*100 + patch before) as "2.28.9".
std::string NcclVersionName(int code);

// The NCCL this process loaded: "2.28.9 (/usr/local/cuda/lib64/libnccl.so.2)" -- the version
// the library reports (ncclGetVersion) and the file it was loaded from (absent when the loader
// cannot say).
std::string LoadedNccl();

// For an NCCL error text that holds NCCL's version-mismatch message: a sentence naming both
// ranks' versions ("rank 1 loads NCCL 2.27.3, rank 0 loads NCCL 2.28.9") and what to do. `who`
// names ranks (e.g. rank 0 is "wpubd", rank 1 an engine URL); a null `who` or an empty answer
// says "rank N". nullopt when the text holds no such message.
std::optional<std::string> ExplainVersionMismatch(
    std::string_view nccl_error, const std::function<std::string(int rank)>& who = nullptr);

}  // namespace wpub::nccl
