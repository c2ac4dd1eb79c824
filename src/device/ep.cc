#include "device/ep.h"

#include <algorithm>
#include <atomic>
#include <optional>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "device/cuda.h"

namespace mooncake {

namespace k = kernels;

// A peer's life page, mapped here and registered with the GPU (mapped: the
// kernels read it over the bus, as they read the host's words).
struct LostWords::LifePage {
  explicit LifePage(const LifeRef& ref) : view(ref) {
    cudaError_t err = cudaHostRegister(view.page(), kLifePageBytes, cudaHostRegisterMapped);
    void* d = nullptr;
    if (err == cudaSuccess) {
      err = cudaHostGetDevicePointer(&d, view.page(), 0);
      if (err != cudaSuccess) cudaHostUnregister(view.page());
    }
    if (err != cudaSuccess) {
      // Refused (the host's word serves instead): not left for the next
      // launch's error check to find.
      cudaGetLastError();
      cuda_check(err, "registering a peer's life page with the GPU");
    }
    dev = reinterpret_cast<uint64_t>(d);
  }
  ~LifePage() {
    if (cudaHostUnregister(view.page()) != cudaSuccess) cudaGetLastError();
  }
  LifePage(const LifePage&) = delete;
  LifePage& operator=(const LifePage&) = delete;

  LifeView view;
  uint64_t dev = 0;
};

LostWords::LostWords(int64_t n, int device) : device_(device), n_(n) {
  lives_.resize(static_cast<size_t>(std::max<int64_t>(n, 0)));
  OnDevice on(device);
  host_ = mapped_words(std::max<int64_t>(n, 1), &dev_, "cudaHostAlloc of the lost-rank words");
  void* life_dev = nullptr;
  try {
    life_host_ = static_cast<uint64_t*>(
        mapped_bytes(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(uint64_t), &life_dev,
                     "cudaHostAlloc of the life-page addresses"));
  } catch (...) {
    cudaFreeHost(host_);
    throw;
  }
  life_dev_ = static_cast<uint64_t*>(life_dev);
  const size_t bytes = static_cast<size_t>(n + 1) * sizeof(uint64_t);
  cudaError_t err = cudaMalloc(&seen_, bytes);
  if (err == cudaSuccess) err = cudaMemset(seen_, 0, bytes);
  // Zeroed before any kernel reads it: launches on non-blocking streams do not
  // wait for the legacy stream's memset.
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaFree(seen_);
    cudaFreeHost(host_);
    cudaFreeHost(life_host_);
    cuda_check(err, "cudaMalloc of the lost-rank words' device copy");
  }
}

LostWords::~LostWords() {
  // On the buffer's device: the last owner may be a transport's thread, where
  // another device is current. (Nothing here may throw.)
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                        cudaSetDevice(device_) == cudaSuccess;
  lives_.clear();
  retired_.clear();
  cudaFree(seen_);
  cudaFreeHost(host_);
  cudaFreeHost(life_host_);
  if (switched) cudaSetDevice(previous);
}

void LostWords::watch_life(int64_t rank, const LifeRef& ref) {
  if (rank < 0 || rank >= n_) return;
  std::unique_ptr<LifePage> page;
  if (ref.valid() && env_int("MOONCAKE_DEVICE_LIFE_PAGES") != 0) {
    OnDevice on(device_);
    try {
      page = std::make_unique<LifePage>(ref);
    } catch (const Error& e) {
      // Gone already (the host's word will say so), or the GPU refused the
      // page: the host's word alone, as before.
      // A refusal of the GPU's is said once per process (it would repeat for every peer).
      static std::atomic<bool> warned{false};
      if (e.kind() != ErrorKind::kPeerFailed && !warned.exchange(true))
        MC_LOG(kWarn, "rank ", rank, "'s life page is not read by the kernels: ", e.what());
      else
        MC_LOG(kDebug, "rank ", rank, "'s life page is not read by the kernels: ", e.what());
    }
  }
  std::atomic_ref<uint64_t>(life_host_[rank]).store(page ? page->dev : 0);
  auto& slot = lives_[static_cast<size_t>(rank)];
  if (slot) retired_.push_back(std::move(slot));
  slot = std::move(page);
}

