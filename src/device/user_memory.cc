#include "device/user_memory.h"

#include <cuda.h>  // the pointer attributes' names (the driver is reached through the runtime)

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/log.h"
#include "device/cuda.h"

namespace mooncake {

namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kernels::kIpcBytes);

using PointerAttributes = CUresult (*)(unsigned, CUpointer_attribute*, void**, CUdeviceptr);

// cuPointerGetAttributes, looked up once through the runtime (no link to the
// driver library), or null where the driver does not give it.
PointerAttributes pointer_attributes() {
  static const PointerAttributes fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &f, 7000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PointerAttributes>(f);
  }();
  return fn;
}

struct Range {
  uint64_t id = 0;
  uintptr_t base = 0;
  size_t size = 0;
  bool ipc = false;
};

// The allocation that holds `p`, as the driver knows it; false where it does
// not (not device memory of this process).
bool range_of(const void* p, Range* r) {
  const PointerAttributes fn = pointer_attributes();
  if (fn == nullptr) return false;
  unsigned long long id = 0;
  CUdeviceptr base = 0;
  size_t size = 0;
  int ipc = 0;
  CUpointer_attribute names[] = {
      CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
      CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  void* values[] = {&id, &base, &size, &ipc};
  if (fn(4, names, values, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS || id == 0)
    return false;
  *r = Range{id, static_cast<uintptr_t>(base), size, ipc != 0};
  return true;
}

// Queued on `stream` (the source, pageable, is staged before this returns).
void copy_to(void* dst, const void* src, size_t bytes, cudaStream_t stream, const char* what) {
  cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), what);
}

// Peer memory read now, on `stream` (a stream of its own: a plain cudaMemcpy
// would wait for every blocking stream's work, other libraries' included).
bool read_from(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
      cudaStreamSynchronize(stream) == cudaSuccess)
    return true;
  cudaGetLastError();
  return false;
}

}  // namespace

UserExports::UserExports(uint8_t* table, int device) : table_(table), device_(device) {}

UserExports::Offer UserExports::offer(const void* p, size_t bytes, cudaStream_t stream,
                                      bool capturing) {
  Range r;
  if (p == nullptr || bytes == 0 || !range_of(p, &r)) return {};
  const auto at = reinterpret_cast<uintptr_t>(p);
  if (at < r.base || at - r.base + bytes > r.size) return {};
  const auto off = static_cast<int64_t>(at - r.base);
  if (const auto pick = slots_.find(r.id))  // (an id names one allocation, its range with it)
    return Offer{pick->gen, static_cast<uint32_t>(pick->slot), off};
  if (capturing || slots_.refused(r.id)) return {};
  cudaIpcMemHandle_t handle;
  if (!r.ipc || cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(r.base)) != cudaSuccess) {
    cudaGetLastError();
    slots_.refuse(r.id);
    MC_LOG(kDebug, "ep: an allocation of ", r.size,
           " bytes cannot be exported (not cudaMalloc's): its dispatches stage their bytes");
    return {};
  }
  OnDevice on(device_);
  const auto pick = slots_.assign(r.id);
  // Its generation 0, the rest, then its generation, each a copy of its own
  // (in stream order, before the launch that offers it): a reader that reads
  // the same non-zero generation before and after the rest has a whole entry.
  uint8_t* entry = table_ + kernels::kXExportBytes * static_cast<size_t>(pick.slot);
  const uint64_t none = 0, gen = pick.gen;
  copy_to(entry, &none, sizeof(none), stream, "writing an export");
  kernels::XExport e{};
  e.size = r.size;
  std::memcpy(e.handle, &handle, sizeof(handle));
  copy_to(entry + sizeof(gen), reinterpret_cast<const uint8_t*>(&e) + sizeof(gen),
          sizeof(e) - sizeof(gen), stream, "writing an export");
  copy_to(entry, &gen, sizeof(gen), stream, "writing an export");
  return Offer{pick.gen, static_cast<uint32_t>(pick.slot), off};
}

UserImports::UserImports(int64_t ranks, int device)
    : ranks_(ranks), device_(device), host_(static_cast<size_t>(ranks) * kernels::kXSlots) {
  OnDevice on(device_);
  dev_ = device_zeros<kernels::XImport>(host_.size(), "cudaMalloc of the import table");
  void* md = nullptr;
  misses_host_ = static_cast<uint64_t*>(mapped_bytes(
      static_cast<size_t>(2 * ranks) * sizeof(uint64_t), &md, "cudaHostAlloc of the misses"));
  misses_dev_ = static_cast<uint64_t*>(md);
}

UserImports::~UserImports() {
  OnDevice on(device_);
  for (kernels::XImport& im : host_) close(im);
  for (kernels::XImport& im : retired_) close(im);
  if (reads_ != nullptr) cudaStreamDestroy(reads_);
  cudaFree(dev_);
  cudaFreeHost(misses_host_);
}

