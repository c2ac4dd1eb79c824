#include "device/ep_ht.h"

#include <algorithm>
#include <atomic>
#include <optional>

#include "core/env.h"
#include "core/error.h"
#include "device/cuda.h"

namespace mooncake {

namespace ht = kernels::ep_ht;

HostWords::HostWords(int64_t n) {
  host_ = mapped_words(std::max<int64_t>(n, 1), &dev_, "cudaHostAlloc of the EP report words");
}

HostWords::~HostWords() {
  cudaFreeHost(host_);
}

int32_t HostWords::load(int64_t i) const {
  return std::atomic_ref<int32_t>(host_[i]).load();
}

void HostWords::store(int64_t i, int32_t v) {
  std::atomic_ref<int32_t>(host_[i]).store(v);
}

namespace {

// The workspace's layout, its arguments checked first (a member initialiser).
ht::HtLayout checked_layout(int64_t ranks, int64_t rank, int64_t channels, size_t ring_bytes) {
  MC_CHECK_ARG(ranks >= 1 && ranks <= ht::kMaxRanks, "ElasticBuffer device path: ", ranks,
               " ranks; it serves 1 to ", ht::kMaxRanks);
  MC_CHECK_ARG(rank >= 0 && rank < ranks, "ElasticBuffer device path: rank ", rank,
               " is outside [0, ", ranks, ")");
  MC_CHECK_ARG(channels >= 1 && channels <= ht::kMaxChannels,
               "ElasticBuffer device path: ", channels, " channels; it takes 1 to ",
               ht::kMaxChannels);
  return ht::HtLayout(ranks, channels, ring_bytes);
}

}  // namespace

EpHtBuffer::EpHtBuffer(int64_t ranks, int64_t rank, int64_t channels, size_t ring_bytes, int device)
    : device_(device),
      rank_(rank),
      layout_(checked_layout(ranks, rank, channels, ring_bytes)),
      workspace_(layout_.total, device),
      silent_(ranks),
      status_(kernels::kStatusWords),
      lost_(std::make_shared<LostWords>(ranks, device)) {
  OnDevice on(device_);
  mine_ = PeerCard::of(workspace_);
  card_ = mine_.encode();
  maps_.resize(static_cast<size_t>(ranks));
  peers_ = device_zeros<uint8_t*>(static_cast<size_t>(ranks), "cudaMalloc of the peer table");
  uint8_t* own = workspace_.data();
  cuda_check(cudaMemcpy(peers_ + rank, &own, sizeof(own), cudaMemcpyHostToDevice),
             "copying the peer table");
  bases_.assign(static_cast<size_t>(ranks), nullptr);
  bases_[rank] = own;
  if (env_int("MOONCAKE_EP_HT_ONE_COPY") != 0) {
    exports_ = std::make_unique<UserExports>(own + layout_.exported(0), device_);
    imports_ = std::make_unique<UserImports>(ranks, device_);
    xcounts_ = device_zeros<unsigned long long>(4, "cudaMalloc of the one-copy counts");
  }
  counters_ = device_zeros<uint32_t>(2, "cudaMalloc of the EP counters");
  etotal_ = device_zeros<int32_t>(ht::kMaxExperts, "cudaMalloc of the EP scratch");
  sm_count_ = device_sm_count(device_);
  order_ = std::make_unique<LaunchOrder>();
}

EpHtBuffer::~EpHtBuffer() {
  OnDevice on(device_);
  cudaDeviceSynchronize();  // no kernel may still use the peers' mappings
  maps_.clear();
  imports_.reset();
  cudaFree(xcounts_);
  cudaFree(peers_);
  cudaFree(counters_);
  cudaFree(etotal_);
}

bool EpHtBuffer::shares_gpu(const std::string& encoded) const {
  const auto card = PeerCard::decode(encoded);
  return card && mine_.same_gpu(*card);
}

EpHtBuffer::Connection EpHtBuffer::connect(const std::vector<std::string>& cards) {
  const int64_t R = layout_.ranks;
  MC_CHECK_ARG(static_cast<int64_t>(cards.size()) == R, "connect: ", cards.size(), " cards for ", R,
               " ranks");
  OnDevice on(device_);
  cuda_check(cudaDeviceSynchronize(), "waiting for the device before mapping peers");
  std::vector<std::optional<PeerCard>> decoded;
  decoded.reserve(cards.size());
  for (const std::string& c : cards) decoded.push_back(PeerCard::decode(c));
  Connection out{std::vector<bool>(static_cast<size_t>(R), false),
                 std::vector<bool>(static_cast<size_t>(R), false), 1};
  std::vector<uint8_t*> table(static_cast<size_t>(R), nullptr);
  table[rank_] = workspace_.data();
  out.reachable[rank_] = out.present[rank_] = true;
  for (int64_t r = 0; r < R; ++r) {
    maps_[r].reset();
    lost_->watch_life(r, LifeRef{});
    if (r == rank_ || !decoded[r]) continue;
    out.present[r] = true;
    if (!decoded[r]->on_this_host()) continue;
    try {
      maps_[r] = std::make_unique<PeerMapping>(decoded[r]->handle, device_);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kPeerFailed) throw;
      continue;  // its process is gone, or its GPU cannot be reached from here
    }
    table[r] = maps_[r]->data();
    out.reachable[r] = true;
    lost_->clear(r);  // a new process in the slot
    lost_->watch_life(r, decoded[r]->life_here());
  }
  lost_->settle();  // the device is idle (above)
  // No signal a peer stored after a wait here gave up on it (a late acknowledgement,
  // a done) is taken by a later call with the same tag (a graph's replay): the
  // readers clear each word after their last read, but a word written after that
  // stays.
  cuda_check(cudaMemset(workspace_.data() + layout_.dtail, 0, layout_.rings - layout_.dtail),
             "clearing the signals");
  if (imports_) {
    imports_->forget();  // the old peers' x (and the device is idle)
    // No offer or answer a peer left after a wait gave up on it is taken by
    // a later call with the same tag (a graph's replay).
    cuda_check(cudaMemset(workspace_.data() + layout_.xdesc, 0, layout_.xrec - layout_.xdesc),
               "clearing the offers");
  }
  cuda_check(cudaMemcpy(peers_, table.data(), R * sizeof(uint8_t*), cudaMemcpyHostToDevice),
             "copying the peer table");
  bases_.assign(table.begin(), table.end());
  out.sharers = gpu_sharers(mine_, decoded);
  return out;
}

