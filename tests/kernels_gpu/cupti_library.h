// libcupti for the CUPTI users of the tests and benchmarks (SyncCounter, the GPU-path benchmark's
// KernelTrace): opened with dlopen, so that their binaries link and run, reporting CUPTI missing,
// on machines without it. The CUDA 13 library first (the one staged beside the binaries), then
// 12, then the unversioned name. Never closed (RTLD_NODELETE): CUPTI hooks into the driver once
// used. Thread-safe (dlopen is).
#pragma once

#include <dlfcn.h>

#include <string>

namespace wpub::kernels::cuda::testing {

// The library's handle for dlsym, or null with *error set.
inline void* OpenCupti(std::string* error) {
  for (const char* name : {"libcupti.so.13", "libcupti.so.12", "libcupti.so"}) {
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE)) return lib;
  }
  const char* why = dlerror();
  *error = std::string("cannot load libcupti: ") + (why != nullptr ? why : "not found");
  return nullptr;
}

}  // namespace wpub::kernels::cuda::testing
