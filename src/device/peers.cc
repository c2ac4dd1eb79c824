#include "device/peers.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/host.h"
#include "device/cuda.h"

namespace mooncake {

std::string host_identity() {
  return boot_id() + "/" + net_namespace();
}

namespace {

// An encoded card: | handle | 1 (present) | then boot id, namespace and bus id,
// each a length byte and up to kFieldMax bytes |.
constexpr size_t kPresentAt = kIpcHandleBytes;
constexpr size_t kFieldMax = 60;
constexpr size_t kBootAt = kPresentAt + 1;
constexpr size_t kNetnsAt = kBootAt + 1 + kFieldMax;
constexpr size_t kBusAt = kNetnsAt + 1 + kFieldMax;
static_assert(kBusAt + 1 + kFieldMax <= PeerCard::kBytes);

void put(std::string& out, size_t at, size_t max, const std::string& s) {
  MC_ASSERT(s.size() <= max, "a card field of ", s.size(), " bytes");
  out[at] = static_cast<char>(s.size());
  std::memcpy(out.data() + at + 1, s.data(), s.size());
}

std::optional<std::string> take(std::string_view in, size_t at, size_t max) {
  const auto n = static_cast<uint8_t>(in[at]);
  if (n > max) return std::nullopt;
  return std::string(in.substr(at + 1, n));
}

}  // namespace

PeerCard PeerCard::of(const DeviceSegment& segment) {
  return PeerCard{segment.handle(), boot_id(), net_namespace(), device_bus_id(segment.device())};
}

std::string PeerCard::encode() const {
  std::string out(kBytes, '\0');
  MC_ASSERT(handle.size() == kIpcHandleBytes);
  std::memcpy(out.data(), handle.data(), handle.size());
  out[kPresentAt] = 1;
  put(out, kBootAt, kFieldMax, boot);
  put(out, kNetnsAt, kFieldMax, netns);
  put(out, kBusAt, kFieldMax, bus_id);
  return out;
}

std::optional<PeerCard> PeerCard::decode(std::string_view in) {
  if (in.size() != kBytes || in[kPresentAt] != 1) return std::nullopt;
  auto boot = take(in, kBootAt, kFieldMax);
  auto netns = take(in, kNetnsAt, kFieldMax);
  auto bus = take(in, kBusAt, kFieldMax);
  if (!boot || !netns || !bus) return std::nullopt;
  return PeerCard{std::string(in.substr(0, kIpcHandleBytes)), *boot, *netns, *bus};
}

int gpu_sharers(const PeerCard& mine, const std::vector<std::optional<PeerCard>>& cards) {
  int n = 0;
  bool self = false;
  for (const auto& c : cards) {
    if (!c || !mine.same_gpu(*c)) continue;
    ++n;
    self = self || c->handle == mine.handle;
  }
  return self ? n : n + 1;
}

PeerDirectory::PeerDirectory(Store& store, std::string prefix, int device)
    : store_(store), prefix_(std::move(prefix)), device_(device) {}

void PeerDirectory::publish_host(int slot) {
  store_.set(prefix_ + "cuda/host/" + std::to_string(slot), host_identity());
}

bool PeerDirectory::all_on_this_host(int n, int64_t timeout_ms) {
  const std::string mine = host_identity();
  for (int r = 0; r < n; ++r)
    if (store_.get(prefix_ + "cuda/host/" + std::to_string(r), timeout_ms) != mine) return false;
  return true;
}

std::string PeerDirectory::key(int slot, uint32_t incarnation) const {
  return prefix_ + "cuda/seg/" + std::to_string(slot) + "/" + std::to_string(incarnation);
}

void PeerDirectory::publish(int slot, uint32_t incarnation, const PeerCard& card) {
  store_.set(key(slot, incarnation), card.encode());
}

const uint8_t* PeerDirectory::map(int slot, uint32_t incarnation, int64_t timeout_ms) {
  Peer& peer = peers_[slot];
  if (!peer.mapping || peer.incarnation != incarnation) {  // a process not mapped yet
    peer.mapping.reset();
    const auto card = PeerCard::decode(store_.get(key(slot, incarnation), timeout_ms));
    if (!card || !card->on_this_host())
      throw_error(ErrorKind::kPeerFailed, slot, "device: rank ", slot,
                  "'s segment cannot be mapped from this host");
    peer.mapping = std::make_unique<PeerMapping>(card->handle, device_);
    peer.incarnation = incarnation;
  }
  return peer.mapping->data();
}

}  // namespace mooncake
