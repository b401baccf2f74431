// Host launchers of the NVFP4 CUDA kernels (docs/specs/nvfp4.md): multi-tensor amax with
// a non-finite count, global scales, quantize (standard and the eight 4over6 modes), dequantize
// and fused quantize-dequantize (QDQ). Kernels live in the .cu files of this folder; every
// per-element step calls the scalar functions of kernels/nvfp4_math.h, so the results are the
// CPU reference's (kernels/reference.h) byte for byte.
//
// Launch contract, for every function below:
//  - Asynchronous: work is enqueued on `stream` and the call returns; no host synchronization,
//    no device-to-host read, no allocation, no host-to-device copy. Pointers inside descriptors
//    are device pointers and must stay valid until the stream has executed the work. Every
//    launcher is therefore capturable into a CUDA graph; a replay reads whatever the captured
//    buffers hold at replay time.
//  - Returns KernelStatus::kInvalidArgument (nothing enqueued) when a descriptor is invalid
//    (see ValidateWeight in kernels/nvfp4.h; cols % 16 != 0 is rejected here before any launch)
//    and, when `message` is non-null, a sentence naming the offending weight and rule.
//    kUnsupported: a layout the kernels do not take (see the alignment rules below).
//    kWorkspaceTooSmall: the caller's workspace is smaller than the size query said.
//    kCudaError: a launch failed (cudaGetLastError() was consumed; the message names it).
//  - Alignment: every weight part, packed output, dequantized output and QDQ in/out pointer
//    must be 16-byte aligned; with dim-1 concatenation every part's cols must be a multiple
//    of 16 (a block never straddles two parts). Scale and amax pointers need only natural
//    alignment.
//  - Lists are processed in as few launches as the kernel parameter space allows
//    (kMaxItemsPerLaunch work items per launch; an item is one (weight, slice, part)).
//  - Thread-safety: launchers keep no state of their own; concurrent calls on different streams
//    are safe. (A capped launch sets two attributes of its kernel function, always to the same
//    values; see LaunchLimits.)
//  - Modes are compile-time kernel specializations chosen through DispatchQuantMode; an
//    invalid mode is kInvalidArgument.
//  - LaunchAmax and LaunchQuantize take optional LaunchLimits: an occupancy cap for work that
//    shares the GPU with another stream's kernels. The bytes written never depend on it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/nvfp4.h"

