// The group view: which slots of [0, capacity) are active, which process
// (incarnation) holds each slot, and the epoch, bumped by every membership
// change. Every member of one epoch holds the same view.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/limits.h"

namespace mooncake {

struct View {
  uint64_t epoch = 0;
  // The sequence number of the last collective before this view took effect;
  // a joining process continues the numbering from here.
  uint64_t seq = 0;
  std::vector<uint8_t> active;        // [capacity], 1 = member
  std::vector<uint32_t> incarnation;  // [capacity]: 0 for the first process, +1 per rejoin
  // [capacity]: the epoch at which the slot's collective channels last
  // restarted: every member's at a failure (abandoned ops leave messages
  // behind), only a newcomer's when one is admitted (the others' channels
  // may still hold the admitting op's last messages).
  std::vector<uint64_t> since;

  // Slots [0, size) active in a group of `capacity` slots, epoch 0.
  static View initial(int size, int capacity);

  int capacity() const { return static_cast<int>(active.size()); }
  bool is_member(int slot) const {
    return slot >= 0 && slot < capacity() && active[static_cast<size_t>(slot)] != 0;
  }
  // The active slots in increasing order.
  std::vector<int> members() const;
  int num_members() const;

  // The generation that tags the collective-plane flags between two slots:
  // a channel restarts from zero when it changes, and ignores older writes.
  uint64_t collective_gen(int a, int b) const {
    return std::max(since[static_cast<size_t>(a)], since[static_cast<size_t>(b)]) + 1;
  }
  // The generation of the p2p edge between two slots: it changes only when
  // one of them gets a new process, so p2p between survivors goes on.
  uint64_t p2p_gen(int a, int b) const {
    return uint64_t{incarnation[static_cast<size_t>(a)]} + incarnation[static_cast<size_t>(b)] + 1;
  }

  friend bool operator==(const View&, const View&) = default;
  std::string encode() const;
  // Throws an Error (kInternal) naming the field when `text` is not a whole,
  // well-formed view; `where` (e.g. " under 'key'") goes into the message.
  static View decode(const std::string& text, const std::string& where = "");
  // "{0,1,3}"
  std::string describe() const;
};

}  // namespace mooncake