void LostWords::settle() {
  OnDevice on(device_);
  retired_.clear();
}

bool LostWords::has_life(int64_t rank) const {
  return rank >= 0 && rank < n_ && lives_[static_cast<size_t>(rank)] != nullptr;
}

void LostWords::set(int64_t rank, Word w) {
  if (rank >= 0 && rank < n_) std::atomic_ref<int32_t>(host_[rank]).store(w);
}

void LostWords::clear(int64_t rank, Word only) {
  if (rank < 0 || rank >= n_) return;
  int32_t expected = only;
  std::atomic_ref<int32_t> word(host_[rank]);
  if (only == kClear)
    word.store(kClear);
  else
    word.compare_exchange_strong(expected, kClear);
}

void LostWords::renew() {
  generation_.fetch_add(1, std::memory_order_acq_rel);
  for (int64_t r = 0; r < n_; ++r) {
    clear(r);
    watch_life(r, LifeRef{});
  }
}

LostWords::Word LostWords::get(int64_t rank) const {
  if (rank < 0 || rank >= n_) return kClear;
  return static_cast<Word>(std::atomic_ref<int32_t>(host_[rank]).load());
}

Endpoint::LossListener set_lost(std::weak_ptr<LostWords> lost) {
  const auto now = lost.lock();
  const uint64_t gen = now ? now->generation() : 0;
  return [lost = std::move(lost), gen](int peer, Endpoint::PeerLoss why) {
    const auto words = lost.lock();
    if (!words || words->generation() != gen) return false;
    switch (why) {
      case Endpoint::PeerLoss::kGone: words->set(peer, LostWords::kGone); break;
      case Endpoint::PeerLoss::kSilent:
        if (words->get(peer) != LostWords::kGone) words->set(peer, LostWords::kSilent);
        break;
      case Endpoint::PeerLoss::kBack: words->clear(peer, LostWords::kSilent); break;
    }
    return true;
  };
}

uint64_t watch_lost(Endpoint& endpoint, std::weak_ptr<LostWords> lost, int64_t hang_ms) {
  return endpoint.watch_peers(set_lost(std::move(lost)), hang_ms);
}

EpBuffer::EpBuffer(size_t bytes, int device)
    : device_(device), bytes_(bytes), workspace_(bytes + kControlBytes, device) {
  OnDevice on(device_);
  mine_ = PeerCard::of(workspace_);
  card_ = mine_.encode();
  status_host_ = mapped_words(k::kStatusWords, &status_dev_, "cudaHostAlloc of the status words");
  grid_sync_ = device_zeros<uint32_t>(2, "cudaMalloc of the grid barrier");
  sm_count_ = device_sm_count(device_);
  num_blocks_ = sm_count_;
}

EpBuffer::~EpBuffer() {
  OnDevice on(device_);
  cudaDeviceSynchronize();  // no kernel may still use the peers' mappings
  maps_.clear();
  if (peers_ != nullptr) cudaFree(peers_);
  if (keys_ != nullptr) cudaFree(keys_);
  if (fence_stream_ != nullptr) cudaStreamDestroy(fence_stream_);
  if (silent_ != nullptr) cudaFreeHost(silent_);
  cudaFree(grid_sync_);
  cudaFreeHost(status_host_);
}

bool EpBuffer::shares_gpu(const std::string& encoded) const {
  const auto card = PeerCard::decode(encoded);
  return card && mine_.same_gpu(*card);
}

void EpBuffer::share_gpu(int processes) {
  num_blocks_ = std::max(1, sm_count_ / std::max(1, processes));
}

