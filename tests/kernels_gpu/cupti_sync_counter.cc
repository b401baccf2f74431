// CUPTI runtime-API callback subscriber that counts synchronizing CUDA calls (see header).
#include "tests/kernels_gpu/cupti_sync_counter.h"

#include <cupti.h>
#include <dlfcn.h>

#include <set>

#include "tests/kernels_gpu/cupti_library.h"

namespace wpub::kernels::cuda::testing {
namespace {

using SubscribeFn = CUptiResult (*)(CUpti_SubscriberHandle*, CUpti_CallbackFunc, void*);
using EnableDomainFn = CUptiResult (*)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain);
using UnsubscribeFn = CUptiResult (*)(CUpti_SubscriberHandle);

// Strips the per-thread default stream suffixes so "cudaMemcpy_ptds" counts as "cudaMemcpy".
std::string BaseName(const char* name) {
  std::string s(name == nullptr ? "?" : name);
  for (const char* suffix : {"_ptsz", "_ptds"}) {
    const std::string suf(suffix);
    if (s.size() > suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0) {
      s.resize(s.size() - suf.size());
    }
  }
  return s;
}

void CUPTIAPI OnRuntimeApi(void* userdata, CUpti_CallbackDomain domain, CUpti_CallbackId,
                           const void* cbdata) {
  if (domain != CUPTI_CB_DOMAIN_RUNTIME_API || cbdata == nullptr) return;
  const auto* info = static_cast<const CUpti_CallbackData*>(cbdata);
  if (info->callbackSite != CUPTI_API_ENTER) return;
  static_cast<SyncCounter*>(userdata)->RecordCall(info->functionName);
}

}  // namespace

// libcupti is never unloaded: CUPTI hooks into the driver when first used, and unmapping it
// afterwards leaves those hooks pointing at freed code (RTLD_NODELETE keeps it mapped).
SyncCounter::~SyncCounter() { Stop(); }

bool SyncCounter::IsSynchronizing(const std::string& function_name) {
  // Calls that block the host until device work finishes, or that synchronize the device
  // implicitly (allocation and free), per the CUDA runtime's "API synchronization behavior".
  static const std::set<std::string> kSync = {
      "cudaDeviceSynchronize",
      "cudaThreadSynchronize",
      "cudaStreamSynchronize",
      "cudaEventSynchronize",
      "cudaMemcpy",
      "cudaMemcpy2D",
      "cudaMemcpy3D",
      "cudaMemcpyToSymbol",
      "cudaMemcpyFromSymbol",
      "cudaMemcpyPeer",
      "cudaMemcpyToArray",
      "cudaMemcpyFromArray",
      "cudaMemset",
      "cudaMemset2D",
      "cudaMemset3D",
      "cudaMalloc",
      "cudaFree",
      "cudaMallocHost",
      "cudaFreeHost",
      "cudaHostAlloc",
      "cudaMallocManaged",
      "cudaMallocPitch",
      "cudaMalloc3D",
      "cudaMallocArray",
      "cudaFreeArray",
      "cudaHostRegister",
      "cudaHostUnregister",
      "cudaDeviceReset",
  };
  return kSync.count(BaseName(function_name.c_str())) != 0;
}

bool SyncCounter::Start(std::string* error) {
  if (subscriber_ != nullptr) {
    *error = "already started";
    return false;
  }
  if (lib_ == nullptr) {
    lib_ = OpenCupti(error);
    if (lib_ == nullptr) return false;
  }
  auto subscribe = reinterpret_cast<SubscribeFn>(dlsym(lib_, "cuptiSubscribe"));
  auto enable = reinterpret_cast<EnableDomainFn>(dlsym(lib_, "cuptiEnableDomain"));
  if (subscribe == nullptr || enable == nullptr) {
    *error = "libcupti lacks cuptiSubscribe/cuptiEnableDomain";
    return false;
  }
  CUpti_SubscriberHandle handle = nullptr;
  CUptiResult r = subscribe(&handle, &OnRuntimeApi, this);
  if (r != CUPTI_SUCCESS) {
    *error = "cuptiSubscribe failed with CUptiResult " + std::to_string(static_cast<int>(r));
    return false;
  }
  subscriber_ = handle;
  r = enable(1, handle, CUPTI_CB_DOMAIN_RUNTIME_API);
  if (r != CUPTI_SUCCESS) {
    Stop();
    *error = "cuptiEnableDomain failed with CUptiResult " + std::to_string(static_cast<int>(r));
    return false;
  }
  return true;
}

void SyncCounter::Stop() {
  if (subscriber_ == nullptr || lib_ == nullptr) return;
  auto unsubscribe = reinterpret_cast<UnsubscribeFn>(dlsym(lib_, "cuptiUnsubscribe"));
  if (unsubscribe != nullptr) unsubscribe(static_cast<CUpti_SubscriberHandle>(subscriber_));
  subscriber_ = nullptr;
}

void SyncCounter::RecordCall(const char* name) {
  const std::string base = BaseName(name);
  total_calls_.fetch_add(1);
  if (IsSynchronizing(base)) sync_calls_.fetch_add(1);
  std::lock_guard<std::mutex> lock(mu_);
  ++by_name_[base];
}

std::map<std::string, int> SyncCounter::calls_by_name() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_name_;
}

std::string SyncCounter::SynchronizingCallNames() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, count] : by_name_) {
    if (!IsSynchronizing(name)) continue;
    if (!out.empty()) out += ", ";
    out += name + " x" + std::to_string(count);
  }
  return out.empty() ? "none" : out;
}

}  // namespace wpub::kernels::cuda::testing
