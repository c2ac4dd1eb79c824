#include "device/collectives.h"

#include <algorithm>
#include <bit>
#include <utility>

#include "collectives/layout.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/api.h"
#include "membership/hints.h"

namespace mooncake {

namespace {

// all_to_all gives each peer a region of at least this many bytes of a segment.
constexpr size_t kMinRegion = 256;

// A device-driven all_reduce takes a block per this many bytes (up to its
// share of the GPU): a 4 KiB op is one block, which needs no grid barrier.
constexpr size_t kDirectBytesPerBlock = 32 << 10;

constexpr size_t kAlignBytes = kernels::DirectLayout::kAlign;

// How long finish() polls before it sleeps on its event (a kernel that runs
// longer, one waiting for a late peer, costs a wake-up: 100+ us).
constexpr int64_t kFinishPollUs = 2000;

// The view changed between a caller's poll and its launch (a peer's hint,
// another thread's setup; most likely between an op's pieces): an error of
// the call, not of the library.
[[noreturn]] void ranks_changed() {
  throw_error(ErrorKind::kSystem, -1,
              "device-driven collectives: the group's ranks changed while an op was being "
              "launched on the caller's stream; call it again (under capture: capture again, "
              "after one eager call)");
}

void copy(void* to, const void* from, size_t bytes, cudaStream_t stream, const char* what) {
  if (bytes != 0)
    cuda_check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream), what);
}

void zero(void* to, size_t bytes, cudaStream_t stream, const char* what) {
  if (bytes != 0) cuda_check(cudaMemsetAsync(to, 0, bytes, stream), what);
}

// out = the segments' elements from `offset` on, reduced in member order.
void reduce_segments(const std::vector<const uint8_t*>& segments, size_t offset, void* out,
                     size_t count, DType dtype, RedOp op, cudaStream_t stream) {
  kernels::ReduceArgs a;
  a.nsrc = static_cast<int>(segments.size());
  for (int i = 0; i < a.nsrc; ++i) a.srcs[i] = segments[static_cast<size_t>(i)] + offset;
  a.out = out;
  a.count = count;
  a.dtype = dtype;
  a.op = op;
  a.avg_divisor = a.nsrc;
  cuda_check(static_cast<cudaError_t>(kernels::launch_reduce(a, stream)), "reduce kernel");
}

}  // namespace

std::optional<DeviceCollectives::Options> DeviceCollectives::Options::from_env() {
  const int64_t bytes = env_int("MOONCAKE_CUDA_SEGMENT_BYTES");
  if (bytes <= 0 || env_string("MOONCAKE_TRANSPORT") == "tcp") return std::nullopt;
  Options o;
  o.segment_bytes = static_cast<size_t>(bytes);
  o.min_bytes = static_cast<size_t>(std::max<int64_t>(0, env_int("MOONCAKE_CUDA_PLANE_MIN_BYTES")));
  const int64_t direct_bytes = env_int("MOONCAKE_CUDA_DIRECT_BYTES");
  MC_CHECK_ARG(direct_bytes >= 0, "MOONCAKE_CUDA_DIRECT_BYTES must be >= 0, got ", direct_bytes);
  o.direct_bytes = static_cast<size_t>(direct_bytes);
  const std::string mode = env_string("MOONCAKE_CUDA_DIRECT");
  if (mode == "auto")
    o.direct = Direct::kAuto;
  else if (mode == "oneshot")
    o.direct = Direct::kOneShot;
  else if (mode == "twoshot")
    o.direct = Direct::kTwoShot;
  else if (mode == "off")
    o.direct = Direct::kOff;
  else
    throw_error(ErrorKind::kInvalidArgument, -1,
                "MOONCAKE_CUDA_DIRECT must be auto, oneshot, twoshot or off, got '", mode, "'");
  if (o.direct_bytes == 0) o.direct = Direct::kOff;
  const int64_t mapped = env_int("MOONCAKE_CUDA_MAPPED");
  MC_CHECK_ARG(mapped == 0 || mapped == 1, "MOONCAKE_CUDA_MAPPED must be 0 or 1, got ", mapped);
  o.mapped = mapped == 1 && o.direct != Direct::kOff;
  return o;
}

DeviceCollectives::DeviceCollectives(Communicator& comm, Store& store, std::string prefix,
                                     int device, Options options)
    : comm_(comm),
      directory_(store, std::move(prefix), device),
      device_(device),
      options_(options),
      outcomes_(DirectOutcomes::make(device)) {
  relax_library_threads();  // the op queue's thread, which starts later, runs our launches
  directory_.publish_host(comm_.rank());
}