void EpBuffer::reserve(int64_t capacity, int64_t rank, uint32_t key) {
  MC_CHECK_ARG(capacity >= 1 && rank >= 0 && rank < capacity, "reserve: rank ", rank,
               " is outside [0, ", capacity, ")");
  OnDevice on(device_);
  cuda_check(cudaDeviceSynchronize(), "waiting for the device before remapping");
  maps_.clear();
  maps_.resize(static_cast<size_t>(capacity));
  cards_.assign(static_cast<size_t>(capacity), std::string());
  table_.assign(static_cast<size_t>(capacity), nullptr);
  table_[static_cast<size_t>(rank)] = workspace();
  keys_host_.assign(static_cast<size_t>(capacity), key);
  if (peers_ != nullptr && capacity == num_ranks_) {
    // The same size (a group's members changed): the same device words, so that a
    // CUDA graph captured before, whose launches hold their addresses, stays valid.
    std::fill(silent_, silent_ + capacity, 0);
    lost_->renew();   // the caller watches again, told of the peers lost so far
    lost_->settle();  // (the device is idle)
  } else {
    if (peers_ != nullptr) cudaFree(peers_);
    peers_ = nullptr;
    cuda_check(cudaMalloc(&peers_, capacity * sizeof(uint8_t*)), "cudaMalloc of the peer table");
    if (keys_ != nullptr) cudaFree(keys_);
    keys_ = nullptr;
    cuda_check(cudaMalloc(&keys_, capacity * sizeof(uint32_t)), "cudaMalloc of the fence keys");
    if (silent_ != nullptr) cudaFreeHost(silent_);
    silent_ = nullptr;
    silent_ = mapped_words(capacity, &silent_dev_, "cudaHostAlloc of the silent-rank words");
    lost_ = std::make_shared<LostWords>(capacity, device_);
  }
  num_ranks_ = capacity;
  rank_ = rank;
  write_table(0, capacity);
  write_keys(0, capacity);
}

EpBuffer::Connection EpBuffer::connect(const std::vector<std::string>& cards, int64_t rank,
                                       uint32_t key) {
  const auto R = static_cast<int64_t>(cards.size());
  MC_CHECK_ARG(rank >= 0 && rank < R, "connect: rank ", rank, " is outside [0, ", R, ")");
  // A process mapped here whose rank now has another card, or none, left the
  // group: fenced before its mapping goes (its late kernels stop storing here).
  for (int64_t r = 0; r < num_ranks_; ++r)
    if (maps_[r] != nullptr && (r >= R || cards[r] != cards_[r])) fence_peer(r);
  reserve(R, rank, key);
  std::vector<std::optional<PeerCard>> decoded;
  decoded.reserve(cards.size());
  for (const std::string& c : cards) decoded.push_back(PeerCard::decode(c));
  Connection out{std::vector<bool>(static_cast<size_t>(R), false),
                 std::vector<bool>(static_cast<size_t>(R), false)};
  out.reachable[rank] = out.present[rank] = true;
  for (int64_t r = 0; r < R; ++r) {
    if (r == rank || !decoded[r]) continue;
    out.present[r] = true;
    if (!map_peer(r, cards[r], key)) continue;
    table_[r] = maps_[r]->data() + kControlBytes;
    out.reachable[r] = true;
  }
  write_table(0, R);
  share_gpu(gpu_sharers(mine_, decoded));
  return out;
}

bool EpBuffer::map_peer(int64_t slot, const std::string& encoded, uint32_t key) {
  check_peer_slot(slot, "map_peer");
  MC_CHECK_ARG(maps_[slot] == nullptr, "map_peer: slot ", slot, " is mapped already");
  const auto card = PeerCard::decode(encoded);
  if (!card || !card->on_this_host()) return false;
  OnDevice on(device_);
  try {
    maps_[slot] = std::make_unique<PeerMapping>(card->handle, device_);
    cards_[slot] = encoded;
    keys_host_[slot] = key;  // in force once published
    lost_->clear(slot);      // a new process in the slot
    lost_->watch_life(slot, card->life_here());
    return true;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kPeerFailed) throw;
    return false;
  }
}

