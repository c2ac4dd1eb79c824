// The elastic EP buffer's slot table (upstream's elastic EP buffer design):
// a capacity fixed when the buffer is allocated, one slot per logical rank,
// and per slot a connection state. Torch-free, so that the portable path and
// a device path share the same state.
//
//   disconnected --connect(activate=false)--> staged --set_masked(false)--> active
//        ^                                     |  ^                          |
//        +-------------- disconnect -----------+  +-- set_masked(true) ------+
//                                                 +-- mark_failed -----------+
//
// A staged slot is connected (its connection resources are reserved) but
// masked: no traffic goes to or comes from it. A slot's generation grows with
// every connect, so a replacement that reconnects into the same slot (after a
// disconnect) is told apart from the process it replaces. This rank's own
// slot is active from the start and cannot be connected, masked or
// disconnected. Every method takes a lock: operations on one table are
// serialised.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace mooncake {

enum class SlotState : uint8_t { kDisconnected, kStaged, kActive };

const char* slot_state_name(SlotState s);

class SlotTable {
 public:
  // Throws an invalid-argument Error unless 1 <= capacity and 0 <= self < capacity.
  SlotTable(int self, int capacity);

  int self() const { return self_; }
  int capacity() const { return capacity_; }

  // Stages `slot` (activate = false) or makes it active at once. Throws an
  // invalid-argument Error for this rank's own slot, a slot out of range, or
  // one that is already connected (disconnect it first to replace it).
  void connect(int slot, bool activate);
  // masked = false publishes a staged slot (it becomes active); masked = true
  // masks an active one (it stays connected). Idempotent for a slot already
  // in the asked state. Throws for a disconnected slot, out of range, or self.
  void set_masked(int slot, bool masked);
  // Releases a connected slot. Throws for a disconnected slot, out of range,
  // or self.
  void disconnect(int slot);
  // A receive from `slot` timed out: it is masked (staged), not disconnected.
  // Returns false when it was not active (nothing changed).
  bool mark_failed(int slot);

  SlotState state(int slot) const;
  bool active(int slot) const { return state(slot) == SlotState::kActive; }
  uint64_t generation(int slot) const;
  // The slots a dispatch covers: the highest active slot + 1 (at least
  // self + 1), which may be below the capacity.
  int rank_bound() const;
  int num_active() const;
  std::vector<int> active_slots() const;
  // Writes 1 (masked: staged or disconnected) or 0 (active) for every slot
  // into out[0, capacity). Throws when n != capacity.
  void query_mask(int32_t* out, size_t n) const;
  // "0:A 1:S 2:- ..." for messages and logs.
  std::string describe() const;

 private:
  void check_peer(int slot, const char* what) const;  // in range and not self

  const int self_;
  const int capacity_;
  mutable std::mutex mu_;
  std::vector<SlotState> state_;
  std::vector<uint64_t> generation_;
};

}  // namespace mooncake