std::vector<std::pair<int64_t, int32_t>> EpHtBuffer::take_masked() {
  std::vector<std::pair<int64_t, int32_t>> out;
  for (int64_t r = 0; r < layout_.ranks; ++r) {
    const int32_t why = silent_.load(r);
    if (why != 0) {
      silent_.store(r, 0);
      out.emplace_back(r, why);
    }
  }
  return out;
}

int32_t EpHtBuffer::status_code() const {
  return status_.load(0);
}

std::vector<int32_t> EpHtBuffer::status(bool clear) {
  std::vector<int32_t> out(kernels::kStatusWords);
  for (int i = 0; i < kernels::kStatusWords; ++i) out[i] = status_.load(i);
  if (clear)
    for (int i = 0; i < kernels::kStatusWords; ++i) status_.store(i, 0);
  return out;
}

void EpHtBuffer::raise_reported(const char* what) {
  const std::vector<int32_t> s = status(true);
  const int32_t d0 = s[1], d1 = s[2];
  switch (s[0]) {
    case kernels::kStatusOk:
    case kernels::kStatusSilentPeer: return;
    case kernels::kStatusBadExpert:
      throw_error(ErrorKind::kInvalidArgument, -1, what,
                  ": a dispatch on this rank had topk_idx holding expert ", d0, " (token ", d1,
                  "); ids must be in [0, num_experts) or -1; that selection was dropped");
    case ht::kHtDuplicate:
      throw_error(ErrorKind::kInvalidArgument, -1, what, ": a dispatch on this rank had token ", d0,
                  " select expert ", d1,
                  " twice in topk_idx; a token selects an expert at most once");
    case ht::kHtMismatch:
      throw_error(ErrorKind::kInvalidArgument, -1, what, ": rank ", d0,
                  " made a dispatch of another shape (num_max_tokens_per_rank, num_experts, "
                  "num_topk, x's row size or dtype, topk_weights given, do_expand, "
                  "expert_alignment or MOONCAKE_EP_HT_ONE_COPY differ): the ranks' calls must "
                  "agree; neither took the other's tokens");
    case ht::kHtShortX:
      throw_error(ErrorKind::kInvalidArgument, -1, what, ": a combine on this rank had x of ", d0,
                  " rows, fewer than the ", d1,
                  " valid rows of its dispatch's layout: x may be trimmed to the valid rows, "
                  "not shorter (the missing rows were combined as zero)");
    case kernels::kStatusBadCount:
      throw_error(ErrorKind::kSystem, -1, what, ": a dispatch received from rank ", d0,
                  " a count of ", d1,
                  " tokens that is not its call's (another call, or corrupt): it was masked");
    default:
      throw_error(ErrorKind::kSystem, -1, what, ": a dispatch or combine received a row from rank ",
                  d0, " at place ", d1,
                  " outside its outputs, or rows of another call: the data is corrupt");
  }
}

ht::HtCommon EpHtBuffer::common(uint64_t seq, int64_t timeout_ns, int32_t* active, int counter,
                                const char* what) const {
  MC_CHECK_ARG(active != nullptr, what, ": the rank mask is required");
  MC_CHECK_ARG(seq >= 1, what, ": seq must be >= 1");
  MC_CHECK_ARG(timeout_ns > 0, what, ": timeout_ns must be > 0");
  ht::HtCommon h{};
  h.c.peers = peers_;
  h.c.rank = static_cast<int32_t>(rank_);
  h.c.seq = seq;
  h.c.active_ranks = active;
  h.c.slot_mask = nullptr;
  h.c.silent = silent_.device();
  lost_->into(h.c);
  h.c.timeout_ns = timeout_ns;
  h.c.status = status_.device();
  h.c.phases = kernels::kBoth;
  h.ws = layout_;
  h.counter = counters_ + counter;
  h.stamps = stamps_;
  return h;
}

