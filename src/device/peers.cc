#include "device/peers.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/error.h"
#include "core/host.h"
#include "device/cuda.h"

namespace mooncake {

std::string host_identity() {
  return boot_id() + "/" + net_namespace();
}

namespace {

// An encoded card: | handle | 1 (present) | then boot id, namespace, bus id
// and pid namespace, each a length byte and up to kFieldMax bytes | then the
// life page: pid, fd (int32 each), nonce (uint64), in this host's byte order |.
// (A boot id has 36 characters; a namespace such as "net:[4026531840]" and a
// bus id such as "00000000:19:00.0", 16.)
constexpr size_t kPresentAt = kIpcHandleBytes;
constexpr size_t kFieldMax = 40;
constexpr size_t kBootAt = kPresentAt + 1;
constexpr size_t kNetnsAt = kBootAt + 1 + kFieldMax;
constexpr size_t kBusAt = kNetnsAt + 1 + kFieldMax;
constexpr size_t kPidnsAt = kBusAt + 1 + kFieldMax;
constexpr size_t kLifeAt = kPidnsAt + 1 + kFieldMax;
// The life page's fields as LifeRef lays them out, with no padding.
static_assert(sizeof(LifeRef) == 16 && std::is_trivially_copyable_v<LifeRef>);
static_assert(kLifeAt + sizeof(LifeRef) <= PeerCard::kBytes);

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
  return PeerCard{segment.handle(), boot_id(),     net_namespace(), device_bus_id(segment.device()),
                  pid_namespace(),  process_life()};
}

LifeRef PeerCard::life_here() const {
  return on_this_host() && pidns == pid_namespace() ? life : LifeRef{};
}

std::string PeerCard::encode() const {
  std::string out(kBytes, '\0');
  MC_ASSERT(handle.size() == kIpcHandleBytes);
  std::memcpy(out.data(), handle.data(), handle.size());
  out[kPresentAt] = 1;
  put(out, kBootAt, kFieldMax, boot);
  put(out, kNetnsAt, kFieldMax, netns);
  put(out, kBusAt, kFieldMax, bus_id);
  put(out, kPidnsAt, kFieldMax, pidns);
  std::memcpy(out.data() + kLifeAt, &life, sizeof(LifeRef));
  return out;
}

std::optional<PeerCard> PeerCard::decode(std::string_view in) {
  if (in.size() != kBytes || in[kPresentAt] != 1) return std::nullopt;
  auto boot = take(in, kBootAt, kFieldMax);
  auto netns = take(in, kNetnsAt, kFieldMax);
  auto bus = take(in, kBusAt, kFieldMax);
  auto pidns = take(in, kPidnsAt, kFieldMax);
  if (!boot || !netns || !bus || !pidns) return std::nullopt;
  LifeRef life;
  std::memcpy(&life, in.data() + kLifeAt, sizeof(LifeRef));
  return PeerCard{std::string(in.substr(0, kIpcHandleBytes)), *boot, *netns, *bus, *pidns, life};
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

GpuRecord GpuRecord::of(int device) {
  GpuRecord r{host_identity(), device_bus_id(device), {}};
  int n = 0;
  cuda_check(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  for (int d = 0; d < n; ++d) {
    if (d == device) continue;
    int can = 0;
    cuda_check(cudaDeviceCanAccessPeer(&can, device, d), "cudaDeviceCanAccessPeer");
    if (can != 0) r.reaches.push_back(device_bus_id(d));
  }
  return r;
}

// | host | \n | bus id | \n | the bus ids it reaches, comma-separated |: none of
// them holds either separator.
std::string GpuRecord::encode() const {
  std::string out = host + "\n" + bus_id + "\n";
  for (size_t i = 0; i < reaches.size(); ++i) out += (i > 0 ? "," : "") + reaches[i];
  return out;
}

std::optional<GpuRecord> GpuRecord::decode(std::string_view in) {
  const size_t a = in.find('\n');
  const size_t b = a == std::string_view::npos ? a : in.find('\n', a + 1);
  if (b == std::string_view::npos || in.find('\n', b + 1) != std::string_view::npos)
    return std::nullopt;
  GpuRecord r{std::string(in.substr(0, a)), std::string(in.substr(a + 1, b - a - 1)), {}};
  for (std::string_view rest = in.substr(b + 1); !rest.empty();) {
    const size_t comma = std::min(rest.find(','), rest.size());
    r.reaches.emplace_back(rest.substr(0, comma));
    rest.remove_prefix(std::min(comma + 1, rest.size()));
  }
  return r;
}

Reach judge_reach(const std::vector<std::optional<GpuRecord>>& records, int me) {
  Reach out;
  MC_ASSERT(me >= 0 && static_cast<size_t>(me) < records.size(), "rank ", me, " of ",
            records.size());
  const auto& mine = records[static_cast<size_t>(me)];
  out.same_host = mine && std::all_of(records.begin(), records.end(),
                                      [&](const auto& r) { return r && r->host == mine->host; });
  if (!out.same_host) return out;
  out.gpu_sharers = static_cast<int>(std::count_if(
      records.begin(), records.end(), [&](const auto& r) { return r->bus_id == mine->bus_id; }));
  auto reaches = [](const GpuRecord& from, const GpuRecord& to) {
    return std::find(from.reaches.begin(), from.reaches.end(), to.bus_id) != from.reaches.end();
  };
  // The first pair in rank order, so that every rank names the same one.
  for (size_t a = 0; a < records.size(); ++a)
    for (size_t b = a + 1; b < records.size(); ++b) {
      const GpuRecord &ra = *records[a], &rb = *records[b];
      if (ra.bus_id == rb.bus_id || (reaches(ra, rb) && reaches(rb, ra))) continue;
      const bool ab = reaches(ra, rb);
      out.no_peer_access =
          str("rank ", ab ? b : a, "'s GPU (", ab ? rb.bus_id : ra.bus_id,
              ") has no peer access to rank ", ab ? a : b, "'s GPU (", ab ? ra.bus_id : rb.bus_id,
              ") or does not see it (CUDA_VISIBLE_DEVICES), so it cannot map "
              "that rank's device memory");
      return out;
    }
  return out;
}

PeerDirectory::PeerDirectory(Store& store, std::string prefix, int device)
    : store_(store), prefix_(std::move(prefix)), device_(device) {}

void PeerDirectory::publish_host(int slot) {
  store_.set(prefix_ + "cuda/host/" + std::to_string(slot), GpuRecord::of(device_).encode());
}

Reach PeerDirectory::reach(int n, int slot, int64_t timeout_ms) {
  const std::string host = host_identity();
  std::vector<std::optional<GpuRecord>> records;
  for (int r = 0; r < n; ++r) {
    auto record =
        GpuRecord::decode(store_.get(prefix_ + "cuda/host/" + std::to_string(r), timeout_ms));
    if (!record || record->host != host) return Reach{};  // no need to wait for the rest
    records.push_back(std::move(record));
  }
  return judge_reach(records, slot);
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
    peer.life = card->life_here();
  }
  return peer.mapping->data();
}

LifeRef PeerDirectory::life(int slot) const {
  const auto it = peers_.find(slot);
  return it != peers_.end() && it->second.mapping ? it->second.life : LifeRef{};
}

}  // namespace mooncake