void UserImports::close(kernels::XImport& im) {
  if (im.base != nullptr && cudaIpcCloseMemHandle(const_cast<uint8_t*>(im.base)) != cudaSuccess) {
    cudaGetLastError();
    MC_LOG(kWarn, "ep: cudaIpcCloseMemHandle of a peer's x failed");
  }
  im = kernels::XImport{};
}

int UserImports::mapped() const {
  int n = 0;
  for (const kernels::XImport& im : host_) n += im.base != nullptr;
  return n;
}

void UserImports::resolve(const std::vector<const uint8_t*>& peers, size_t table,
                          LaunchOrder& launches, cudaStream_t stream, bool capturing) {
  if (capturing) return;
  bool any = false;
  for (int64_t i = 0; i < 2 * ranks_ && !any; ++i)
    any = std::atomic_ref<uint64_t>(misses_host_[i]).load(std::memory_order_acquire) != 0;
  if (!any) return;
  OnDevice on(device_);
  std::vector<kernels::XImport> next = host_;
  std::vector<kernels::XImport> closing;
  for (int64_t s = 0; s < ranks_; ++s)
    for (int which = 0; which < 2; ++which) {
      // (a launch still running may record the same miss again: harmless)
      const uint64_t miss = std::atomic_ref<uint64_t>(misses_host_[2 * s + which]).exchange(0);
      const auto slot = static_cast<int64_t>(miss >> 32);
      if (miss == 0 || slot >= kernels::kXSlots || static_cast<size_t>(s) >= peers.size() ||
          peers[s] == nullptr || stale_.count({s, miss}) != 0)
        continue;
      // Its generation, the rest, its generation again: the same twice, a whole entry.
      const uint8_t* entry = peers[s] + table + kernels::kXExportBytes * static_cast<size_t>(slot);
      uint64_t gen = 0, again = 0;
      kernels::XExport e{};
      if (reads_ == nullptr &&
          cudaStreamCreateWithFlags(&reads_, cudaStreamNonBlocking) != cudaSuccess) {
        cudaGetLastError();
        reads_ = nullptr;
        continue;
      }
      if (!read_from(&gen, entry, sizeof(gen), reads_) ||
          !read_from(&e, entry, sizeof(e), reads_) ||
          !read_from(&again, entry, sizeof(again), reads_) || gen == 0 || gen != again ||
          e.gen != gen)
        continue;  // being written: the next miss tries again
      kernels::XImport& im = next[static_cast<size_t>(s * kernels::kXSlots + slot)];
      if (im.gen == static_cast<uint32_t>(gen)) {
        if (stale_.size() >= 256) stale_.clear();  // (bounded: a few graphs' offers)
        stale_.insert({s, miss});  // an older export of the slot: mapping again gives nothing
        continue;
      }
      if (im.base != nullptr) closing.push_back(im);
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, e.handle, sizeof(handle));
      void* base = nullptr;
      if (cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
        cudaGetLastError();
        base = nullptr;  // recorded as such: this rank stages that export's bytes
        MC_LOG(kDebug, "ep: rank ", s, "'s x cannot be mapped here: its rows come staged");
      }
      im = kernels::XImport{static_cast<uint32_t>(gen), 0, static_cast<const uint8_t*>(base),
                            base != nullptr ? e.size : 0};
    }
  if (std::equal(next.begin(), next.end(), host_.begin(), [](const auto& a, const auto& b) {
        return a.gen == b.gen && a.base == b.base && a.size == b.size;
      }))
    return;
  // No eager launch of ours reads the table while it changes (the last has
  // run), and the next reads the new one (queued before it). A replaced
  // mapping is closed at the next change, after that wait again: a graph's
  // replay the caller queued before this call has had the time between (the
  // caller orders replays against eager calls, LaunchOrder).
  launches.wait_eager();
  for (kernels::XImport& im : retired_) close(im);
  retired_ = std::move(closing);
  host_ = std::move(next);
  copy_to(dev_, host_.data(), host_.size() * sizeof(kernels::XImport), stream,
          "copying the import table");
}

void UserImports::forget() {
  OnDevice on(device_);
  for (kernels::XImport& im : host_) close(im);
  for (kernels::XImport& im : retired_) close(im);
  retired_.clear();
  for (int64_t i = 0; i < 2 * ranks_; ++i) std::atomic_ref<uint64_t>(misses_host_[i]).store(0);
  stale_.clear();
  cuda_check(cudaMemcpy(dev_, host_.data(), host_.size() * sizeof(kernels::XImport),
                        cudaMemcpyHostToDevice),
             "copying the import table");
  cuda_check(cudaDeviceSynchronize(), "copying the import table");
}

}  // namespace mooncake
