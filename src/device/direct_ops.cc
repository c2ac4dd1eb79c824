#include "device/direct_ops.h"

#include <algorithm>
#include <atomic>
#include <cstddef>

#include "core/error.h"
#include "device/cuda.h"

namespace mooncake {

namespace k = kernels;

namespace {

// A field of the device state, by address (the state is device memory).
template <typename T>
T* field(k::DirectState* state, size_t offset) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(state) + offset);
}

int32_t load(const int32_t* p) {
  return *static_cast<const volatile int32_t*>(p);
}

}  // namespace

// --- DirectOutcomes -------------------------------------------------------------

std::shared_ptr<DirectOutcomes> DirectOutcomes::make(int device) {
  return std::shared_ptr<DirectOutcomes>(new DirectOutcomes(device));
}

DirectOutcomes::~DirectOutcomes() {
  // No device made current (that may throw): a Work can outlive its group,
  // up to the process's exit; pinned host memory needs none.
  for (k::DirectOutcome* h : host_) cudaFreeHost(h);
}

k::DirectOutcome* DirectOutcomes::host(uint32_t slot) const {
  return host_[slot / kChunk] + slot % kChunk;
}

DirectOutcomes::Lease DirectOutcomes::lease() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) {
    // On the caller's thread, while another may capture in global mode.
    const RelaxedCapture relaxed;
    OnDevice on(device_);
    void* d = nullptr;
    void* h = mapped_bytes(kChunk * sizeof(k::DirectOutcome), &d,
                           "cudaHostAlloc of the device-driven launches' outcome slots");
    const auto first = static_cast<uint32_t>(host_.size()) * kChunk;
    host_.push_back(static_cast<k::DirectOutcome*>(h));
    dev_.push_back(static_cast<k::DirectOutcome*>(d));
    for (uint32_t i = kChunk; i-- > 0;) free_.push_back(first + i);
  }
  Lease l;
  l.pool_ = shared_from_this();
  l.slot_ = free_.back();
  free_.pop_back();
  l.ticket_ = next_ticket_++;
  // Before the launch is queued: a ticket left from the slot's last use is
  // never this one.
  *static_cast<volatile uint64_t*>(&host(l.slot_)->ticket) = 0;
  return l;
}

DirectOutcomes::Lease& DirectOutcomes::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    give_back();
    pool_ = std::move(o.pool_);
    slot_ = o.slot_;
    ticket_ = o.ticket_;
    o.pool_.reset();
  }
  return *this;
}

k::DirectOutcome* DirectOutcomes::Lease::device() const {
  std::lock_guard<std::mutex> lock(pool_->mu_);
  return pool_->dev_[slot_ / kChunk] + slot_ % kChunk;
}

std::optional<k::DirectOutcome> DirectOutcomes::Lease::read() const {
  k::DirectOutcome* h = nullptr;
  {
    std::lock_guard<std::mutex> lock(pool_->mu_);
    h = pool_->host(slot_);
  }
  const volatile k::DirectOutcome* v = h;
  if (v->ticket != ticket_) return std::nullopt;
  std::atomic_thread_fence(std::memory_order_acquire);
  // Every field copied (a new one must be added here too).
  static_assert(sizeof(k::DirectOutcome) == 8 * sizeof(uint64_t));
  k::DirectOutcome o{};
  o.took = v->took;
  o.rejected = v->rejected;
  o.mismatched = v->mismatched;
  o.stale = v->stale;
  o.present = v->present;
  o.mapped = v->mapped;
  o.sizes = v->sizes;
  o.ticket = ticket_;
  return o;
}

void DirectOutcomes::Lease::give_back() {
  if (!pool_) return;
  {
    std::lock_guard<std::mutex> lock(pool_->mu_);
    pool_->free_.push_back(slot_);
  }
  pool_.reset();
}

// --- DirectOps ----------------------------------------------------------------------

DirectOps::DirectOps(int device, int rank, int ranks, const k::DirectLayout& layout,
                     size_t plane_bytes)
    : device_(device),
      rank_(rank),
      ranks_(ranks),
      layout_(layout),
      plane_bytes_(plane_bytes),
      incarnations_(static_cast<size_t>(ranks), kNone) {
  MC_CHECK_ARG(ranks >= 1 && ranks <= k::kDirectMaxRanks && rank >= 0 && rank < ranks,
               "DirectOps: rank ", rank, " of ", ranks, " ranks (at most ", k::kDirectMaxRanks,
               ")");
  OnDevice on(device_);
  try {
    // Written whole by install(), before any launch reads it.
    cuda_check(cudaMalloc(&state_, sizeof(k::DirectState)),
               "cudaMalloc of the device-driven collectives' state");
    status_host_ = mapped_words(k::kStatusWords, &status_dev_, "cudaHostAlloc of the status words");
    silent_host_ = mapped_words(ranks, &silent_dev_, "cudaHostAlloc of the silent-rank words");
    lost_ = std::make_shared<LostWords>(ranks, device_);
  } catch (...) {
    release();
    throw;
  }
}

