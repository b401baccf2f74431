// CreateCudaExecutor in a build without CUDA: --device cuda is refused with a clear error.
#include "core/convert/plan.h"

namespace wpub::convert {

absl::StatusOr<std::unique_ptr<Executor>> CreateCudaExecutor(const ConvertOptions&) {
  return absl::UnimplementedError(
      "--device cuda: this wpubctl was built without CUDA (use --device cpu)");
}

}  // namespace wpub::convert
