// BuildInfo from the generated build_config.h and the linked libraries.
#include "cli/build_info.h"

#include <google/protobuf/stubs/common.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "build_config.h"

namespace wpub::cli {

const BuildInfo& Build() {
  static const BuildInfo* info = [] {
    auto* b = new BuildInfo;
    b->version = WPUB_BUILD_VERSION;
    b->cuda = WPUB_BUILD_CUDA;
    b->nccl = WPUB_BUILD_NCCL;
    b->grpc = grpc::Version();
    b->protobuf = google::protobuf::internal::VersionString(GOOGLE_PROTOBUF_VERSION);
    b->build_type = WPUB_BUILD_TYPE;
    return b;
  }();
  return *info;
}

std::string VersionLine(absl::string_view program) {
  const BuildInfo& b = Build();
  return absl::StrCat(program, " ", b.version, " (CUDA ", b.cuda, ", NCCL ", b.nccl, ", gRPC ",
                      b.grpc, ", protobuf ", b.protobuf, ", ", b.build_type, ")");
}

}  // namespace wpub::cli