namespace wpub::kernels::cuda {

// Work items (one per weight slice and part) that one launch carries in its parameters.
inline constexpr int kMaxItemsPerLaunch = 128;

// How many of a kernel's CTAs may sit on one SM at once (max_ctas_per_sm > 0; 0: as many as
// fit), for work that shares the GPU with another stream's kernels. Applied by requesting unused
// dynamic shared memory, with the kernel's carveout set to prefer shared memory. Measured on an
// H200 beside NCCL broadcasts of the previous bucket (bench/RESULTS.md): at full occupancy the
// quantize and amax kernels stretched each 1 GiB broadcast from 2.9 to 4.1-4.3 ms; at 3 CTAs per
// SM to ~3.6 ms, while the kernels themselves lose little.
struct LaunchLimits {
  int max_ctas_per_sm = 0;
};

// ---------------------------------------------------------------------------------------------
// Amax.
//
// For weight i, slice s: amax[slot_offsets[i] + s] = max |x| over that slice, NaN skipped
// (0 when every element is NaN); nonfinite[same slot] = count of inf/NaN elements. With
// slot_offsets == nullptr weight i starts at the sum of the earlier weights' num_slices (a list
// gets one slot per weight slice). Two weights given the same offset share their slots: that is
// how a gate/up pair gets ONE amax over both. `amax` (float) and `nonfinite` (may be nullptr)
// are device arrays of num_slots entries; they are zeroed on the stream and then accumulated
// with order-independent atomics, so the result is deterministic. Parts are read in place.
KernelStatus LaunchAmax(const WeightDesc* weights, int num_weights, const int64_t* slot_offsets,
                        int64_t num_slots, float* amax, int64_t* nonfinite, cudaStream_t stream,
                        std::string* message = nullptr, const LaunchLimits& limits = {});

// One weight (a rank-2 tensor: one slot; a rank-3 stack: num_slices slots).
KernelStatus LaunchAmax(const WeightDesc& weight, float* amax, int64_t* nonfinite,
                        cudaStream_t stream, std::string* message = nullptr);

// A gate/up pair: one amax over [gate; up] per slice (gate and up must have equal num_slices).
KernelStatus LaunchAmaxPair(const WeightDesc& gate, const WeightDesc& up, float* amax,
                            int64_t* nonfinite, cudaStream_t stream,
                            std::string* message = nullptr);

// ---------------------------------------------------------------------------------------------
// Global scales: for i < n, s_enc[i] = GlobalEncodeScale(amax[i], e4m3_max) and
// s_dec[i] = GlobalDecodeScale(s_enc[i]) (either output may be nullptr). Shape-preserving by
// construction: n in, n out, on the device, never read back.
KernelStatus LaunchGlobalScales(const float* amax, int64_t n, int e4m3_max, float* s_enc,
                                float* s_dec, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Quantize.

// One weight to quantize: its parts (read in place), where the results go, and the device
// array of its per-slice amax ([weight.num_slices] floats; a pair's two jobs point at the
// same array).
struct QuantizeJob {
  WeightDesc weight;
  QuantOutput out;
  const float* amax = nullptr;
};

// Quantizes every job with `mode`: packed codes, linear E4M3 scales, optionally the 128x4
// swizzled scales (out.swizzled != nullptr; padding is zeroed), and weight_scale_2 per slice.
// The global scales are derived on the device from *amax.
KernelStatus LaunchQuantize(const QuantizeJob* jobs, int num_jobs, QuantMode mode,
                            cudaStream_t stream, std::string* message = nullptr,
                            const LaunchLimits& limits = {});

// ---------------------------------------------------------------------------------------------
// Dequantize.

struct DequantizeJob {
  QuantizedView in;     // packed + linear scales + amax per slice
  void* out = nullptr;  // [num_slices, rows, cols] of out_type (kBF16 or kF16)
  ElemType out_type = ElemType::kBF16;
};

// Decodes every job: y = E2M1val(q) * ((float(sf) * amax) * fl32(1/(6E))), rounded to
// out_type. `mode` supplies E (448 or 256).
KernelStatus LaunchDequantize(const DequantizeJob* jobs, int num_jobs, QuantMode mode,
                              cudaStream_t stream, std::string* message = nullptr);

// ---------------------------------------------------------------------------------------------
// Fused QDQ (fake quantization): out = dequantize(quantize(in)) bit for bit, in one pass per
// element, without writing codes or scales to global memory.

// A bf16/fp16 weight of one part (rank-2, or a rank-3 stack fake-quantized slice by slice);
// out has its type and logical shape, contiguous, 16-byte aligned.
struct QdqJob {
  WeightDesc weight;
  void* out = nullptr;          // may equal the input (in-place fake quantization)
  const float* amax = nullptr;  // device [num_slices]; ignored by LaunchQdqComputeAmax
};

// Caller-provided amax: every job's amax must be set.
KernelStatus LaunchQdq(const QdqJob* jobs, int num_jobs, QuantMode mode, cudaStream_t stream,
                       std::string* message = nullptr);

// Bytes of workspace LaunchQdqComputeAmax needs for these jobs: one amax and one non-finite
// count per weight slice, and a grid-barrier counter, in 256-byte aligned sub-buffers.
size_t QdqComputeAmaxWorkspaceBytes(const QdqJob* jobs, int num_jobs);

// How LaunchQdqComputeAmax runs.
enum class QdqAmaxPath {
  kAuto,      // resident for standard NVFP4 on slices up to two grid stashes (where it measured
              // faster), where the device has cooperative launch; two-pass otherwise
  kResident,  // every mode; kUnsupported where the device has no cooperative launch
  kTwoPass,
};

struct QdqAmaxOptions {
  QdqAmaxPath path = QdqAmaxPath::kAuto;
  // Resident: input bytes each CTA keeps in shared memory (<= 0: as much as fits; smaller values
  // make small inputs take several rounds and spill, for tests).
  int64_t resident_cta_bytes = 0;
  // Two-pass: jobs go in groups of at most this many input bytes (<= 0: one group), one amax
  // launch then one QDQ launch per group.
  int64_t group_bytes = 0;
};

// Computes each job's amax into `workspace`, then fake-quantizes with it; jobs[i].amax is
// ignored. Two ways, the same bytes (QdqAmaxOptions::path):
//  - resident: one cooperative launch that keeps each weight in the SMs' shared memory between
//    its amax and its QDQ (qdq_resident.cuh), so the input is read once where it fits (on an
//    H200 about 30 MB per round, one CTA per SM) and the rest twice; weights are taken in rounds
//    of consecutive slices, with a grid barrier in each;
//  - two-pass: an amax launch, then the QDQ launch (the input is read twice).
// Bad jobs are rejected before anything is enqueued. `workspace` is a device buffer of at least
// QdqComputeAmaxWorkspaceBytes(jobs, num_jobs) bytes, 256-byte aligned; once the stream has run
// this work it holds the amax per slice (floats at offset 0, job after job) and the int64
// non-finite counts (at QdqWorkspaceCountOffset(jobs, num_jobs)).
KernelStatus LaunchQdqComputeAmax(const QdqJob* jobs, int num_jobs, QuantMode mode, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream,
                                  std::string* message = nullptr,
                                  const QdqAmaxOptions& options = {});

// Byte offset of the non-finite counts inside the LaunchQdqComputeAmax workspace.
size_t QdqWorkspaceCountOffset(const QdqJob* jobs, int num_jobs);

}  // namespace wpub::kernels::cuda