bool DeviceCollectives::serves(std::optional<size_t> bytes, int64_t timeout_ms) {
  if (comm_.size() > kernels::kMaxReduceSources) return false;
  if (bytes && *bytes < options_.min_bytes) return false;
  if (options_.segment_bytes < static_cast<size_t>(comm_.size()) * kMinRegion) return false;
  if (mappable_ < 0) {
    const Reach reach = directory_.reach(comm_.size(), comm_.rank(), timeout_ms);
    if (!reach.no_peer_access.empty())
      MC_LOG(kWarn, "device: ", reach.no_peer_access,
             ": this group's ops on CUDA tensors are staged through host memory");
    gpu_sharers_ = reach.gpu_sharers;
    mappable_ = reach.mappable() ? 1 : 0;
  }
  return mappable_ == 1;
}

size_t DeviceCollectives::per_piece(size_t parts, size_t esize) const {
  const size_t share = options_.segment_bytes / parts;
  const size_t blocks = share >= kMinRegion ? share / kMinRegion * kMinRegion : share;
  return std::max<size_t>(1, blocks / esize);
}

size_t DeviceCollectives::direct_max_bytes() const {
  return options_.direct == Direct::kOff ? 0
                                         : std::min(options_.direct_bytes, options_.segment_bytes);
}

kernels::DirectLayout DeviceCollectives::direct_layout() const {
  const size_t most = direct_max_bytes();
  if (!options_.mapped || most == 0) return kernels::DirectLayout::of(most);
  // A mapped all_reduce reduces a member's share into a parity of its area, and
  // a piece is at most a segment (its way through the segments): a parity
  // of half a segment serves a segment in one launch at world 2 (in three with
  // the default area, 1.4x the kernel time of one on an H100). The area's
  // parity is its input and half as much again.
  return kernels::DirectLayout::of(std::max(most, options_.segment_bytes / 3 + 4 * kAlignBytes));
}

size_t DeviceCollectives::direct_offset() const {
  return kernels::DirectLayout::round_up(options_.segment_bytes);
}

uint8_t* DeviceCollectives::mine() {
  if (!segment_) {
    // The device-driven all_reduce's area comes after the host-driven plane's part.
    const size_t area = direct_max_bytes() > 0 ? direct_layout().total_bytes : 0;
    segment_ = std::make_unique<DeviceSegment>(direct_offset() + area, device_);
    const View view = comm_.view();
    directory_.publish(comm_.rank(), view.incarnation[static_cast<size_t>(comm_.rank())],
                       PeerCard::of(*segment_));
  }
  return segment_->data();
}

std::vector<const uint8_t*> DeviceCollectives::segments(const std::vector<int>& members,
                                                        int64_t timeout_ms) {
  const View view = comm_.view();
  std::vector<const uint8_t*> out;
  out.reserve(members.size());
  for (int p : members) {
    const uint32_t inc = view.incarnation[static_cast<size_t>(p)];
    // A new process in slot p: its last one's mapping goes, and no launch of
    // the device-driven all_reduce (a graph replay) may read through it.
    if (direct_ && p != comm_.rank() && direct_->incarnation(p) != DirectOps::kNone &&
        direct_->incarnation(p) != inc)
      direct_->retire_now(p);
    out.push_back(p == comm_.rank() ? mine() : directory_.map(p, inc, timeout_ms));
  }
  return out;
}

void DeviceCollectives::finish(cudaStream_t stream) {
  if (!done_) done_ = std::make_unique<CudaEvent>(true);
  done_->record(stream);
  // Polled for as long as a large op's kernels take: a blocking event's wake-up
  // cost a 64 MiB all_reduce on an H100 under MPS 110-170 us of its ~300.
  done_->wait(kFinishPollUs);
}

void DeviceCollectives::after_mapped(cudaStream_t stream) {
  // A mapped all_reduce that went through the segments used this rank's, on
  // whatever stream it was launched on, and no host waited for it.
  // So may an all_to_all with per-pair sizes whose parts went through it.
  if ((options_.mapped || vary_launched_) && direct_order_) direct_order_->join_eager(stream);
}

void DeviceCollectives::check_width(const std::vector<int>& members, const char* op) const {
  for (int p : members)
    MC_CHECK_ARG(p < comm_.size(), op, ": rank ", p, " joined beyond the world size (",
                 comm_.size(), ") and has no slice in the per-rank tensors");
}

void DeviceCollectives::run(OpType type, DType dtype, RedOp op, int root, size_t count, size_t per,
                            cudaStream_t stream, int64_t timeout_ms,
                            const std::function<void(const Piece&, uint8_t*)>& copy_in,
                            const Move& move) {
  OnDevice on(device_);
  after_mapped(stream);
  const size_t pieces = count <= per ? 1 : (count + per - 1) / per;
  auto piece = [&](size_t k) { return Piece{k, k * per, std::min(per, count - k * per)}; };
  // One piece: the segment is free (the last op's commit round said every
  // member had read it), and what is copied in now survives a re-run.
  if (pieces == 1) {
    copy_in(piece(0), mine());
    finish(stream);
  }
  comm_.run_external(
      type, dtype, op, root, count, timeout_ms,
      [&](const std::vector<int>& members, const Communicator::ExternalSync& sync) {
        std::vector<const uint8_t*> segs;
        for (size_t k = 0; k < pieces; ++k) {
          if (pieces > 1) {
            if (k > 0) sync.barrier();  // every member has read piece k - 1
            copy_in(piece(k), mine());
            finish(stream);
          }
          // Every member's piece is in its segment, published: a member that
          // died before is found here, not by a wait for its segment.
          sync.barrier();
          if (k == 0) segs = segments(members, timeout_ms);
          move(piece(k), members, segs);
          finish(stream);  // before the next round (or the commit) lets peers reuse theirs
        }
      });
}

