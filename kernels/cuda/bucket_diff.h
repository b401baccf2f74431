// The bucket patch of core/delta/bucket_patch.h made on the GPU: the runs of 8-byte words that
// differ between two device copies of a bucket, written as the format 1 "WPBP" patch that
// delta::DiffBucket makes of them, byte for byte, with its totals for the caller's decision
// (patch or whole bucket) on the host. With xor_runs the run bytes are next XOR base (flags bit
// 0): what the host turns into the format 2 patch wpubd sends (delta::UnitsFromXorRuns).
//
// Launch contract: asynchronous on `stream`, no host synchronization, no allocation, three kernel
// launches whatever the data (capturable in a CUDA graph; a replay diffs whatever the captured
// buffers hold). The patch is deterministic: every byte has one writer, its place given by
// prefix sums. Launchers keep no state; concurrent calls on different streams with different
// scratch and outputs are safe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace wpub::kernels::cuda {

// Totals of one diff, written by the launch (device memory; read once by the host).
struct BucketDiffTotals {
  unsigned long long runs;           // runs of changed words
  unsigned long long changed_words;  // words that differ
  // The whole patch's size, header included (48 + 8*runs + bytes of changed words, the
  // bucket's last word counting only its n%8 bytes when partial).
  unsigned long long patch_bytes;
  unsigned long long written;        // 1 when the patch was written into `patch`, else 0
  unsigned long long changed_units;  // 16-bit units that differ (format 3 counts its entries)
};

// Device scratch the diff of an n-byte bucket needs (bytes, a multiple of 256): a bit per word
// and 40 bytes per 4096-word tile, about n / 59 (18 MiB for 1 GiB). It does not depend on
// patch_capacity (no per-run scratch); the argument keeps the contract open to designs that do.
uint64_t BucketDiffScratchBytes(uint64_t n, uint64_t patch_capacity);

// Compares the n bytes at `base` and `next` (device, 8-byte aligned) word by word (8-byte words,
// the last one partial when n % 8 != 0) and writes into `patch` (device, 8-byte aligned,
// patch_capacity bytes) the format 1 patch DiffBucket (core/delta/bucket_patch.h) makes of them
// (with options .format = kWordRuns, .xor_runs = xor_runs) -- header with base_checksum /
// next_checksum, runs ascending -- byte for byte, when it fits:
// patch_bytes <= patch_capacity and words and runs fit in uint32. Otherwise writes only *totals
// (written = 0) and leaves `patch` untouched. Scratch: `scratch` (device, 256-byte aligned) of
// at least BucketDiffScratchBytes(n, patch_capacity); its contents need no initialization and
// are garbage afterwards. Asynchronous on `stream`, no host synchronization, a fixed number of
// launches (no data-dependent host work). n == 0 gives a header-only patch (48 bytes, runs 0).
// The "patch too big" decision (max_patch_fraction) is the caller's, from *totals.
// Returns cudaErrorInvalidValue (enqueuing nothing) for a misaligned or null pointer or too
// little scratch, else the launch error.
cudaError_t LaunchBucketDiff(const uint8_t* base, const uint8_t* next, uint64_t n,
                             uint64_t base_checksum, uint64_t next_checksum, uint8_t* patch,
                             uint64_t patch_capacity, void* scratch, uint64_t scratch_bytes,
                             BucketDiffTotals* totals, cudaStream_t stream, bool xor_runs = false);

// The same diff written as the format 3 patch (indexed units, core/delta/bucket_patch.h) that
// DiffBucket makes with options .format = kIndexedUnits, byte for byte: what wpubd broadcasts
// to an NCCL engine that takes patches. Totals, capacity and scratch as above (patch_bytes is
// 48 + 6 changed units; it fits only for a bucket of at most 2^32 units). Buckets that change
// between the launches (a caller's contract broken) end with written = 0, nothing written past
// the patch's size.
cudaError_t LaunchBucketDiffIndexed(const uint8_t* base, const uint8_t* next, uint64_t n,
                                    uint64_t base_checksum, uint64_t next_checksum, uint8_t* patch,
                                    uint64_t patch_capacity, void* scratch, uint64_t scratch_bytes,
                                    BucketDiffTotals* totals, cudaStream_t stream);

// Applies the format 3 patch of `patch_bytes` bytes at `patch` (device) to the n-byte bucket at
// `bucket` (device) in place, all or nothing: first every check delta::ApplyBucketPatch makes of
// the patch's form (header, the bucket's size, units ascending and in range, no zero XOR, no
// XOR past an odd bucket's last byte) -- any failure sets *error (device, zeroed by the launch)
// to non-zero and leaves the bucket untouched -- then each entry's XOR into its unit. The
// checksums in the header are not checked here: the caller compares the bucket's own before and
// after (applying the same patch again restores the base). Asynchronous on `stream`, no host
// synchronization, no allocation, a memset and two launches. Pointers 8-byte aligned (error:
// 4); cudaErrorInvalidValue (enqueuing nothing) otherwise, else the launch error.
cudaError_t LaunchBucketPatchApply(const uint8_t* patch, uint64_t patch_bytes, uint8_t* bucket,
                                   uint64_t n, unsigned int* error, cudaStream_t stream);

}  // namespace wpub::kernels::cuda