void EpBuffer::publish_peer(int64_t slot) {
  check_peer_slot(slot, "publish_peer");
  MC_CHECK_ARG(maps_[slot] != nullptr, "publish_peer: slot ", slot, " is not mapped");
  OnDevice on(device_);
  cuda_check(cudaDeviceSynchronize(), "waiting for the device before publishing a peer");
  lost_->settle();
  table_[slot] = maps_[slot]->data() + kControlBytes;
  write_table(slot, 1);
  write_keys(slot, 1);
}

void EpBuffer::unmap_peer(int64_t slot) {
  check_peer_slot(slot, "unmap_peer");
  OnDevice on(device_);
  cuda_check(cudaDeviceSynchronize(), "waiting for the device before unmapping a peer");
  table_[slot] = nullptr;
  write_table(slot, 1);
  maps_[slot].reset();
  lost_->watch_life(slot, LifeRef{});
  lost_->settle();
  cards_[slot].clear();
}

void EpBuffer::fence_peer(int64_t slot) {
  check_peer_slot(slot, "fence_peer");
  if (maps_[slot] == nullptr) return;
  OnDevice on(device_);
  // A stream of its own that waits for nothing: this device may be running
  // kernels that wait on the fenced process until their deadline.
  if (fence_stream_ == nullptr)
    cuda_check(cudaStreamCreateWithFlags(&fence_stream_, cudaStreamNonBlocking),
               "creating the fence stream");
  static const int32_t kFenced = 1;
  cuda_check(cudaMemcpyAsync(maps_[slot]->data(), &kFenced, sizeof(kFenced), cudaMemcpyHostToDevice,
                             fence_stream_),
             "setting a peer's fence word");
  cuda_check(cudaStreamSynchronize(fence_stream_), "setting a peer's fence word");
}

std::vector<std::pair<int64_t, int32_t>> EpBuffer::take_masked() {
  std::vector<std::pair<int64_t, int32_t>> out;
  for (int64_t r = 0; r < num_ranks_; ++r) {
    const int32_t why = reinterpret_cast<volatile int32_t*>(silent_)[r];
    if (why != 0) {
      silent_[r] = 0;
      out.emplace_back(r, why);
    }
  }
  return out;
}

int32_t EpBuffer::status_code() const {
  return *static_cast<volatile int32_t*>(status_host_);
}

std::vector<int32_t> EpBuffer::status(bool clear) {
  std::vector<int32_t> out(status_host_, status_host_ + k::kStatusWords);
  if (clear)
    for (int i = 0; i < k::kStatusWords; ++i) status_host_[i] = 0;
  return out;
}

void EpBuffer::raise_reported(const char* what) {
  const std::vector<int32_t> s = status(true);
  const int32_t d0 = s[1], d1 = s[2];
  switch (s[0]) {
    case k::kStatusOk:
    case k::kStatusSilentPeer: return;
    case k::kStatusLeftOut: left_out_ = true; throw_left_out(what);
    case k::kStatusBadExpert:
      throw_error(ErrorKind::kInvalidArgument, -1, what,
                  ": an earlier dispatch on this rank had topk_idx holding expert ", d0, " (token ",
                  d1, "); ids must be in [0, num_experts) or -1; that selection was dropped");
    case k::kStatusOverflow:
      throw_error(ErrorKind::kInvalidArgument, -1, what,
                  ": an earlier dispatch on this rank had topk_idx sending ", d1,
                  " tokens to expert ", d0,
                  ", more than num_max_dispatch_tokens_per_rank: a token selects it twice; the "
                  "rows past it were dropped");
    case k::kStatusBadHeader:
      throw_error(ErrorKind::kSystem, -1, what,
                  ": an earlier dispatch received a message from rank ", d0, " for local expert ",
                  d1, " whose header disagrees with its place: the data is corrupt");
    case k::kStatusNotResident:
      throw_error(ErrorKind::kSystem, -1, what, ": in an earlier FP8 dispatch on this rank only ",
                  d0, " of its ", d1,
                  " blocks ran at once (the GPU is shared with other work), so some tokens may "
                  "have been sent before they were quantised; set MOONCAKE_EP_FORCE_FALLBACK=1 "
                  "on such a GPU");
    default:
      throw_error(ErrorKind::kSystem, -1, what, ": an earlier dispatch received a count of ", d1,
                  " from rank ", d0,
                  ", more than num_max_dispatch_tokens_per_rank: its data is corrupt");
  }
}

