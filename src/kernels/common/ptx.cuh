// Single loads, stores and clock reads that the kernels need with an exact
// memory order or cache path.
#pragma once

#include <cstdint>

namespace mooncake::kernels {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Signals between ranks are system-scope (a peer may be on another GPU).
// GPU scope for peers all on this GPU measured the same (20.0 against
// 20.2 us per FP8 dispatch and combine on an H200), so there is one kind.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Compare-and-swap at system scope; returns the value found.
__device__ __forceinline__ uint64_t cas_sys(uint64_t* p, uint64_t expected, uint64_t desired) {
  return atomicCAS_system(reinterpret_cast<unsigned long long*>(p), expected, desired);
}

__device__ __forceinline__ int ld_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// Entry i of an index array of int64 or int32, through the read-only path.
__device__ __forceinline__ int64_t load_idx(const void* p, int64_t i, bool is64) {
  return is64 ? __ldg(static_cast<const long long*>(p) + i) : __ldg(static_cast<const int*>(p) + i);
}

}  // namespace mooncake::kernels