DirectOps::~DirectOps() {
  OnDevice on(device_);
  cudaDeviceSynchronize();  // a launch (a graph replay) may still read the state
  release();
}

void DirectOps::release() {
  if (state_ != nullptr) cudaFree(state_);
  if (status_host_ != nullptr) cudaFreeHost(status_host_);
  if (silent_host_ != nullptr) cudaFreeHost(silent_host_);
  state_ = nullptr;
  status_host_ = silent_host_ = nullptr;
}

void DirectOps::install(const std::vector<uint8_t*>& areas,
                        const std::vector<uint32_t>& incarnations,
                        const std::vector<LifeRef>& lives, uint32_t gen, uint64_t epoch,
                        cudaStream_t stream) {
  MC_ASSERT(areas.size() == static_cast<size_t>(ranks_) && incarnations.size() == areas.size() &&
            lives.size() == areas.size());
  MC_ASSERT(gen < (uint32_t{1} << 31));  // a signal's top bit marks a fence
  OnDevice on(device_);
  k::DirectState h{};
  h.seq = 0;
  h.gen = gen;
  h.rank = rank_;
  h.ranks = ranks_;
  h.report = report_;
  installed_members_ = 0;
  for (int p = 0; p < ranks_; ++p) {
    h.areas[p] = areas[static_cast<size_t>(p)];
    h.live[p] = h.areas[p] != nullptr ? 1 : 0;
    installed_members_ += h.live[p];
  }
  cuda_check(cudaMemcpyAsync(state_, &h, sizeof(h), cudaMemcpyHostToDevice, stream),
             "writing the device-driven collectives' state");
  cuda_check(cudaStreamSynchronize(stream), "writing the device-driven collectives' state");
  for (int p = 0; p < ranks_; ++p) {
    const uint32_t inc = incarnations[static_cast<size_t>(p)];
    // A new process in the slot: what the transport said of the last one is void.
    if (areas[static_cast<size_t>(p)] != nullptr && inc != incarnations_[static_cast<size_t>(p)])
      lost_->clear(p);
    // Every launch of the last setup is over (the caller synchronized the device).
    if (areas[static_cast<size_t>(p)] == nullptr)
      lost_->watch_life(p, LifeRef{});
    else if (inc != incarnations_[static_cast<size_t>(p)] || !lost_->has_life(p))
      lost_->watch_life(p, lives[static_cast<size_t>(p)]);
    incarnations_[static_cast<size_t>(p)] = areas[static_cast<size_t>(p)] != nullptr ? inc : kNone;
    silent_host_[p] = 0;
  }
  lost_->settle();
  for (int i = 0; i < k::kStatusWords; ++i) status_host_[i] = 0;
  // The members' exports anew: a new generation's peers (a replacement's
  // tensors are others) offer theirs again, and every launch is over.
  areas_.assign(areas.begin(), areas.end());
  if (imports_) imports_->forget();
  imports_.reset();
  exports_.reset();
  if (areas[static_cast<size_t>(rank_)] != nullptr) {
    exports_ =
        std::make_unique<UserExports>(areas[static_cast<size_t>(rank_)] + layout_.exports, device_);
    imports_ = std::make_unique<UserImports>(ranks_, device_);
  }
  gen_ = gen;
  epoch_ = epoch;
  installed_ = true;
  left_behind_ = false;  // this setup took this rank in
}

uint32_t DirectOps::incarnation(int slot) const {
  return slot >= 0 && slot < ranks_ ? incarnations_[static_cast<size_t>(slot)] : kNone;
}

void DirectOps::retire(int slot, cudaStream_t stream) {
  if (slot < 0 || slot >= ranks_) return;
  OnDevice on(device_);
  int32_t* live = field<int32_t>(state_, offsetof(k::DirectState, live)) + slot;
  cuda_check(cudaMemsetAsync(live, 0, sizeof(int32_t), stream), "retiring a rank");
  incarnations_[static_cast<size_t>(slot)] = kNone;
}