void EpBuffer::throw_left_out(const char* what) const {
  throw_error(ErrorKind::kLeftOut, static_cast<int>(rank_), what, ": rank ", rank_,
              " was left out by its peers: they went on without it (it was stopped, hung or "
              "gone past the hang limit, MOONCAKE_HANG_MS) and fenced its device workspace, so "
              "its kernels store nothing into theirs; it can come back only as a new process "
              "(or a new elastic buffer in its slot)");
}

EpLayout EpBuffer::layout(int64_t T, int64_t H, int64_t E, int64_t R, const char* what) const {
  MC_CHECK_ARG(peers_ != nullptr, what, ": the EP device path is not connected");
  MC_CHECK_ARG(R > rank_ && R <= num_ranks_, what, ": a call covers ", R,
               " ranks; it must cover this one (", rank_, ") and at most the table's ", num_ranks_);
  EpLayout l(EpShape{T, H, R, E});
  // Rows are numbered in int32 on the device (a combine flag carries one).
  MC_CHECK_ARG(E * T < (int64_t{1} << 31), what, ": num_experts * num_max_dispatch_tokens_per_rank",
               " must be below 2^31 on the device path, got ", E * T);
  MC_CHECK_ARG(l.total_bytes <= bytes_, what, ": the call needs ", l.total_bytes,
               " workspace bytes, the buffer has ", bytes_);
  return l;
}

k::Common EpBuffer::common(const EpCall& call, const char* what) const {
  if (left_out_) throw_left_out(what);
  k::Common c{};
  c.layout = layout(call.max_tokens, call.hidden, call.num_experts, call.ranks, what);
  const int32_t blocks = call.num_blocks > 0 ? call.num_blocks : num_blocks_;
  MC_CHECK_ARG(call.active_ranks != nullptr, what, ": active_ranks is required");
  MC_CHECK_ARG(call.seq >= 1, what, ": seq must be >= 1");
  MC_CHECK_ARG(call.timeout_ns > 0, what, ": timeout_ns must be > 0");
  MC_CHECK_ARG(call.phases >= k::kSend && call.phases <= k::kBoth, what,
               ": phases must be 1, 2 or 3");
  MC_CHECK_ARG(blocks >= 1 && blocks <= sm_count_, what, ": num_blocks must be in [1, ", sm_count_,
               "]");
  c.peers = peers_;
  c.rank = static_cast<int32_t>(rank_);
  c.seq = call.seq;
  c.active_ranks = call.active_ranks;
  c.slot_mask = call.slot_mask;
  c.silent = silent_dev_;
  if (lost_) lost_->into(c);
  c.keys = keys_;
  c.fence = reinterpret_cast<const int32_t*>(workspace_.data());
  c.timeout_ns = call.timeout_ns;
  c.status = status_dev_;
  c.grid_sync = grid_sync_;
  c.phases = call.phases;
  c.num_blocks = blocks;
  return c;
}

void EpBuffer::dispatch(const EpCall& call, k::DispatchArgs args, cudaStream_t stream) {
  args.c = common(call, "dispatch");
  OnDevice on(device_);
  k::launch_dispatch(args, stream);
}