namespace {

const uint8_t* at(const void* p, size_t bytes) {
  return static_cast<const uint8_t*>(p) + bytes;
}
uint8_t* at(void* p, size_t bytes) {
  return static_cast<uint8_t*>(p) + bytes;
}

}  // namespace

void DeviceCollectives::all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op,
                                   cudaStream_t stream, int64_t timeout_ms) {
  reduce(in, out, count, dtype, op, -1, stream, timeout_ms);
}

void DeviceCollectives::reduce(const void* in, void* out, size_t count, DType dtype, RedOp op,
                               int root, cudaStream_t stream, int64_t timeout_ms) {
  const char* name = root < 0 ? "all_reduce" : "reduce";
  MC_CHECK_ARG(redop_supported(op, dtype), name, ": ", redop_name(op), " is not defined on ",
               dtype_name(dtype));
  const size_t esize = dtype_size(dtype);
  const bool writes = root < 0 || comm_.rank() == root;
  MC_CHECK_ARG(!writes || in != out || in_place_ok(count * esize), name,
               ": the output must not be the input when it is larger than the segment");
  run(
      root < 0 ? OpType::kAllReduce : OpType::kReduce, dtype, op, root, count, per_piece(1, esize),
      stream, timeout_ms,
      [&](const Piece& p, uint8_t* seg) {
        copy(seg, at(in, p.first * esize), p.n * esize, stream, "reduce input");
      },
      [&](const Piece& p, const std::vector<int>&, const std::vector<const uint8_t*>& segs) {
        if (writes) reduce_segments(segs, 0, at(out, p.first * esize), p.n, dtype, op, stream);
      });
}

void DeviceCollectives::broadcast(const void* in, void* out, size_t count, DType dtype, int root,
                                  cudaStream_t stream, int64_t timeout_ms) {
  const size_t esize = dtype_size(dtype);
  const bool am_root = comm_.rank() == root;
  run(
      OpType::kBroadcast, dtype, RedOp::kSum, root, count, per_piece(1, esize), stream, timeout_ms,
      [&](const Piece& p, uint8_t* seg) {
        if (am_root) copy(seg, at(in, p.first * esize), p.n * esize, stream, "broadcast input");
      },
      [&](const Piece& p, const std::vector<int>& members,
          const std::vector<const uint8_t*>& segs) {
        if (am_root) return;
        const size_t i = std::find(members.begin(), members.end(), root) - members.begin();
        copy(at(out, p.first * esize), segs[i], p.n * esize, stream, "broadcast copy");
      });
}

void DeviceCollectives::all_gather(const void* in, size_t count, DType dtype, void* const* outs,
                                   cudaStream_t stream, int64_t timeout_ms) {
  gather(in, count, dtype, outs, -1, stream, timeout_ms);
}

void DeviceCollectives::gather(const void* in, size_t count, DType dtype, void* const* outs,
                               int root, cudaStream_t stream, int64_t timeout_ms) {
  const char* name = root < 0 ? "all_gather" : "gather";
  const size_t esize = dtype_size(dtype);
  const bool writes = root < 0 || comm_.rank() == root;
  run(
      root < 0 ? OpType::kAllGather : OpType::kGather, dtype, RedOp::kSum, root, count,
      per_piece(1, esize), stream, timeout_ms,
      [&](const Piece& p, uint8_t* seg) {
        copy(seg, at(in, p.first * esize), p.n * esize, stream, "gather input");
      },
      [&](const Piece& p, const std::vector<int>& members,
          const std::vector<const uint8_t*>& segs) {
        check_width(members, name);
        if (!writes) return;
        // Member i's piece into outs[members[i]]; zeros for the ranks outside the view.
        const size_t off = p.first * esize, bytes = p.n * esize;
        std::vector<bool> filled(static_cast<size_t>(comm_.size()), false);
        for (size_t i = 0; i < members.size(); ++i) {
          filled[static_cast<size_t>(members[i])] = true;
          copy(at(outs[members[i]], off), segs[i], bytes, stream, "gather copy");
        }
        for (size_t q = 0; q < filled.size(); ++q)
          if (!filled[q]) zero(at(outs[q], off), bytes, stream, "gather zero fill");
      });
}

