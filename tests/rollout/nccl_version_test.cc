// NCCL versions (core/nccl/nccl_version.h): the version codes of both numbering schemes, the
// library this process loaded, and NCCL's own mismatch message (init.cc's WARN, as
// ncclGetLastError returns it) turned into a sentence naming both ranks -- wpubd and the engine
// -- with their versions and what the operator does about it. No device needed.
#include <gtest/gtest.h>

#include "core/nccl/nccl_version.h"

namespace wpub::nccl {
namespace {

TEST(NcclVersion, CodesOfBothSchemes) {
  EXPECT_EQ(NcclVersionName(22809), "2.28.9");
  EXPECT_EQ(NcclVersionName(22703), "2.27.3");
  EXPECT_EQ(NcclVersionName(21003), "2.10.3");
  EXPECT_EQ(NcclVersionName(2804), "2.8.4");  // before 2.9: major*1000
  EXPECT_EQ(NcclVersionName(0), "(version code 0)");
}

TEST(NcclVersion, TheLoadedLibraryIsNamedWithItsFile) {
  const std::string loaded = LoadedNccl();
  EXPECT_EQ(loaded.rfind("2.", 0), 0u) << loaded;
  EXPECT_NE(loaded.find("libnccl"), std::string::npos) << loaded;
}

TEST(NcclVersion, AMismatchNamesBothRanksAndTheirVersions) {
  // As NcclComm's errors carry it: the result string, then the communicator's last error.
  const std::string error =
      "NCCL communicator init: invalid usage (run with NCCL_DEBUG=WARN for details) (Mismatched "
      "NCCL version detected : rank 1 version 22703 rank 0 version 22809)";
  const auto who = [](int rank) -> std::string {
    return rank == 0 ? "wpubd" : "engine http://10.0.0.5:30000";
  };
  const std::optional<std::string> why = ExplainVersionMismatch(error, who);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("engine http://10.0.0.5:30000 (rank 1) loads NCCL 2.27.3"), std::string::npos)
      << *why;
  EXPECT_NE(why->find("wpubd (rank 0) loads NCCL 2.28.9"), std::string::npos) << *why;
  EXPECT_NE(why->find("LD_LIBRARY_PATH"), std::string::npos) << *why;

  const std::optional<std::string> unnamed = ExplainVersionMismatch(error);
  ASSERT_TRUE(unnamed.has_value());
  EXPECT_NE(unnamed->find("rank 1 loads NCCL 2.27.3, rank 0 loads NCCL 2.28.9"), std::string::npos)
      << *unnamed;
}

TEST(NcclVersion, OtherErrorsAreNotAMismatch) {
  EXPECT_FALSE(ExplainVersionMismatch("ncclBroadcast: remote process exited or there was a "
                                      "network error")
                   .has_value());
  EXPECT_FALSE(ExplainVersionMismatch("Mismatched NCCL version detected").has_value());
}

}  // namespace
}  // namespace wpub::nccl