void DirectOps::retire_now(int slot) {
  OnDevice on(device_);
  retire(slot, nullptr);
  if (slot >= 0 && slot < ranks_) {
    // Its area too: a launch looks at (and may fence) a retired peer's
    // signal, never through a mapping that goes.
    uint8_t** area = field<uint8_t*>(state_, offsetof(k::DirectState, areas)) + slot;
    cuda_check(cudaMemsetAsync(area, 0, sizeof(uint8_t*), nullptr), "retiring a rank");
  }
  // Launches and replays on any stream (torch's are non-blocking) are over
  // before the slot's mapping goes.
  cuda_check(cudaDeviceSynchronize(), "retiring a rank");
  lost_->watch_life(slot, LifeRef{});
  lost_->settle();
}

size_t DirectOps::input_bytes(const Op& op) const {
  return k::direct_in_parts(op.kind, ranks_, rank_ == op.root) * op.count * dtype_size(op.dtype);
}

UserExports::Offer DirectOps::offer(const void* p, size_t bytes, cudaStream_t stream) {
  if (!exports_ || (reinterpret_cast<uintptr_t>(p) & 15) != 0) return {};
  return exports_->offer(p, bytes, stream, false);
}

void DirectOps::map_offers(LaunchOrder& launches, cudaStream_t stream) {
  if (imports_) imports_->resolve(areas_, layout_.exports, launches, stream, false);
}

void DirectOps::launch(const Op& op, bool two_shot, bool reject, int64_t timeout_ms, int blocks,
                       cudaStream_t stream) {
  // (A mapped op's input stays where it lies: only its share must fit a parity of the area.)
  MC_ASSERT(installed_ && timeout_ms > 0 && op.count < k::kDirectMaxCount &&
            (op.mapped || input_bytes(op) <= layout_.max_bytes));
  MC_ASSERT(!op.mapped || (op.kind == k::DirectKind::kAllReduce && op.in == op.out &&
                           op.list == k::DirectList::kNone && imports_));
  MC_ASSERT(!k::direct_rooted(op.kind) || (op.root >= 0 && op.root < ranks_));
  MC_ASSERT(op.stride == 0 || op.stride >= op.count);  // parts never overlap
  MC_ASSERT(!op.vary || (plane_bytes_ >= static_cast<size_t>(ranks_) * k::DirectLayout::kAlign &&
                         layout_.input_bytes >= k::VaryTable::bytes(ranks_)));
  const int root = k::direct_rooted(op.kind) ? op.root : 0;
  const RedOp red = k::direct_reduces(op.kind) ? op.op : RedOp::kSum;
  k::DirectArgs a{};
  a.kind = op.kind;
  a.root = root;
  a.c.peers = field<uint8_t*>(state_, offsetof(k::DirectState, areas));
  a.c.rank = rank_;
  a.c.active_ranks = field<int32_t>(state_, offsetof(k::DirectState, live));
  a.c.silent = silent_dev_;
  lost_->into(a.c);
  // Bounded (about 12 days), so that the kernels' deadlines (twice this, past
  // the clock's reading) never wrap: a group's timeout may be "forever".
  a.c.timeout_ns = std::min<int64_t>(timeout_ms, int64_t{1} << 30) * 1000000;
  a.c.status = status_dev_;
  a.c.grid_sync = field<uint32_t>(state_, offsetof(k::DirectState, grid_sync));
  a.state = state_;
  a.layout = layout_;
  a.in = op.in;
  a.out = op.out;
  a.count = op.count;
  a.stride = op.part_stride();
  a.esize = dtype_size(op.dtype);
  a.dtype = op.dtype;
  a.op = red;
  a.two_shot = two_shot && op.kind == k::DirectKind::kAllReduce && !op.mapped;
  a.shape = reject ? k::kShapeRejected
                   : k::direct_shape(op.kind, root, op.count, op.dtype, red, a.two_shot, op.mapped);
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  // Parts after the first start at whole vectors only when a part and the
  // stride are whole vectors.
  const bool one_part = k::direct_in_parts(op.kind, ranks_, true) <= 1 &&
                        k::direct_out_parts(op.kind, ranks_, true) <= 1;
  a.vec = aligned(op.in) && aligned(op.out) &&
          (one_part || ((op.count * a.esize) % 16 == 0 && (a.stride * a.esize) % 16 == 0));
  a.list = op.list;
  if (op.list != k::DirectList::kNone) {
    const bool in = op.list == k::DirectList::kIn;
    const size_t n = in ? k::direct_in_parts(op.kind, ranks_, rank_ == root)
                        : k::direct_out_parts(op.kind, ranks_, rank_ == root);
    MC_ASSERT(op.parts.size() == n && (in ? op.in : op.out) == nullptr);
    for (size_t p = 0; p < n; ++p) {
      a.parts[p] = op.parts[p];
      a.vec = a.vec && aligned(op.parts[p]);
    }
  }
  if (op.vary && !reject) {
    // Every part at its own address, of its own size (kernels/coll/direct.h:
    // VaryTable); the shape names neither.
    MC_ASSERT(op.kind == k::DirectKind::kAllToAll &&
              op.parts.size() == static_cast<size_t>(ranks_) &&
              op.in_parts.size() == op.parts.size() && op.send_bytes.size() == op.parts.size() &&
              op.recv_bytes.size() == op.parts.size() && !op.mapped);
    a.vary = true;
    a.count = 0;
    a.shape = k::direct_shape(op.kind, 0, 0, op.dtype, RedOp::kSum, true, false);
    a.list = k::DirectList::kOut;
    for (int p = 0; p < ranks_; ++p) {
      a.parts[p] = op.parts[p];
      a.in_parts[p] = op.in_parts[p];
      a.send_bytes[p] = op.send_bytes[p];
      a.recv_bytes[p] = op.recv_bytes[p];
    }
  }
  a.outcome = op.outcome;
  a.ticket = op.ticket;
  a.mapped = op.mapped;
  a.plane_bytes = plane_bytes_;
  if (op.mapped) {
    // An offer's tensor is 16-byte aligned (offer()); one without is read
    // through the segments only, a vector at a time where it is aligned.
    a.vec = aligned(op.out);
    a.offer_gen = op.offer.gen;
    a.offer_slot = op.offer.slot;
    a.offer_off = op.offer.off;
    a.imports = imports_->table();
    a.misses = imports_->misses();
  }
  cuda_check(static_cast<cudaError_t>(k::launch_direct(a, blocks, stream)),
             "the device-driven collective kernel");
}

