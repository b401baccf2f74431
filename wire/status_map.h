// Conversions between the core's absl::Status and grpc::Status. The two code spaces are the
// same canonical codes; the mapping is spelled out so a code added to either side is a compile-
// time question, not a silent cast.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace wpub::wire {

// The grpc code with the same meaning as `code`.
grpc::StatusCode ToGrpcCode(absl::StatusCode code);
// The absl code with the same meaning as `code`.
absl::StatusCode ToAbslCode(grpc::StatusCode code);

// `status` as a grpc::Status carrying the same code and message (the message names the tensor,
// field or receiver at fault, and is what a trainer sees in its exception).
grpc::Status ToGrpcStatus(const absl::Status& status);
// `status` as an absl::Status (used by clients: wpub-recv, wpubctl).
absl::Status ToAbslStatus(const grpc::Status& status);

}  // namespace wpub::wire