void EpHtBuffer::layout(ht::LayoutArgs a, uint64_t seq, int64_t timeout_ns, int32_t* active,
                        int blocks, cudaStream_t stream) {
  a.h = common(seq, timeout_ns, active, 0, "dispatch");
  a.etotal = etotal_;
  MC_CHECK_ARG(a.r.num_experts >= 1 && a.r.num_experts <= ht::kMaxExperts,
               "dispatch: num_experts must be in [1, ", ht::kMaxExperts,
               "] on the device path, got ", a.r.num_experts);
  MC_CHECK_ARG(a.r.num_experts % layout_.ranks == 0, "dispatch: num_experts (", a.r.num_experts,
               ") must be divisible by the number of ranks (", layout_.ranks, ")");
  MC_CHECK_ARG(a.r.num_experts / layout_.ranks <= ht::kMaxLocalExperts, "dispatch: at most ",
               ht::kMaxLocalExperts, " local experts on the device path");
  ordered(stream, [&] { ht::launch_layout(a, blocks, stream); });
}

void EpHtBuffer::dispatch(ht::DispatchArgs a, uint64_t seq, int64_t timeout_ns, int32_t* active,
                          int blocks, cudaStream_t stream) {
  a.h = common(seq, timeout_ns, active, 1, "dispatch");
  const int64_t N = a.r.num_tokens, sb = a.slots.scale_bytes;
  with_one_copy(a, stream, "dispatch", N > 0, a.x, N, a.x_stride, a.slots.data_bytes,
                sb != 0 ? a.scales : nullptr, N * sb);
  ordered(stream, [&] { ht::launch_dispatch(a, blocks, stream); });
}

template <typename Args>
void EpHtBuffer::with_one_copy(Args& a, cudaStream_t stream, const char* what, bool offer,
                               const void* p, int64_t rows, int64_t stride, int64_t row_bytes,
                               const void* q, int64_t q_bytes) {
  if (!imports_ || layout_.ranks == 1) return;
  OnDevice on(device_);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &capture), what);
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  imports_->resolve(bases_, layout_.exported(0), *order_, stream, capturing);
  if (offer && rows > 0 && stride >= row_bytes) {
    const auto bytes = static_cast<size_t>((rows - 1) * stride + row_bytes);
    const UserExports::Offer x = exports_->offer(p, bytes, stream, capturing);
    UserExports::Offer y;
    if (x.gen != 0 && q != nullptr)
      y = exports_->offer(q, static_cast<size_t>(q_bytes), stream, capturing);
    if (x.gen != 0 && (q == nullptr || y.gen != 0))
      a.share = ht::XShare{x.gen, x.slot, x.off, stride, rows, y.gen, y.slot, y.off};
  }
  a.imports = imports_->table();
  a.misses = imports_->misses();
  a.counts = xcounts_;
}

std::vector<int32_t> EpHtBuffer::plan_head(const int32_t* plan, int64_t n, cudaStream_t stream) {
  MC_CHECK_ARG(plan != nullptr && n >= 0 && n <= kHeadWords, "plan_head: ", n, " words; at most ",
               kHeadWords);
  OnDevice on(device_);
  // Calls from several threads would share the one pinned buffer.
  const std::lock_guard<std::mutex> lock(head_mu_);
  cuda_check(cudaMemcpyAsync(head_.host(), plan, static_cast<size_t>(n) * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream),
             "reading the plan's counts");
  cuda_check(cudaStreamSynchronize(stream), "waiting for the plan's counts");
  return {head_.host(), head_.host() + n};
}

std::vector<int64_t> EpHtBuffer::one_copy_counts() const {
  if (xcounts_ == nullptr) return {0, 0, 0, 0};
  OnDevice on(device_);
  cuda_check(cudaDeviceSynchronize(), "waiting for the device");
  unsigned long long c[4] = {0, 0, 0, 0};
  cuda_check(cudaMemcpy(c, xcounts_, sizeof(c), cudaMemcpyDeviceToHost), "reading the counts");
  return {static_cast<int64_t>(c[0]), static_cast<int64_t>(c[1]), static_cast<int64_t>(c[2]),
          static_cast<int64_t>(c[3])};
}

void EpHtBuffer::combine(ht::CombineArgs a, uint64_t seq, int64_t timeout_ns, int32_t* active,
                         int blocks, cudaStream_t stream) {
  // (The combine kernel has no last block: its counter is unused.)
  a.h = common(seq, timeout_ns, active, 1, "combine");
  const int64_t db = a.slots.data_bytes;
  with_one_copy(a, stream, "combine", !a.expand && !a.single, a.x, a.rows, db, db, a.weights,
                a.rows * a.r.topk * 4);
  ordered(stream, [&] { ht::launch_combine(a, blocks, stream); });
}

}  // namespace mooncake