void DeviceCollectives::scatter(const void* const* ins, void* out, size_t count, DType dtype,
                                int root, cudaStream_t stream, int64_t timeout_ms) {
  const size_t esize = dtype_size(dtype);
  const auto world = static_cast<size_t>(comm_.size());
  const bool am_root = comm_.rank() == root;
  run(
      OpType::kScatter, dtype, RedOp::kSum, root, count, per_piece(world, esize), stream,
      timeout_ms,
      [&](const Piece& p, uint8_t* seg) {
        if (!am_root) return;
        for (size_t q = 0; q < world; ++q)
          copy(seg + q * p.n * esize, at(ins[q], p.first * esize), p.n * esize, stream,
               "scatter input");
      },
      [&](const Piece& p, const std::vector<int>& members,
          const std::vector<const uint8_t*>& segs) {
        check_width(members, "scatter");
        const size_t i = std::find(members.begin(), members.end(), root) - members.begin();
        copy(at(out, p.first * esize), segs[i] + static_cast<size_t>(comm_.rank()) * p.n * esize,
             p.n * esize, stream, "scatter copy");
      });
}

void DeviceCollectives::reduce_scatter(const void* const* ins, void* out, size_t count, DType dtype,
                                       RedOp op, cudaStream_t stream, int64_t timeout_ms) {
  MC_CHECK_ARG(redop_supported(op, dtype), "reduce_scatter: ", redop_name(op),
               " is not defined on ", dtype_name(dtype));
  const size_t esize = dtype_size(dtype);
  const auto world = static_cast<size_t>(comm_.size());
  run(
      OpType::kReduceScatter, dtype, op, -1, count, per_piece(world, esize), stream, timeout_ms,
      [&](const Piece& p, uint8_t* seg) {
        // One slice per rank, as reduce_scatter_tensor's input holds them: one
        // copy when the op is one piece and the caller's slices lie that way.
        const size_t bytes = p.n * esize;
        bool packed = p.n == count;
        for (size_t q = 1; q < world && packed; ++q) packed = ins[q] == at(ins[0], q * bytes);
        if (packed) {
          copy(seg, ins[0], world * bytes, stream, "reduce_scatter input");
          return;
        }
        for (size_t q = 0; q < world; ++q)
          copy(seg + q * bytes, at(ins[q], p.first * esize), bytes, stream, "reduce_scatter input");
      },
      [&](const Piece& p, const std::vector<int>& members,
          const std::vector<const uint8_t*>& segs) {
        check_width(members, "reduce_scatter");
        reduce_segments(segs, static_cast<size_t>(comm_.rank()) * p.n * esize,
                        at(out, p.first * esize), p.n, dtype, op, stream);
      });
}

void DeviceCollectives::check_own_counts(int rank, const size_t* in_counts,
                                         const size_t* out_counts, const char* what) {
  MC_CHECK_ARG(in_counts[rank] == out_counts[rank], what, ": rank ", rank, " sends itself ",
               in_counts[rank], " elements but expects ", out_counts[rank], " from itself");
}

void DeviceCollectives::all_to_all(const void* const* ins, const size_t* in_counts,
                                   void* const* outs, const size_t* out_counts, DType dtype,
                                   cudaStream_t stream, int64_t timeout_ms) {
  OnDevice on(device_);
  const int rank = comm_.rank(), world = comm_.size();
  check_own_counts(rank, in_counts, out_counts, "all_to_all");
  const size_t esize = dtype_size(dtype);
  // Region p of a rank's segment holds what it sends rank p, one piece per round.
  const size_t region =
      options_.segment_bytes / static_cast<size_t>(world) / kMinRegion * kMinRegion;
  after_mapped(stream);
  uint8_t* own = mine();
  const auto* const* src = reinterpret_cast<const uint8_t* const*>(ins);
  auto* const* dst = reinterpret_cast<uint8_t* const*>(outs);
  auto piece = [&](size_t bytes, size_t k) { return piece_bytes(bytes, region, k); };
  comm_.run_external(
      OpType::kAllToAll, dtype, RedOp::kSum, -1, 0, timeout_ms,
      [&](const std::vector<int>& members, const Communicator::ExternalSync& sync) {
        check_width(members, "all_to_all");
        std::vector<size_t> send(static_cast<size_t>(comm_.capacity()), 0), recv = send;
        uint64_t my_rounds = 0;
        for (int p : members) {
          if (p == rank) continue;
          send[p] = in_counts[p] * esize;
          recv[p] = out_counts[p] * esize;
          my_rounds = std::max(
              {my_rounds, (send[p] + region - 1) / region, (recv[p] + region - 1) / region});
        }
        auto stage = [&](size_t k) {
          for (int p : members)
            if (p != rank)
              copy(own + p * region, src[p] + k * region, piece(send[p], k), stream,
                   "all_to_all staging");
          finish(stream);
        };
        // Round 0 is staged before the round of headers that checks the
        // sizes, which so also says every member's pieces are in place.
        stage(0);
        const uint64_t rounds = sync.sized(send, recv, my_rounds);
        // After that round every member has published its segment (see run).
        auto segs = segments(members, timeout_ms);
        copy(dst[rank], src[rank], in_counts[rank] * esize, stream, "all_to_all own slice");
        std::vector<bool> member(static_cast<size_t>(world), false);
        for (int p : members) member[p] = true;
        for (int p = 0; p < world; ++p)  // ranks outside the view: zeros
          if (!member[p]) zero(dst[p], out_counts[p] * esize, stream, "all_to_all zero fill");
        for (uint64_t k = 0; k < rounds; ++k) {
          if (k > 0) {
            sync.barrier();  // every member has read round k - 1
            stage(k);
            sync.barrier();  // every member's round k is in place
          }
          for (size_t i = 0; i < members.size(); ++i)
            if (members[i] != rank)
              copy(dst[members[i]] + k * region, segs[i] + rank * region,
                   piece(recv[members[i]], k), stream, "all_to_all copy");
          finish(stream);
        }
      });
}