void EpBuffer::combine(const EpCall& call, k::CombineArgs args, cudaStream_t stream) {
  args.c = common(call, "combine");
  OnDevice on(device_);
  k::launch_combine(args, stream);
}

uint8_t* EpBuffer::combine_rows(int64_t T, int64_t H, int64_t E, int64_t R, uint64_t seq,
                                const char* what) const {
  const EpLayout l = layout(T, H, E, R, what);
  MC_CHECK_ARG(H % 8 == 0, what, ": hidden must be a multiple of 8, got ", H);
  MC_CHECK_ARG(seq >= 1, what, ": seq must be >= 1");
  return workspace() + l.expert_row(seq, 0);
}

void EpBuffer::check_peer_slot(int64_t slot, const char* what) const {
  MC_CHECK_ARG(slot >= 0 && slot < num_ranks_ && slot != rank_, what, ": slot ", slot,
               " must be in [0, ", num_ranks_, ") and not this process's (", rank_, ")");
}

void EpBuffer::write_table(int64_t first, int64_t n) {
  cuda_check(cudaMemcpy(peers_ + first, table_.data() + first, n * sizeof(uint8_t*),
                        cudaMemcpyHostToDevice),
             "copying the peer table");
}

void EpBuffer::write_keys(int64_t first, int64_t n) {
  // What the kernels tag with: 8 bits of key, never 0 (1 + key mod 255, so a
  // key and the next still differ). A tag is those bits over 24 of the call
  // number; with 0 there, the call of every 2^24th number would tag 0, which
  // is what a cleared (or never written) signal reads: a count of 0 and a
  // combine flag at row 0 taken at once, before any peer stored them.
  std::vector<uint32_t> tags(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tags[i] = keys_host_[first + i] % 255 + 1;
  cuda_check(cudaMemcpy(keys_ + first, tags.data(), n * sizeof(uint32_t), cudaMemcpyHostToDevice),
             "copying the fence keys");
}

EpArrays::EpArrays(const EpShape& s, int64_t n, int32_t k)
    : shape(s),
      num_tokens(n),
      topk(k),
      x(static_cast<size_t>(n * s.hidden)),
      topk_idx(static_cast<size_t>(n * k)),
      topk_weights(static_cast<size_t>(n * k)),
      recv_x(static_cast<size_t>(s.num_experts * s.max_tokens * s.hidden)),
      recv_count(static_cast<size_t>(s.num_experts / s.num_ranks)),
      src_info(static_cast<size_t>(s.num_experts * s.max_tokens)),
      layout_range(static_cast<size_t>(s.num_experts)),
      out(static_cast<size_t>(n * s.hidden)) {
  MC_CHECK_ARG(s.num_ranks >= 1 && s.num_experts % s.num_ranks == 0, "EpArrays: ", s.num_experts,
               " experts do not divide over ", s.num_ranks, " ranks");
}

k::DispatchArgs EpArrays::dispatch_args() const {
  k::DispatchArgs a{};
  a.x = x.get();
  a.x_dtype = k::Dtype::kBf16;
  a.num_tokens = num_tokens;
  a.topk_idx = topk_idx.get();
  a.topk_int64 = true;
  a.topk = topk;
  a.recv_x = recv_x.get();
  a.recv_count = recv_count.get();
  a.src_info = src_info.get();
  a.layout_range = layout_range.get();
  return a;
}

k::CombineArgs EpArrays::combine_args(const void* expert_out) const {
  k::CombineArgs a{};
  a.x = expert_out;
  a.x_dtype = k::Dtype::kBf16;
  a.layout_range = layout_range.get();
  a.num_tokens = num_tokens;
  a.topk_idx = topk_idx.get();
  a.topk_int64 = true;
  a.topk = topk;
  a.topk_weights = topk_weights.get();
  a.out = out.get();
  return a;
}

}  // namespace mooncake
