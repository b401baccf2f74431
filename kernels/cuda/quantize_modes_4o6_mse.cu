// Instantiates quantize and fused QDQ for the four 4over6 MSE modes ({E = 448, 256} x
// {exact, FP16 error}); split from the other metric so the two compile in parallel.
#include "kernels/cuda/qdq_resident.cuh"

namespace wpub::kernels::cuda::detail {

using Mse448Exact = FourOverSixTraits<ErrMetric::kMSE, 448, ErrKind::kExact>;
using Mse448Fp16 = FourOverSixTraits<ErrMetric::kMSE, 448, ErrKind::kFP16>;
using Mse256Exact = FourOverSixTraits<ErrMetric::kMSE, 256, ErrKind::kExact>;
using Mse256Fp16 = FourOverSixTraits<ErrMetric::kMSE, 256, ErrKind::kFP16>;

WPUB_INSTANTIATE_QUANT_MODE(Mse448Exact);
WPUB_INSTANTIATE_QDQ_RESIDENT(Mse448Exact);
WPUB_INSTANTIATE_QUANT_MODE(Mse448Fp16);
WPUB_INSTANTIATE_QDQ_RESIDENT(Mse448Fp16);
WPUB_INSTANTIATE_QUANT_MODE(Mse256Exact);
WPUB_INSTANTIATE_QDQ_RESIDENT(Mse256Exact);
WPUB_INSTANTIATE_QUANT_MODE(Mse256Fp16);
WPUB_INSTANTIATE_QDQ_RESIDENT(Mse256Fp16);

}  // namespace wpub::kernels::cuda::detail