// --- the device-driven ops ------------------------------------------------------------------

namespace {

using kernels::DirectKind;

// The `parts` pointers `bytes` apart from `base` (a null base, as a count of 0
// may have: nulls).
template <typename P>
std::vector<P> parts_of(P base, size_t bytes, int parts) {
  std::vector<P> out;
  for (int p = 0; p < parts; ++p)
    out.push_back(base == nullptr
                      ? nullptr
                      : reinterpret_cast<P>(reinterpret_cast<uintptr_t>(base) + p * bytes));
  return out;
}

}  // namespace

bool DeviceCollectives::direct_serves(const DirectOp& op, int64_t timeout_ms) {
  // The root's input, the largest any rank has: the same answer everywhere.
  const size_t bytes =
      kernels::direct_in_parts(op.kind, comm_.size(), true) * op.count * dtype_size(op.dtype);
  if (direct_max_bytes() == 0 || bytes > direct_max_bytes()) return false;
  if (op.count >= kernels::kDirectMaxCount) return false;
  if (comm_.size() > kernels::kDirectMaxRanks) return false;
  // Per-pair sizes: a table in the area's input, and a region per rank in the
  // segment's host-driven part for parts past the area's (any size, in rounds).
  if (op.vary && (direct_layout().input_bytes < kernels::VaryTable::bytes(comm_.size()) ||
                  direct_offset() < static_cast<size_t>(comm_.size()) * kAlignBytes))
    return false;
  return serves(std::nullopt, timeout_ms);
}

size_t DeviceCollectives::vary_max_part() const {
  const size_t region =
      direct_offset() / static_cast<size_t>(comm_.size()) / kAlignBytes * kAlignBytes;
  return region * kernels::kVaryMaxRounds;
}

size_t DeviceCollectives::direct_chunk(const DirectOp& op) const {
  const size_t parts = kernels::direct_in_parts(op.kind, comm_.size(), true);
  const size_t n = std::min(direct_max_bytes() / (parts * dtype_size(op.dtype)),
                            static_cast<size_t>(kernels::kDirectMaxCount - 1));
  return n / 16 * 16;  // each chunk's pointers as aligned as the first's
}

bool DeviceCollectives::direct_alone(int64_t timeout_ms) {
  // No slot to spare either: a rank that joined past the world size takes part.
  return comm_.size() == 1 && comm_.capacity() == 1 && direct_max_bytes() > 0 &&
         serves(std::nullopt, timeout_ms);
}

bool DeviceCollectives::direct_ready() {
  if (!direct_ || !direct_->installed() || direct_->left_behind()) return false;
  const uint64_t epoch = comm_.epoch();
  return direct_->epoch() == epoch && !told_left_out(comm_.endpoint(), epoch);
}