std::vector<std::string> DirectOps::take_reports() {
  std::vector<std::string> out;
  const int32_t code = load(status_host_);
  if (code != k::kStatusOk) {
    const int32_t d0 = load(status_host_ + 1), d1 = load(status_host_ + 2);
    switch (code) {
      case k::kStatusSilentPeer:
        out.push_back(str("rank ", d0, " was silent past the op's timeout and is masked"));
        break;
      case k::kStatusNotResident:
        out.push_back(str("only ", d0, " of ", d1,
                          " blocks of a launch ran at once (the GPU is shared with other work): "
                          "its result may be wrong"));
        break;
      case k::kStatusDirectStale:
        if (static_cast<uint32_t>(d1) > gen_) {
          left_behind_ = true;
          out.push_back(str("rank ", d0, " went on to setup ", d1, " (this rank's: ", gen_,
                            ") without this rank: the others left it out"));
        } else {
          out.push_back(str("rank ", d0,
                            " is two ops ahead: it masked this rank (silent past its timeout) "
                            "and went on; the two leave each other out until the group's "
                            "ranks next change"));
        }
        break;
      case k::kStatusDirectMismatch:
        out.push_back(str("rank ", d0,
                          " called another op, or the same with another root, count, dtype or "
                          "reduce op: each rank's result left the other out"));
        break;
      case k::kStatusDirectRejected:
        out.push_back(str("rank ", d0,
                          " rejected its arguments (it raised ValueError): the others' result "
                          "left it out"));
        break;
      case k::kStatusDirectFenced:
        out.push_back(str("a peer stopped waiting for this rank at op ", d1,
                          " (silent past its timeout, or seen lost, or dropped from the view) "
                          "and fenced it: every rank, this one too, leaves its input out until "
                          "the group's ranks next change"));
        break;
      case k::kStatusDirectMappedOut:
        out.push_back(str("a peer stopped waiting for this rank in a mapped all_reduce (op ", d1,
                          ", silent past its timeout): this rank wrote nothing there, its "
                          "tensor holds its own input"));
        break;
      case k::kStatusDirectMappedLate:
        out.push_back(
            str("a peer stopped waiting for this rank's reads of the segments in a "
                "mapped all_reduce (op ",
                d1, ", silent past its timeout): this rank's result there may be torn"));
        break;
      case k::kStatusDirectSizes:
        out.push_back(str("ranks ", d0, " and ", d1,
                          " disagreed on the sizes of an all_to_all's parts between them: "
                          "nothing moved, every rank raised ValueError"));
        break;
      default: out.push_back(str("status ", code, " (", d0, ", ", d1, ")"));
    }
    for (int i = 0; i < k::kStatusWords; ++i) status_host_[i] = 0;
  }
  for (int r = 0; r < ranks_; ++r) {
    const int32_t why = load(silent_host_ + r);
    if (why == 0) continue;
    silent_host_[r] = 0;
    out.push_back(str("rank ", r, " is masked: ",
                      why == k::kMaskedLost
                          ? "lost (its process gone, or silent past MOONCAKE_HANG_MS)"
                          : "silent past the op's timeout"));
  }
  return out;
}

}  // namespace mooncake
