// Instantiates quantize and fused QDQ for the four 4over6 MAE modes ({E = 448, 256} x
// {exact, FP16 error}); split from the other metric so the two compile in parallel.
#include "kernels/cuda/qdq_resident.cuh"

namespace wpub::kernels::cuda::detail {

using Mae448Exact = FourOverSixTraits<ErrMetric::kMAE, 448, ErrKind::kExact>;
using Mae448Fp16 = FourOverSixTraits<ErrMetric::kMAE, 448, ErrKind::kFP16>;
using Mae256Exact = FourOverSixTraits<ErrMetric::kMAE, 256, ErrKind::kExact>;
using Mae256Fp16 = FourOverSixTraits<ErrMetric::kMAE, 256, ErrKind::kFP16>;

WPUB_INSTANTIATE_QUANT_MODE(Mae448Exact);
WPUB_INSTANTIATE_QDQ_RESIDENT(Mae448Exact);
WPUB_INSTANTIATE_QUANT_MODE(Mae448Fp16);
WPUB_INSTANTIATE_QDQ_RESIDENT(Mae448Fp16);
WPUB_INSTANTIATE_QUANT_MODE(Mae256Exact);
WPUB_INSTANTIATE_QDQ_RESIDENT(Mae256Exact);
WPUB_INSTANTIATE_QUANT_MODE(Mae256Fp16);
WPUB_INSTANTIATE_QDQ_RESIDENT(Mae256Fp16);

}  // namespace wpub::kernels::cuda::detail