void DeviceCollectives::direct_setup(const DirectOp& op, cudaStream_t stream, int64_t timeout_ms) {
  // This rank's launches, and replays, on every stream (torch's streams do
  // not wait for each other) are over before the members meet: none of the
  // last generation meets a signal of the next, and none reads the table
  // while it changes.
  cuda_check(cudaDeviceSynchronize(), "waiting for the earlier device-driven launches");
  const int world = comm_.size();
  if (!direct_) {
    direct_ =
        std::make_unique<DirectOps>(device_, comm_.rank(), world, direct_layout(), direct_offset());
    direct_order_ = std::make_unique<LaunchOrder>();  // here, never under capture
    watch_lost(comm_.endpoint(), direct_->lost_words(), comm_.config().hang_ms);
  }
  direct_->set_report(report_to_);
  mine();  // published before the members meet, so that each can map the others'
  std::vector<uint8_t*> areas(static_cast<size_t>(world), nullptr);
  std::vector<uint32_t> incarnations(static_cast<size_t>(world), DirectOps::kNone);
  std::vector<LifeRef> lives(static_cast<size_t>(world));
  uint64_t gen = 0;
  bool fits = true;
  // The round names no root (one that died would fail it, where a launch
  // zero-fills its part) and no kind (calls that disagree leave each other
  // out at the launch, as they do without a setup).
  comm_.run_external(OpType::kAllReduce, op.dtype, RedOp::kSum, -1, op.count, timeout_ms,
                     [&](const std::vector<int>& members, const Communicator::ExternalSync& sync) {
                       fits = std::all_of(members.begin(), members.end(),
                                          [&](int p) { return p < world; });
                       // Every member is here, its segment published and its launches over;
                       // the generation goes past every member's last, so that no signal of
                       // an earlier setup (a member left out and still running) is taken.
                       const std::vector<size_t> none(static_cast<size_t>(comm_.capacity()), 0);
                       gen = sync.sized(none, none, uint64_t{direct_->generation()} + 1);
                       std::fill(areas.begin(), areas.end(), nullptr);
                       if (!fits) return;
                       const View view = comm_.view();
                       const auto segs = segments(members, timeout_ms);
                       for (size_t i = 0; i < members.size(); ++i) {
                         const auto p = static_cast<size_t>(members[i]);
                         areas[p] = const_cast<uint8_t*>(segs[i]) + direct_offset();
                         incarnations[p] = view.incarnation[p];
                         if (members[i] != comm_.rank()) lives[p] = directory_.life(members[i]);
                       }
                     });
  const uint64_t epoch = comm_.epoch();
  if (!fits) {
    direct_unfit_epoch_ = epoch;
    return;
  }
  direct_->install(areas, incarnations, lives, static_cast<uint32_t>(gen), epoch, stream);
}

void DeviceCollectives::direct_on_plane(const DirectOp& op, cudaStream_t stream,
                                        int64_t timeout_ms) {
  const int world = comm_.size();
  const size_t part = op.count * dtype_size(op.dtype);
  // Each part of a multi-part in or out: a stride apart (a piece of an op).
  const size_t apart = op.part_stride() * dtype_size(op.dtype);
  // A side given as one buffer per part (DirectOp::list) is those buffers.
  auto ins = parts_of(op.in, apart, world);
  auto outs = parts_of(op.out, apart, world);
  if (op.list == kernels::DirectList::kIn)
    ins.assign(op.parts.begin(), op.parts.end());
  else if (op.list == kernels::DirectList::kOut)
    outs.assign(op.parts.begin(), op.parts.end());
  const bool root = comm_.rank() == op.root;
  switch (op.kind) {
    case DirectKind::kAllReduce:
      return all_reduce(op.in, op.out, op.count, op.dtype, op.op, stream, timeout_ms);
    case DirectKind::kReduce:
      return reduce(op.in, op.out, op.count, op.dtype, op.op, op.root, stream, timeout_ms);
    case DirectKind::kBroadcast:
      broadcast(op.in, op.out, op.count, op.dtype, op.root, stream, timeout_ms);
      // The plane's root writes nothing; the kernel's copies its input to `out`.
      if (comm_.rank() == op.root && op.in != op.out && part > 0)
        cuda_check(cudaMemcpyAsync(op.out, op.in, part, cudaMemcpyDeviceToDevice, stream),
                   "broadcast: the root's output");
      return;
    case DirectKind::kAllGather:
      return all_gather(op.in, op.count, op.dtype, outs.data(), stream, timeout_ms);
    case DirectKind::kGather:
      return gather(op.in, op.count, op.dtype, root ? outs.data() : nullptr, op.root, stream,
                    timeout_ms);
    case DirectKind::kReduceScatter:
      return reduce_scatter(ins.data(), op.out, op.count, op.dtype, op.op, stream, timeout_ms);
    case DirectKind::kScatter:
      return scatter(root ? ins.data() : nullptr, op.out, op.count, op.dtype, op.root, stream,
                     timeout_ms);
    case DirectKind::kAllToAll: {
      if (op.vary) {
        const size_t esize = dtype_size(op.dtype);
        std::vector<size_t> in_counts, out_counts;
        for (size_t p = 0; p < op.parts.size(); ++p) {
          in_counts.push_back(op.send_bytes[p] / esize);
          out_counts.push_back(op.recv_bytes[p] / esize);
        }
        return all_to_all(op.in_parts.data(), in_counts.data(), op.parts.data(), out_counts.data(),
                          op.dtype, stream, timeout_ms);
      }
      const std::vector<size_t> counts(static_cast<size_t>(world), op.count);
      return all_to_all(ins.data(), counts.data(), outs.data(), counts.data(), op.dtype, stream,
                        timeout_ms);
    }
  }
}

bool DeviceCollectives::direct_set_up(const DirectOp& op, cudaStream_t stream, int64_t timeout_ms) {
  if (direct_ready()) return true;
  const uint64_t epoch = comm_.epoch();
  // Left behind in this view: until the view changes (a later setup may take it in again).
  const bool left = (direct_ && direct_->left_behind() && direct_->epoch() == epoch) ||
                    told_left_out(comm_.endpoint(), epoch);
  if (!left && direct_unfit_epoch_ != epoch) direct_setup(op, stream, timeout_ms);
  return direct_ready();
}

