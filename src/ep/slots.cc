#include "ep/slots.h"

#include <algorithm>

#include "core/error.h"

namespace mooncake {

const char* slot_state_name(SlotState s) {
  switch (s) {
    case SlotState::kDisconnected: return "disconnected";
    case SlotState::kStaged: return "staged";
    case SlotState::kActive: return "active";
  }
  return "?";
}

SlotTable::SlotTable(int self, int capacity)
    : self_(self),
      capacity_(capacity),
      state_(static_cast<size_t>(std::max(capacity, 0)), SlotState::kDisconnected),
      generation_(static_cast<size_t>(std::max(capacity, 0)), 0) {
  MC_CHECK_ARG(capacity >= 1, "update_memory_buffers: num_ranks (the capacity) must be >= 1, got ",
               capacity);
  MC_CHECK_ARG(self >= 0 && self < capacity, "update_memory_buffers: this rank (", self,
               ") must be below the capacity (", capacity, ")");
  state_[static_cast<size_t>(self)] = SlotState::kActive;
}

void SlotTable::check_peer(int slot, const char* what) const {
  MC_CHECK_ARG(slot >= 0 && slot < capacity_, what, ": rank ", slot,
               " is outside the capacity [0, ", capacity_, ")");
  MC_CHECK_ARG(slot != self_, what, ": rank ", slot, " is this rank itself");
}

void SlotTable::connect(int slot, bool activate) {
  std::lock_guard<std::mutex> lock(mu_);
  check_peer(slot, "connect_ranks");
  SlotState& s = state_[static_cast<size_t>(slot)];
  MC_CHECK_ARG(s == SlotState::kDisconnected, "connect_ranks: rank ", slot, " is already ",
               slot_state_name(s), "; call disconnect_ranks first to replace it");
  s = activate ? SlotState::kActive : SlotState::kStaged;
  ++generation_[static_cast<size_t>(slot)];
}

void SlotTable::set_masked(int slot, bool masked) {
  std::lock_guard<std::mutex> lock(mu_);
  check_peer(slot, "update_mask_buffer");
  SlotState& s = state_[static_cast<size_t>(slot)];
  MC_CHECK_ARG(s != SlotState::kDisconnected, "update_mask_buffer: rank ", slot,
               " is not connected; call connect_ranks first");
  s = masked ? SlotState::kStaged : SlotState::kActive;
}

void SlotTable::disconnect(int slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_peer(slot, "disconnect_ranks");
  SlotState& s = state_[static_cast<size_t>(slot)];
  MC_CHECK_ARG(s != SlotState::kDisconnected, "disconnect_ranks: rank ", slot, " is not connected");
  s = SlotState::kDisconnected;
}

bool SlotTable::mark_failed(int slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_peer(slot, "mark_failed");
  SlotState& s = state_[static_cast<size_t>(slot)];
  if (s != SlotState::kActive) return false;
  s = SlotState::kStaged;
  return true;
}

SlotState SlotTable::state(int slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  MC_CHECK_ARG(slot >= 0 && slot < capacity_, "rank ", slot, " is outside the capacity [0, ",
               capacity_, ")");
  return state_[static_cast<size_t>(slot)];
}

uint64_t SlotTable::generation(int slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  MC_CHECK_ARG(slot >= 0 && slot < capacity_, "rank ", slot, " is outside the capacity [0, ",
               capacity_, ")");
  return generation_[static_cast<size_t>(slot)];
}

int SlotTable::rank_bound() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (int q = capacity_ - 1; q >= 0; --q)
    if (state_[static_cast<size_t>(q)] == SlotState::kActive) return q + 1;
  return self_ + 1;  // unreachable: this rank's own slot is always active
}

int SlotTable::num_active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(std::count(state_.begin(), state_.end(), SlotState::kActive));
}

std::vector<int> SlotTable::active_slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (int q = 0; q < capacity_; ++q)
    if (state_[static_cast<size_t>(q)] == SlotState::kActive) out.push_back(q);
  return out;
}

void SlotTable::query_mask(int32_t* out, size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  MC_CHECK_ARG(n == static_cast<size_t>(capacity_), "query_mask_buffer: the output must have ",
               capacity_, " entries (the capacity), got ", n);
  for (size_t q = 0; q < n; ++q) out[q] = state_[q] == SlotState::kActive ? 0 : 1;
}

std::string SlotTable::describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string s;
  for (int q = 0; q < capacity_; ++q) {
    if (q) s += ' ';
    const SlotState st = state_[static_cast<size_t>(q)];
    s += std::to_string(q) + ":" +
         (st == SlotState::kActive   ? "A"
          : st == SlotState::kStaged ? "S"
                                     : "-");
  }
  return s;
}

}  // namespace mooncake
