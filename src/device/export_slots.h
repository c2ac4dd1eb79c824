// Which of a few export slots an allocation of the caller's takes, and the
// generation that tells its export from an earlier one in the same slot
// (device/user_memory.h). Torch-free and CUDA-free, so the CPU tests cover it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace mooncake {

template <int kSlots>
class ExportSlots {
 public:
  struct Pick {
    int slot = 0;
    uint32_t gen = 0;
  };

  // The slot that exports allocation `id` (the driver's buffer id: unique in
  // the process, so an allocation freed and made again at the same address
  // is another one), or nullopt.
  std::optional<Pick> find(uint64_t id) {
    for (int i = 0; i < kSlots; ++i)
      if (slots_[i].gen != 0 && slots_[i].id == id) {
        slots_[i].used = ++tick_;
        return Pick{i, slots_[i].gen};
      }
    return std::nullopt;
  }

  // A slot for `id`: an empty one, else the least recently used (its
  // export's readers see the new generation and map again).
  Pick assign(uint64_t id) {
    int best = 0;
    for (int i = 0; i < kSlots; ++i) {
      if (slots_[i].gen == 0) {
        best = i;
        break;
      }
      if (slots_[i].used < slots_[best].used) best = i;
    }
    if (++gen_ == 0) gen_ = 1;  // 0 says "empty"
    slots_[best] = Slot{id, gen_, ++tick_};
    return Pick{best, gen_};
  }

  // An allocation that cannot be exported (not made by cudaMalloc, e.g.
  // torch's expandable segments): remembered, so that later calls do not ask
  // the driver for a handle again.
  void refuse(uint64_t id) {
    refused_[next_refused_] = id;
    next_refused_ = (next_refused_ + 1) % refused_.size();
  }
  bool refused(uint64_t id) const {
    for (uint64_t r : refused_)
      if (r == id && id != 0) return true;
    return false;
  }

 private:
  struct Slot {
    uint64_t id = 0;
    uint32_t gen = 0;  // 0: empty
    uint64_t used = 0;
  };
  std::array<Slot, kSlots> slots_{};
  std::array<uint64_t, 8> refused_{};
  size_t next_refused_ = 0;
  uint32_t gen_ = 0;
  uint64_t tick_ = 0;
};

}  // namespace mooncake