void DeviceCollectives::direct_prepare(const DirectOp& op, cudaStream_t stream,
                                       int64_t timeout_ms) {
  if (timeout_ms <= 0) timeout_ms = comm_.config().timeout_ms;
  DirectOp probe = op;
  // Alone, any size is served; the setup round (no peer to agree with) takes
  // an op the kernels would.
  if (direct_alone(timeout_ms)) probe.count = std::min<size_t>(probe.count, 1);
  if (!direct_serves(probe, timeout_ms)) return;
  OnDevice on(device_);
  direct_set_up(probe, stream, timeout_ms);
}

uint64_t DeviceCollectives::direct_members() const {
  uint64_t bits = 0;
  const int n = std::min(comm_.size(), 64);
  for (int p = 0; direct_ && p < n; ++p)
    if (direct_->incarnation(p) != DirectOps::kNone) bits |= uint64_t{1} << p;
  return bits;
}

void DeviceCollectives::direct_poll() {
  if (direct_)
    for (const std::string& line : direct_->take_reports())
      MC_LOG(kWarn, "device-driven collectives on rank ", comm_.rank(), ": ", line);
}

void DeviceCollectives::direct(const DirectOp& op, cudaStream_t stream, int64_t timeout_ms,
                               const char* reject, bool queued) {
  OnDevice on(device_);
  if (timeout_ms <= 0) timeout_ms = comm_.config().timeout_ms;
  if (!queued) {
    // The caller polled and found the path ready, on this thread: a launch
    // alone, unless the view changed since.
    if (!direct_ready()) ranks_changed();
  } else {
    direct_poll();
  }
  if (queued && !direct_set_up(op, stream, timeout_ms)) {
    // The host-driven plane: it tells a rank left out so, and serves any view.
    if (reject != nullptr)
      comm_.reject(reject, timeout_ms);
    else
      direct_on_plane(op, stream, timeout_ms);
    return;
  }
  const int world = comm_.size();
  const size_t esize = dtype_size(op.dtype);
  const bool root = comm_.rank() == op.root;
  size_t bytes = std::max(kernels::direct_in_parts(op.kind, world, root),
                          kernels::direct_out_parts(op.kind, world, root)) *
                 op.count * esize;
  if (op.vary) {
    size_t sent = 0, got = 0;
    for (size_t p = 0; p < op.send_bytes.size(); ++p) {
      sent += op.send_bytes[p];
      got += op.recv_bytes[p];
    }
    bytes = std::max(sent, got);
    // Its regions may lie in the segment: the plane's next writer of it waits.
    vary_launched_ = true;
  }
  const bool two_shot =
      world >= 2 && (options_.direct == Direct::kTwoShot ||
                     (options_.direct == Direct::kAuto && world > 2 && bytes > kOneShotBytes));
  const int blocks = direct_grid(bytes);
  direct_order_->before(stream);
  direct_->launch(op, two_shot, reject != nullptr, timeout_ms, blocks, stream);
  direct_order_->after(stream);
}

int DeviceCollectives::direct_grid(size_t bytes, bool mapped) {
  // The group's ranks on this GPU (every rank, where serves() was not asked)
  // each take their share of it: every block of each launch must be resident.
  // (Asked of the driver once: launches of small ops go through here.)
  if (sm_share_ == 0)
    sm_share_ =
        std::max(1, device_sm_count(device_) / (gpu_sharers_ > 0 ? gpu_sharers_ : comm_.size()));
  const int most =
      std::min(sm_share_, mapped ? kernels::kDirectMaxMappedBlocks : kernels::kDirectMaxBlocks);
  const size_t want = (bytes + kDirectBytesPerBlock - 1) / kDirectBytesPerBlock;
  return static_cast<int>(std::clamp<size_t>(want, 1, static_cast<size_t>(most)));
}

namespace {

// The one-element all_reduce a mapped one is decided and set up as (every
// member decides alike: the same options, the same view, the same op queue
// order).
DirectOps::Op mapped_probe(DType dtype, RedOp op) {
  DirectOps::Op probe;
  probe.kind = kernels::DirectKind::kAllReduce;
  probe.count = 1;
  probe.dtype = dtype;
  probe.op = op;
  return probe;
}

}  // namespace

bool DeviceCollectives::mapped_serves(size_t count, DType dtype, RedOp op, int64_t timeout_ms) {
  if (!options_.mapped || comm_.size() < 2 || count == 0 || !redop_supported(op, dtype) ||
      count * dtype_size(dtype) <= direct_max_bytes())
    return false;
  if (timeout_ms <= 0) timeout_ms = comm_.config().timeout_ms;
  return direct_serves(mapped_probe(dtype, op), timeout_ms);
}

