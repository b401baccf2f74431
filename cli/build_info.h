// The build's identity: the project version and the versions of what it was built against.
// `--version` of every binary prints VersionLine; wpubd exports it as wpub_build_info.
// Thread-safe: values fixed at build time (gRPC and protobuf read from the linked libraries).
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace wpub::cli {

struct BuildInfo {
  std::string version;   // the project's, e.g. "0.1.0"
  std::string cuda;      // the CUDA toolkit compiled against, "none" without CUDA
  std::string nccl;      // nccl.h compiled against, "none" without NCCL
  std::string grpc;      // the linked gRPC (grpc::Version())
  std::string protobuf;  // the linked protobuf
  std::string build_type;
};

const BuildInfo& Build();

// "wpubd 0.1.0 (CUDA 13.0.88, NCCL 2.28.9, gRPC 1.51.1, protobuf 3.21.12, RelWithDebInfo)".
std::string VersionLine(absl::string_view program);

}  // namespace wpub::cli
