#include "transport/loss_times.h"

#include "core/clock.h"
#include "core/error.h"

namespace mooncake {

namespace {
// Checked before the arrays are sized by it.
int positive_capacity(int capacity) {
  MC_CHECK_ARG(capacity > 0, "LossTimes: capacity must be positive, got ", capacity);
  return capacity;
}
}  // namespace

LossTimes::LossTimes(int capacity)
    : capacity_(positive_capacity(capacity)),
      gone_(new std::atomic<int64_t>[static_cast<size_t>(capacity_)]()),
      silent_(new std::atomic<int64_t>[static_cast<size_t>(capacity_)]()) {}

Endpoint::LossListener LossTimes::listener() {
  return [self = weak_from_this()](int peer, Endpoint::PeerLoss why) {
    const auto times = self.lock();
    if (!times) return false;  // nobody reads them any more: stop watching
    times->heard(peer, why);
    return true;
  };
}

void LossTimes::heard(int peer, Endpoint::PeerLoss why) {
  if (peer < 0 || peer >= capacity_) return;  // a slot past what the reader asked for
  const int64_t now = now_us();
  if (why == Endpoint::PeerLoss::kGone) gone_[peer].store(now, std::memory_order_release);
  if (why == Endpoint::PeerLoss::kSilent) silent_[peer].store(now, std::memory_order_release);
}

namespace {

std::optional<int64_t> stamp_or_none(const std::atomic<int64_t>& t) {
  const int64_t v = t.load(std::memory_order_acquire);
  return v != 0 ? std::optional<int64_t>(v) : std::nullopt;
}

}  // namespace

std::optional<int64_t> LossTimes::gone_us(int peer) const {
  MC_CHECK_ARG(peer >= 0 && peer < capacity_, "gone_at: peer must be in [0, ", capacity_, "), got ",
               peer);
  return stamp_or_none(gone_[peer]);
}

std::optional<int64_t> LossTimes::silent_us(int peer) const {
  MC_CHECK_ARG(peer >= 0 && peer < capacity_, "silent_at: peer must be in [0, ", capacity_,
               "), got ", peer);
  return stamp_or_none(silent_[peer]);
}

}  // namespace mooncake