bool DeviceCollectives::mapped_all_reduce(void* t, size_t count, DType dtype, RedOp op,
                                          cudaStream_t stream, int64_t timeout_ms, bool queued,
                                          const char* reject) {
  OnDevice on(device_);
  if (timeout_ms <= 0) timeout_ms = comm_.config().timeout_ms;
  const DirectOp probe = mapped_probe(dtype, op);
  // An earlier launch that wrote nothing here (the others stopped waiting for
  // this rank): said once this call is launched, as usual (its op count stays
  // in step with the others'; the view, not this rank alone, sets up again).
  uint64_t left = 0;
  {
    std::lock_guard<std::mutex> lock(mapped_mu_);
    reap_mapped();
    left = std::exchange(mapped_left_, 0);
    if (left != 0) mapped_said_ = mapped_launches_;  // the rest of that episode: said now
  }
  // Until it is said below, the word goes back for the next call on every way
  // out (the plane instead, or a setup or launch that raises).
  struct KeepLeft {
    DeviceCollectives& c;
    uint64_t word;
    ~KeepLeft() {
      if (word == 0) return;
      std::lock_guard<std::mutex> lock(c.mapped_mu_);
      c.mapped_left_ = word;
    }
  } keep{*this, left};
  if (queued) direct_poll();
  if (queued &&
      (!mapped_serves(count, dtype, op, timeout_ms) || !direct_set_up(probe, stream, timeout_ms))) {
    // The host-driven plane: it tells a rank left out so, and serves any view
    // (an earlier launch's word waits for the next call here).
    if (reject == nullptr) return false;
    comm_.reject(reject, timeout_ms);
    return true;
  }
  if (!queued && !direct_ready()) ranks_changed();
  const size_t esize = dtype_size(dtype);
  const kernels::DirectLayout& L = direct_->layout();
  // A piece whose share among the members the setup took in fits a parity of
  // the area (with fewer left at its launch the share is larger: that launch
  // goes through the segments), and that fits a segment (the way through it).
  const size_t vec = 16 / esize;
  const size_t share = (L.parity_bytes / esize / vec - 1) * vec;
  // (The setup's members, alike at every rank: not the table a departure changes.)
  const auto members = static_cast<size_t>(std::max(1, direct_->installed_members()));
  const size_t per = std::max(vec, std::min(share * members, per_piece(1, esize)) / vec * vec);
  // The exports earlier launches lacked, mapped before these launches read the table.
  direct_->map_offers(*direct_order_, stream);
  auto* base = static_cast<uint8_t*>(t);
  for (size_t first = 0; first < count; first += per) {
    const size_t n = std::min(per, count - first);
    DirectOp piece = probe;
    piece.count = n;
    piece.mapped = true;
    if (reject == nullptr) {
      piece.in = piece.out = base + first * esize;
      piece.offer = direct_->offer(piece.out, n * esize, stream);
    }
    DirectOutcomes::Lease lease = outcomes_->lease();
    piece.outcome = lease.device();
    piece.ticket = lease.ticket();
    direct_order_->before(stream);
    direct_->launch(piece, false, reject != nullptr, timeout_ms, direct_grid(n * esize, true),
                    stream);
    direct_order_->after(stream);
    std::lock_guard<std::mutex> lock(mapped_mu_);
    mapped_pending_.push_back({std::move(lease), reject != nullptr, ++mapped_launches_});
  }
  keep.word = 0;
  if (left != 0)
    throw_error(ErrorKind::kTimeout, -1,
                "all_reduce: an earlier all_reduce on this group (this rank's mapped launch ", left,
                ") went on without this rank, silent past the op's timeout, and left its tensor "
                "with this rank's own input; this call was launched as usual");
  return true;
}

void DeviceCollectives::reap_mapped() {
  // Launches end in order (LaunchOrder): the first unfinished one ends the look.
  while (!mapped_pending_.empty()) {
    const MappedLaunch& l = mapped_pending_.front();
    const std::optional<kernels::DirectOutcome> o = l.lease.read();
    if (!o) break;
    if (o->mapped == 1) ++mapped_done_;
    if (o->mapped == 2) ++mapped_planed_;
    // Wrote nothing here (a rejected call writes nothing by design, and raises).
    if (o->mapped == 0 && !l.rejected && l.number > mapped_said_ && mapped_left_ == 0)
      mapped_left_ = l.number;
    mapped_pending_.pop_front();
  }
}

std::pair<int64_t, int64_t> DeviceCollectives::mapped_pieces() {
  std::lock_guard<std::mutex> lock(mapped_mu_);
  reap_mapped();
  return {mapped_done_, mapped_planed_};
}

void DeviceCollectives::direct_view_changed(const std::vector<uint8_t>& active,
                                            cudaStream_t stream) {
  if (!direct_) return;
  OnDevice on(device_);
  const size_t n = std::min(active.size(), static_cast<size_t>(comm_.size()));
  for (size_t p = 0; p < n; ++p)
    if (active[p] == 0 && direct_->incarnation(static_cast<int>(p)) != DirectOps::kNone)
      direct_->retire(static_cast<int>(p), stream);
}

}  // namespace mooncake
