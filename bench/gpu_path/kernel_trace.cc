// CUPTI activity records of kernels (see kernel_trace.h).
#include "bench/gpu_path/kernel_trace.h"

#include <cupti.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>

#include "tests/kernels_gpu/cupti_library.h"

namespace wpub::bench {
namespace {

using RegisterFn = CUptiResult (*)(CUpti_BuffersCallbackRequestFunc,
                                   CUpti_BuffersCallbackCompleteFunc);
using KindFn = CUptiResult (*)(CUpti_ActivityKind);
using FlushFn = CUptiResult (*)(uint32_t);
using NextFn = CUptiResult (*)(uint8_t*, size_t, CUpti_Activity**);

struct Cupti {
  RegisterFn register_callbacks = nullptr;
  KindFn enable = nullptr;
  KindFn disable = nullptr;
  FlushFn flush_all = nullptr;
  NextFn next_record = nullptr;
};

// The records of the trace that is on: CUPTI's buffer callbacks take no user data.
std::mutex g_mu;
std::vector<TracedKernel>* g_sink = nullptr;
const Cupti* g_cupti = nullptr;

constexpr size_t kBufferBytes = size_t{8} << 20;

void CUPTIAPI OnBufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI OnBufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    CUpti_Activity* record = nullptr;
    while (g_sink != nullptr && g_cupti != nullptr &&
           g_cupti->next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL &&
          record->kind != CUPTI_ACTIVITY_KIND_KERNEL) {
        continue;
      }
      // The fields read here lead every kernel record version CUPTI has had.
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      TracedKernel t;
      t.name = k->name != nullptr ? k->name : "?";
      t.device = k->deviceId;
      t.stream = k->streamId;
      t.start_ns = k->start;
      t.end_ns = k->end;
      t.grid = k->gridX * k->gridY * k->gridZ;
      t.block = k->blockX * k->blockY * k->blockZ;
      t.registers = k->registersPerThread;
      t.cluster = k->clusterX * k->clusterY * k->clusterZ;
      g_sink->push_back(std::move(t));
    }
  }
  std::free(buffer);
}

const Cupti* LoadCupti(std::string* error) {
  static Cupti cupti;
  static bool loaded = false;
  if (loaded) return &cupti;
  void* lib = kernels::cuda::testing::OpenCupti(error);
  if (lib == nullptr) return nullptr;
  cupti.register_callbacks =
      reinterpret_cast<RegisterFn>(dlsym(lib, "cuptiActivityRegisterCallbacks"));
  cupti.enable = reinterpret_cast<KindFn>(dlsym(lib, "cuptiActivityEnable"));
  cupti.disable = reinterpret_cast<KindFn>(dlsym(lib, "cuptiActivityDisable"));
  cupti.flush_all = reinterpret_cast<FlushFn>(dlsym(lib, "cuptiActivityFlushAll"));
  cupti.next_record = reinterpret_cast<NextFn>(dlsym(lib, "cuptiActivityGetNextRecord"));
  if (!cupti.register_callbacks || !cupti.enable || !cupti.disable || !cupti.flush_all ||
      !cupti.next_record) {
    *error = "libcupti lacks the activity API";
    return nullptr;
  }
  if (cupti.register_callbacks(OnBufferRequested, OnBufferCompleted) != CUPTI_SUCCESS) {
    *error = "cuptiActivityRegisterCallbacks failed";
    return nullptr;
  }
  loaded = true;
  return &cupti;
}

std::vector<TracedKernel> g_records;

const char* ClassOf(const std::string& name) {
  for (const char* c : {"Quantize", "Amax", "Checksum", "Copy", "Count"}) {
    if (name.find(c) != std::string::npos) return c;
  }
  return "other";
}

}  // namespace

KernelTrace::~KernelTrace() {
  if (on_) Stop();
}

bool KernelTrace::Start(std::string* error) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_sink != nullptr) {
    *error = "another kernel trace is on";
    return false;
  }
  const Cupti* cupti = LoadCupti(error);
  if (cupti == nullptr) return false;
  if (cupti->enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    *error = "cuptiActivityEnable(CONCURRENT_KERNEL) failed";
    return false;
  }
  g_records.clear();
  g_sink = &g_records;
  g_cupti = cupti;
  on_ = true;
  return true;
}

std::vector<TracedKernel> KernelTrace::Stop() {
  if (!on_) return {};
  const Cupti* cupti = g_cupti;
  cupti->flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  cupti->disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cupti->flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::vector<TracedKernel> out;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    out.swap(g_records);
    g_sink = nullptr;
  }
  on_ = false;
  std::sort(out.begin(), out.end(),
            [](const TracedKernel& a, const TracedKernel& b) { return a.start_ns < b.start_ns; });
  return out;
}

BroadcastNeighbours SummarizeBroadcasts(const std::vector<TracedKernel>& kernels, uint32_t device) {
  BroadcastNeighbours s;
  std::map<std::string, double> overlap;
  double sum = 0;
  for (const TracedKernel& b : kernels) {
    if (b.device != device || b.name.find("nccl") == std::string::npos) continue;
    const double d = (b.end_ns - b.start_ns) * 1e-9;
    s.min_seconds = s.broadcasts == 0 ? d : std::min(s.min_seconds, d);
    s.max_seconds = std::max(s.max_seconds, d);
    sum += d;
    ++s.broadcasts;
    s.grid = b.grid;
    s.block = b.block;
    s.registers = b.registers;
    s.cluster = b.cluster;
    for (const TracedKernel& k : kernels) {
      if (&k == &b || k.device != device || k.name.find("nccl") != std::string::npos) continue;
      const uint64_t lo = std::max(k.start_ns, b.start_ns), hi = std::min(k.end_ns, b.end_ns);
      if (hi > lo) overlap[ClassOf(k.name)] += (hi - lo) * 1e-9;
    }
  }
  if (s.broadcasts > 0) s.mean_seconds = sum / s.broadcasts;
  s.overlap_seconds.assign(overlap.begin(), overlap.end());
  return s;
}

}  // namespace wpub::bench
