#include "collectives/communicator.h"

#include <algorithm>
#include <cstring>

#include "collectives/reduce.h"
#include "core/copy.h"
#include "core/error.h"
#include "core/limits.h"
#include "core/log.h"

namespace mooncake {

namespace {
// An exchange that receives at least this much in all writes it past the
// cache. About what a core's share of a last-level cache holds.
constexpr size_t kPastCacheBytes = size_t{4} << 20;
}  // namespace

const char* op_name(OpType t) {
  switch (t) {
    case OpType::kBarrier: return "barrier";
    case OpType::kAllReduce: return "all_reduce";
    case OpType::kBroadcast: return "broadcast";
    case OpType::kAllGather: return "all_gather";
    case OpType::kReduceScatter: return "reduce_scatter";
    case OpType::kAllToAll: return "all_to_all";
    case OpType::kReduce: return "reduce";
    case OpType::kGather: return "gather";
    case OpType::kScatter: return "scatter";
    case OpType::kAdmit: return "recover_ranks";
    case OpType::kForward: return "result hand-on";
  }
  return "op";
}

Layout make_layout(int capacity, size_t chunk_bytes) {
  Layout l;
  l.capacity = capacity;
  l.chunk_bytes = chunk_bytes;
  return l;
}

Communicator::Communicator(const TransferEngine& engine, Store& store, const std::string& prefix,
                           int rank, int size, const CommConfig& config, int capacity, bool joining)
    : rank_(rank),
      size_(size),
      capacity_(capacity > 0 ? capacity : size),
      config_(config),
      store_(store),
      prefix_(prefix) {
  MC_CHECK_ARG(size >= 1, "world size must be >= 1, got ", size);
  MC_CHECK_ARG(capacity_ >= size, "max_world_size (", capacity_, ") must be >= the world size (",
               size, ")");
  MC_CHECK_ARG(capacity_ <= kMaxCapacity, "max_world_size must be <= ", kMaxCapacity, ", got ",
               capacity_);
  MC_CHECK_ARG(rank >= 0 && rank < capacity_, "rank must be in [0, ", capacity_, "), got ", rank);
  MC_CHECK_ARG(joining || rank < size, "rank must be in [0, ", size, "), got ", rank);
  CommConfig env = CommConfig::from_env(config.timeout_ms);
  if (config_.chunk_bytes == 0) config_.chunk_bytes = env.chunk_bytes;
  if (config_.small_bytes == 0) config_.small_bytes = env.small_bytes;
  if (config_.recover < 0) config_.recover = env.recover;
  if (config_.hang_ms < 0) config_.hang_ms = env.hang_ms;
  MC_CHECK_ARG(config_.recover == kRecoverRerun || config_.recover == kRecoverOff ||
                   config_.recover == kRecoverDeferred,
               "CommConfig.recover must be 0, 1 or 2, got ", config_.recover);
  MC_CHECK_ARG(config_.chunk_bytes >= 64 && config_.chunk_bytes % 64 == 0,
               "CommConfig.chunk_bytes must be a positive multiple of 64, got ",
               config_.chunk_bytes);
  Layout layout = make_layout(capacity_, config_.chunk_bytes);
  if (joining) {
    // A new process for this slot: its incarnation tells it from the ones before.
    incarnation_ =
        static_cast<uint32_t>(store_.add(prefix_ + "slot/" + std::to_string(rank) + "/inc", 1));
  }
  endpoint_ = std::make_unique<Endpoint>(engine, store_, prefix_, rank, incarnation_, capacity_,
                                         layout.total_bytes());
  // Without re-runs every member must fail fast on any failure: a survivor
  // that gave up no longer sends what the others wait for.
  coll_ =
      std::make_unique<Channels>(*endpoint_, layout, Plane::kCollective,
                                 config_.recover == kRecoverRerun ? Channels::Watch::kPeerOrEpoch
                                                                  : Channels::Watch::kAnyWatched,
                                 config_.hang_ms);
  p2p_ = std::make_unique<Channels>(*endpoint_, layout, Plane::kP2P, Channels::Watch::kPeer,
                                    config_.hang_ms);
  if (joining) {
    runner_ = std::make_unique<OpRunner>(store_, prefix_, rank, size, capacity_, config_,
                                         *endpoint_, *coll_, *p2p_, true, header_round());
    store_.set(prefix_ + "waiting/" + std::to_string(rank),
               str(incarnation_, ' ', capacity_));  // see waiting_incarnation
    return;
  }
  endpoint_->connect_all(size, Deadline::after_ms(config_.timeout_ms));
  runner_ = std::make_unique<OpRunner>(store_, prefix_, rank, size, capacity_, config_, *endpoint_,
                                       *coll_, *p2p_, false, header_round());
}

OpRunner::HeaderRound Communicator::header_round() {
  return [this](const OpMeta& meta) { exchange(meta, Plan(capacity_), false); };
}

Communicator::~Communicator() = default;

void Communicator::stop() {
  runner_->stop();
  coll_->set_stopping();
  p2p_->set_stopping();
}

std::string Communicator::root_error(int root, const char* what) const {
  if (root >= 0 && root < capacity_) return {};
  return str(what, ": root rank must be in [0, ", capacity_, "), got ", root);
}

std::string Communicator::width_error(const char* what, int width) const {
  if (runner_->members().back() < width) return {};
  return str(what, ": rank ", runner_->members().back(),
             " is a member, but this rank's per-rank tensor lists have only ", width,
             " entries (give one per rank up to the highest member)");
}

std::string Communicator::redop_error(RedOp op, DType dtype, const char* what) const {
  if (redop_supported(op, dtype)) return {};
  return str(what, ": op ", redop_name(op), " is not supported for dtype ", dtype_name(dtype));
}

std::string Communicator::validate(const OpMeta& meta, const MsgHeader& h, int peer,
                                   size_t expect_recv, size_t expect_send) const {
  if (h.flags & kMsgRejected)  // the payload is that rank's own error
    return str(meta.name, ": the op was not run: rank ", peer, " rejected its arguments: ",
               std::string(reinterpret_cast<const char*>(&h + 1), h.len));
  if (h.op_type != static_cast<uint32_t>(meta.type))
    return str(meta.name, ": rank ", peer, " called ", op_name(static_cast<OpType>(h.op_type)),
               " while rank ", rank_, " called ", meta.name);
  if (h.op_seq != meta.seq)
    return str(meta.name, ": rank ", peer, " is at collective #", h.op_seq, " but rank ", rank_,
               " is at #", meta.seq);
  if (h.dtype != static_cast<uint8_t>(meta.dtype))
    return str(meta.name, ": tensor dtypes differ: rank ", peer, " has ",
               dtype_name(static_cast<DType>(h.dtype)), ", rank ", rank_, " has ",
               dtype_name(meta.dtype));
  if (h.redop != static_cast<uint8_t>(meta.redop))
    return str(meta.name, ": reduce ops differ: rank ", peer, " uses ",
               redop_name(static_cast<RedOp>(h.redop)), ", rank ", rank_, " uses ",
               redop_name(meta.redop));
  if (h.root != meta.root)
    return str(meta.name, ": root ranks differ: rank ", peer, " uses ", h.root, ", rank ", rank_,
               " uses ", meta.root);
  if (h.numel != meta.numel)
    return meta.type == OpType::kAdmit
               ? str(meta.name, ": ranks ", peer, " and ", rank_,
                     " name different ranks to recover (or see different processes waiting)")
               : str(meta.name, ": tensor sizes differ: rank ", peer, " has ", h.numel,
                     " elements, rank ", rank_, " has ", meta.numel);
  if (h.edge_bytes != expect_recv || h.edge_expect != expect_send)
    return str(meta.name, ": split sizes disagree between ranks ", peer, " and ", rank_, ": rank ",
               peer, " sends ", h.edge_bytes, " bytes and expects ", h.edge_expect, ", rank ",
               rank_, " expects ", expect_recv, " bytes and sends ", expect_send);
  return {};
}

MsgHeader Communicator::header(const OpMeta& meta) const {
  MsgHeader h{};
  h.op_seq = meta.seq;
  h.op_type = static_cast<uint32_t>(meta.type);
  h.dtype = static_cast<uint8_t>(meta.dtype);
  h.redop = static_cast<uint8_t>(meta.redop);
  h.root = meta.root;
  h.numel = meta.numel;
  if (!meta.local_error.empty()) h.flags |= kMsgRejected;
  return h;
}

bool Communicator::exchange(const OpMeta& meta, const Plan& plan, bool agree_on_sizes,
                            bool headers_only, uint64_t* value) {
  const size_t chunk = coll_->layout().chunk_bytes;
  const std::vector<int>& m = runner_->members();
  const int n = static_cast<int>(m.size());
  const int me = static_cast<int>(std::find(m.begin(), m.end(), rank_) - m.begin());
  const bool rejected = !meta.local_error.empty();
  if (!rejected && !headers_only && plan.send_bytes[rank_] != 0 &&
      plan.send[rank_] != plan.recv[rank_])
    std::memmove(plan.recv[rank_], plan.send[rank_], plan.send_bytes[rank_]);
  size_t steps = 1, recv_total = 0;
  for (int p : m) {
    if (p == rank_ || rejected || headers_only) continue;
    steps = std::max(
        {steps, num_pieces(plan.send_bytes[p], chunk), num_pieces(plan.recv_bytes[p], chunk)});
    recv_total += plan.recv_bytes[p];
  }
  // What a large op receives goes past the cache: it would not stay there
  // anyway, and a plain store first reads each line it writes.
  const bool past_cache = recv_total >= kPastCacheBytes;
  MsgHeader h = header(meta);
  std::string error = meta.local_error;
  bool peer_rejected = false;
  size_t most_steps = steps;  // over all members, once they agree
  for (size_t k = 0; k < steps; ++k) {
    for (int i = 1; i < n; ++i) {
      const int p = m[(me + i) % n];
      if (rejected) {
        send_rejection(meta, h, p);
        continue;
      }
      size_t len = headers_only ? 0 : piece_bytes(plan.send_bytes[p], chunk, k);
      if (k != 0 && len == 0) continue;
      h.edge_bytes = plan.send_bytes[p];
      h.edge_expect = plan.recv_bytes[p];
      coll_->send(p, h, static_cast<const uint8_t*>(plan.send[p]) + k * chunk, len, meta.deadline,
                  meta.name);
    }
    for (int i = 1; i < n; ++i) {
      const int p = m[(me - i + n) % n];
      size_t len = headers_only ? 0 : piece_bytes(plan.recv_bytes[p], chunk, k);
      if (k != 0 && len == 0) continue;
      const MsgHeader* msg = coll_->receive(p, meta.deadline, meta.name);
      if (k == 0) {
        peer_rejected |= (msg->flags & kMsgRejected) != 0;
        std::string e = validate(meta, *msg, p, plan.recv_bytes[p], plan.send_bytes[p]);
        if (error.empty()) error = e;
      }
      if (error.empty()) {
        MC_ASSERT(msg->len == len, meta.name, " message from rank ", p, " has ", msg->len,
                  " bytes, expected ", len);
        uint8_t* into = static_cast<uint8_t*>(plan.recv[p]) + k * chunk;
        if (len != 0 && past_cache)
          copy_past_cache(into, msg + 1, len);
        else if (len != 0)
          std::memcpy(into, msg + 1, len);
      }
      coll_->release(p, meta.deadline);
    }
    // Sizes that differ per edge may be wrong on some edges only, so not every
    // rank sees the mismatch: share verdicts before anyone moves on. A rank
    // that rejected its arguments is seen by all in step 0, so then everyone
    // skips this round alike.
    if (k == 0 && agree_on_sizes && n > 1 && !rejected && !peer_rejected)
      agree(meta, h, error, value, most_steps);
    if (k == 0 && !error.empty()) throw_error(ErrorKind::kInvalidArgument, -1, error);
  }
  // Each member sends its verdict once it has received all of step 0, so when
  // every member took one step, a rank that has every verdict knows every
  // member has its data. The step counts differ between members (uneven
  // splits): only the agreed largest is the same decision on every rank.
  return agree_on_sizes && n > 1 && most_steps == 1 && !headers_only;
}

void Communicator::agree(const OpMeta& meta, const MsgHeader& h, std::string& error,
                         uint64_t* value, size_t& steps) {
  MsgHeader v = h;
  v.edge_bytes = value != nullptr ? *value : 0;
  v.edge_expect = steps;
  v.numel = error.empty() ? 0 : 1;
  for (int p : runner_->members())
    if (p != rank_) coll_->send(p, v, nullptr, 0, meta.deadline, meta.name);
  int bad_peer = -1;
  for (int p : runner_->members()) {
    if (p == rank_) continue;
    const MsgHeader* msg = coll_->receive(p, meta.deadline, meta.name);
    if (msg->numel != 0 && bad_peer < 0) bad_peer = p;
    if (value != nullptr && msg->edge_bytes > *value) *value = msg->edge_bytes;
    steps = std::max<size_t>(steps, msg->edge_expect);
    coll_->release(p, meta.deadline);
  }
  if (error.empty() && bad_peer >= 0)
    error = str(meta.name, ": rank ", bad_peer,
                " found that split sizes disagree between ranks; the op was not run");
}

void Communicator::reduce_exchange(const OpMeta& meta, const void* const* shard_src,
                                   const size_t* shard_counts, void* out, HostOpData* keep) {
  const size_t esize = dtype_size(meta.dtype);
  const size_t chunk = coll_->layout().chunk_bytes;
  const std::vector<int>& m = runner_->members();
  const int n = static_cast<int>(m.size());
  const int me = static_cast<int>(std::find(m.begin(), m.end(), rank_) - m.begin());
  const bool rejected = !meta.local_error.empty();
  const size_t my_bytes = rejected ? 0 : shard_counts[rank_] * esize;
  size_t steps = num_pieces(my_bytes, chunk);
  for (int p : m)
    if (p != rank_ && !rejected)
      steps = std::max(steps, num_pieces(shard_counts[p] * esize, chunk));
  MsgHeader h = header(meta);
  std::vector<const void*> srcs(static_cast<size_t>(n));
  std::string error = meta.local_error;
  for (size_t k = 0; k < steps; ++k) {
    for (int i = 1; i < n; ++i) {
      const int p = m[(me + i) % n];
      if (rejected) {
        send_rejection(meta, h, p);
        continue;
      }
      size_t bytes = shard_counts[p] * esize;
      size_t len = piece_bytes(bytes, chunk, k);
      if (k != 0 && len == 0) continue;
      h.edge_bytes = bytes;
      h.edge_expect = my_bytes;
      const uint8_t* piece = static_cast<const uint8_t*>(shard_src[p]) + k * chunk;
      coll_->send(p, h, piece, len, meta.deadline, meta.name);
      if (keep) keep->keep(piece, len);  // still in cache from the send
    }
    size_t len = piece_bytes(my_bytes, chunk, k);
    if (k != 0 && len == 0) continue;
    for (int j = 0; j < n; ++j) {  // in rank order: every owner reduces alike
      const int p = m[j];
      if (p == rank_) {
        srcs[j] = rejected ? nullptr : static_cast<const uint8_t*>(shard_src[p]) + k * chunk;
        continue;
      }
      const MsgHeader* msg = coll_->receive(p, meta.deadline, meta.name);
      if (k == 0 && error.empty())
        error = validate(meta, *msg, p, my_bytes, shard_counts[p] * esize);
      srcs[j] = msg + 1;
    }
    if (error.empty()) {
      uint8_t* into = static_cast<uint8_t*>(out) + k * chunk;
      if (keep) {  // this rank's own piece, which the reduction reads and overwrites
        keep->keep(into, len);
        keep->overwrite(into, len);
      }
      reduce_arrays(meta.dtype, meta.redop, into, srcs.data(), n, len / esize, n);
    }
    for (int p : m)
      if (p != rank_) coll_->release(p, meta.deadline);
    if (!error.empty()) throw_error(ErrorKind::kInvalidArgument, -1, error);
  }
}

void Communicator::send_rejection(const OpMeta& meta, const MsgHeader& h, int peer) {
  const size_t len = std::min(meta.local_error.size(), coll_->layout().chunk_bytes);
  coll_->send(peer, h, meta.local_error.data(), len, meta.deadline, meta.name);
}

void Communicator::reject(const std::string& reason, int64_t timeout_ms) {
  MC_ASSERT(!reason.empty());
  OpMeta meta =
      runner_->begin(OpType::kBarrier, DType::kUInt8, RedOp::kSum, -1, 0, timeout_ms, reason);
  HostOpData op_data({}, {});
  runner_->run(meta, Finish::kForward, op_data, [&] { exchange(meta, Plan(capacity_), false); });
}

void Communicator::even_shards(size_t count, std::vector<size_t>& offsets,
                               std::vector<size_t>& counts) const {
  offsets.assign(static_cast<size_t>(capacity_), 0);
  counts.assign(static_cast<size_t>(capacity_), 0);
  const size_t n = runner_->members().size();
  size_t base = count / n, extra = count % n;
  size_t at = 0;
  for (size_t j = 0; j < n; ++j) {
    const int p = runner_->members()[j];
    offsets[p] = at;
    counts[p] = base + (j < extra ? 1 : 0);
    at += counts[p];
  }
}

bool Communicator::direct(size_t count, DType dtype) const {
  return count * dtype_size(dtype) <= config_.small_bytes || runner_->members().size() > count;
}

void Communicator::zero_others(void* const* outs, size_t bytes, int width) const {
  for (int p = 0; p < width; ++p)
    if (!runner_->view().is_member(p) && bytes != 0) std::memset(outs[p], 0, bytes);
}

void Communicator::zero_others(void* const* outs, const size_t* counts, size_t esize,
                               int width) const {
  for (int p = 0; p < width; ++p)
    if (!runner_->view().is_member(p) && counts[p] != 0) std::memset(outs[p], 0, counts[p] * esize);
}

// --- the ops ----------------------------------------------------------------------

void Communicator::run_external(OpType type, DType dtype, RedOp op, int root, uint64_t numel,
                                int64_t timeout_ms, const ExternalAttempt& attempt) {
  OpMeta meta = runner_->begin(type, dtype, op, root, numel, timeout_ms);
  HostOpData nothing({}, Region{});  // the inputs stay where the attempt reads them
  ExternalSync sync;
  sync.barrier = [&] { exchange(meta, Plan(capacity_), false); };
  sync.sized = [&](const std::vector<size_t>& send, const std::vector<size_t>& recv,
                   uint64_t value) {
    Plan plan(capacity_);
    plan.send_bytes = send;
    plan.recv_bytes = recv;
    exchange(meta, plan, true, /*headers_only=*/true, &value);
    return value;
  };
  runner_->run(meta, Finish::kCommit, nothing, [&] { attempt(runner_->members(), sync); });
}

void Communicator::all_reduce(void* data, size_t count, DType dtype, RedOp op, int64_t timeout_ms) {
  OpMeta meta = runner_->begin(OpType::kAllReduce, dtype, op, -1, count, timeout_ms,
                               redop_error(op, dtype, "all_reduce"));
  const size_t esize = dtype_size(dtype);
  const size_t bytes = count * esize;
  auto* base = static_cast<uint8_t*>(data);
  // The input is kept for a re-run even when one step reads it whole before
  // writing: a recovery may start just after the result was written.
  const bool one_step = direct(count, dtype) && bytes <= config_.chunk_bytes;
  const Finish finish = one_step ? Finish::kForward : Finish::kCommit;
  HostOpData op_data({{data, bytes}}, Region{data, bytes});
  // The two-step path keeps its input as it goes (HostOpData::keep_as_it_goes).
  if (bytes > config_.small_bytes) op_data.keep_as_it_goes();
  runner_->run(meta, finish, op_data, [&] {
    const int cap = capacity_;
    if (!meta.local_error.empty() || direct(count, dtype)) {
      op_data.keep(data, bytes);  // all of it at once, if it keeps as it goes
      op_data.overwrite(data, bytes);
      std::vector<const void*> src(static_cast<size_t>(cap), data);
      std::vector<size_t> counts(static_cast<size_t>(cap), count);
      reduce_exchange(meta, src.data(), counts.data(), data);
      return;
    }
    std::vector<size_t> offsets, counts;
    even_shards(count, offsets, counts);
    std::vector<const void*> src(static_cast<size_t>(cap));
    for (int p : runner_->members()) src[p] = base + offsets[p] * esize;
    uint8_t* mine = base + offsets[rank_] * esize;
    reduce_exchange(meta, src.data(), counts.data(), mine, &op_data);
    // Every piece was kept on its way out (the peers' shards) or before it was
    // reduced into (this rank's): the all-gather may overwrite any of it.
    op_data.overwrite(data, bytes);
    // All-gather the reduced shards in place.
    Plan plan(cap);
    for (int p : runner_->members()) {
      plan.send[p] = mine;
      plan.send_bytes[p] = p == rank_ ? 0 : counts[rank_] * esize;
      plan.recv[p] = base + offsets[p] * esize;
      plan.recv_bytes[p] = p == rank_ ? 0 : counts[p] * esize;
    }
    exchange(meta, plan, false);
  });
}

void Communicator::reduce(void* data, size_t count, DType dtype, RedOp op, int root,
                          int64_t timeout_ms) {
  std::string error = root_error(root, "reduce");
  if (error.empty()) error = redop_error(op, dtype, "reduce");
  OpMeta meta = runner_->begin(OpType::kReduce, dtype, op, root, count, timeout_ms, error);
  const size_t esize = dtype_size(dtype);
  auto* base = static_cast<uint8_t*>(data);
  const Region inplace = rank_ == root ? Region{data, count * esize} : Region{};
  HostOpData op_data({}, inplace);
  runner_->run(meta, Finish::kCommit, op_data, [&] {
    const int cap = capacity_;
    std::vector<const void*> src(static_cast<size_t>(cap), data);
    if (!meta.local_error.empty() || direct(count, dtype)) {
      std::vector<size_t> counts(static_cast<size_t>(cap), 0);
      if (meta.local_error.empty()) counts[root] = count;
      reduce_exchange(meta, src.data(), counts.data(), data);
      return;
    }
    // Reduce-scatter into shards, then gather the shards to the root.
    std::vector<size_t> offsets, counts;
    even_shards(count, offsets, counts);
    for (int p : runner_->members()) src[p] = base + offsets[p] * esize;
    std::vector<uint8_t> scratch(rank_ == root ? 0 : counts[rank_] * esize);
    uint8_t* mine = rank_ == root ? base + offsets[rank_] * esize : scratch.data();
    reduce_exchange(meta, src.data(), counts.data(), mine);
    Plan plan(cap);
    if (rank_ == root) {
      for (int p : runner_->members()) {
        plan.recv[p] = base + offsets[p] * esize;
        plan.recv_bytes[p] = p == root ? 0 : counts[p] * esize;
      }
    } else {
      plan.send[root] = mine;
      plan.send_bytes[root] = counts[rank_] * esize;
    }
    exchange(meta, plan, false);
  });
}

void Communicator::broadcast(void* data, size_t count, DType dtype, int root, int64_t timeout_ms) {
  OpMeta meta = runner_->begin(OpType::kBroadcast, dtype, RedOp::kSum, root, count, timeout_ms,
                               root_error(root, "broadcast"));
  const size_t esize = dtype_size(dtype);
  auto* base = static_cast<uint8_t*>(data);
  // The root only reads; the others have no input to keep.
  const Finish finish = direct(count, dtype) ? Finish::kForward : Finish::kCommit;
  HostOpData op_data({{data, count * esize}}, {});
  runner_->run(meta, finish, op_data, [&] {
    Plan plan(capacity_);
    if (!meta.local_error.empty()) {
      exchange(meta, plan, false);
      return;
    }
    if (direct(count, dtype)) {
      if (rank_ == root) {
        for (int p : runner_->members()) {
          plan.send[p] = data;
          plan.send_bytes[p] = p == root ? 0 : count * esize;
        }
      } else {
        plan.recv[root] = data;
        plan.recv_bytes[root] = count * esize;
      }
      exchange(meta, plan, false);
      return;
    }
    // Scatter the shards from the root, then all-gather them.
    std::vector<size_t> offsets, counts;
    even_shards(count, offsets, counts);
    if (rank_ == root) {
      for (int p : runner_->members()) {
        plan.send[p] = base + offsets[p] * esize;
        plan.send_bytes[p] = p == root ? 0 : counts[p] * esize;
      }
    } else {
      plan.recv[root] = base + offsets[rank_] * esize;
      plan.recv_bytes[root] = counts[rank_] * esize;
    }
    exchange(meta, plan, false);
    for (int p : runner_->members()) {
      plan.send[p] = base + offsets[rank_] * esize;
      plan.send_bytes[p] = p == rank_ ? 0 : counts[rank_] * esize;
      plan.recv[p] = base + offsets[p] * esize;
      plan.recv_bytes[p] = p == rank_ ? 0 : counts[p] * esize;
    }
    exchange(meta, plan, false);
  });
}

void Communicator::all_gather(const void* in, size_t count, DType dtype, void* const* outs,
                              int64_t timeout_ms, int width) {
  const int w = width_of(width);
  OpMeta meta = runner_->begin(OpType::kAllGather, dtype, RedOp::kSum, -1, count, timeout_ms,
                               width_error("all_gather", w));
  const size_t bytes = count * dtype_size(dtype);
  std::vector<Region> result;
  for (int p = 0; p < w; ++p) result.push_back({outs[p], bytes});
  const Finish finish =
      bytes * static_cast<size_t>(w) <= config_.small_bytes ? Finish::kForward : Finish::kCommit;
  HostOpData op_data(result, {});
  runner_->run(meta, finish, op_data, [&] {
    Plan plan(capacity_);
    if (meta.local_error.empty()) {
      zero_others(outs, bytes, w);
      for (int p : runner_->members()) {
        plan.send[p] = in;
        plan.recv[p] = outs[p];
        plan.send_bytes[p] = plan.recv_bytes[p] = bytes;
      }
    }
    exchange(meta, plan, false);
  });
}

void Communicator::reduce_scatter(const void* const* ins, void* out, size_t count, DType dtype,
                                  RedOp op, int64_t timeout_ms, int width) {
  const int w = width_of(width);
  std::string error = redop_error(op, dtype, "reduce_scatter");
  if (error.empty()) error = width_error("reduce_scatter", w);
  OpMeta meta = runner_->begin(OpType::kReduceScatter, dtype, op, -1, count, timeout_ms, error);
  const size_t shard = count * dtype_size(dtype);
  const size_t whole = shard * static_cast<size_t>(w);
  if (whole != 0 && whole * static_cast<size_t>(w) <= config_.small_bytes &&
      whole <= coll_->layout().chunk_bytes) {
    // Small enough to all-reduce whole in one message: one round, whose result
    // every rank keeps (kForward), instead of the data and commit rounds; each
    // rank then takes its shard. The same sums, in the same (rank) order. Each
    // rank reduces N times the data, so the bound is all_gather's (N x bytes):
    // at 64 KiB whole and 8 ranks on 2 cores the extra sums cost more than the
    // round saved (307-346 against 222-277 us), at 8 KiB they do not.
    std::vector<uint8_t> in(whole), sum(whole);
    HostOpData op_data({{sum.data(), whole}}, {});
    runner_->run(meta, Finish::kForward, op_data, [&] {
      if (meta.local_error.empty())
        for (int p : runner_->members()) std::memcpy(in.data() + p * shard, ins[p], shard);
      std::vector<const void*> src(static_cast<size_t>(capacity_), in.data());
      std::vector<size_t> counts(static_cast<size_t>(capacity_), count * static_cast<size_t>(w));
      reduce_exchange(meta, src.data(), counts.data(), sum.data());
    });
    std::memcpy(out, sum.data() + static_cast<size_t>(rank_) * shard, shard);
    return;
  }
  HostOpData op_data({}, {});
  runner_->run(meta, Finish::kCommit, op_data, [&] {
    std::vector<size_t> counts(static_cast<size_t>(capacity_), count);
    std::vector<const void*> src(static_cast<size_t>(capacity_), nullptr);
    if (meta.local_error.empty())
      for (int p : runner_->members()) src[p] = ins[p];
    reduce_exchange(meta, src.data(), counts.data(), out);
  });
}

void Communicator::all_to_all(const void* const* ins, const size_t* in_counts, void* const* outs,
                              const size_t* out_counts, DType dtype, int64_t timeout_ms,
                              int width) {
  const int w = width_of(width);
  std::string error = width_error("all_to_all", w);
  if (error.empty() && in_counts[rank_] != out_counts[rank_])
    error = str("all_to_all: rank ", rank_, " sends itself ", in_counts[rank_],
                " elements but expects ", out_counts[rank_]);
  OpMeta meta = runner_->begin(OpType::kAllToAll, dtype, RedOp::kSum, -1, 0, timeout_ms, error);
  const size_t esize = dtype_size(dtype);
  HostOpData op_data({}, {});
  runner_->run(meta, Finish::kCommit, op_data, [&] {
    Plan plan(capacity_);
    if (meta.local_error.empty()) {
      zero_others(outs, out_counts, esize, w);
      for (int p : runner_->members()) {
        plan.send[p] = ins[p];
        plan.recv[p] = outs[p];
        plan.send_bytes[p] = in_counts[p] * esize;
        plan.recv_bytes[p] = out_counts[p] * esize;
      }
    }
    // Small exchanges: the round of verdicts on the sizes is the commit round.
    meta.committed = exchange(meta, plan, true);
  });
}

void Communicator::gather(const void* in, size_t count, DType dtype, void* const* outs, int root,
                          int64_t timeout_ms, int width) {
  const int w = width_of(width);
  std::string error = root_error(root, "gather");
  if (error.empty() && rank_ == root) error = width_error("gather", w);
  OpMeta meta = runner_->begin(OpType::kGather, dtype, RedOp::kSum, root, count, timeout_ms, error);
  const size_t bytes = count * dtype_size(dtype);
  HostOpData op_data({}, {});
  runner_->run(meta, Finish::kCommit, op_data, [&] {
    Plan plan(capacity_);
    if (meta.local_error.empty()) {
      plan.send[root] = in;
      plan.send_bytes[root] = bytes;
      if (rank_ == root) {
        zero_others(outs, bytes, w);
        for (int p : runner_->members()) {
          plan.recv[p] = outs[p];
          plan.recv_bytes[p] = bytes;
        }
      }
    }
    exchange(meta, plan, false);
  });
}

void Communicator::scatter(const void* const* ins, void* out, size_t count, DType dtype, int root,
                           int64_t timeout_ms, int width) {
  std::string error = root_error(root, "scatter");
  if (error.empty() && rank_ == root) error = width_error("scatter", width_of(width));
  OpMeta meta =
      runner_->begin(OpType::kScatter, dtype, RedOp::kSum, root, count, timeout_ms, error);
  const size_t bytes = count * dtype_size(dtype);
  HostOpData op_data({}, {});
  runner_->run(meta, Finish::kCommit, op_data, [&] {
    Plan plan(capacity_);
    if (meta.local_error.empty()) {
      plan.recv[root] = out;
      plan.recv_bytes[root] = bytes;
      if (rank_ == root)
        for (int p : runner_->members()) {
          plan.send[p] = ins[p];
          plan.send_bytes[p] = bytes;
        }
    }
    exchange(meta, plan, false);
  });
}

void Communicator::barrier(int64_t timeout_ms) {
  OpMeta meta = runner_->begin(OpType::kBarrier, DType::kUInt8, RedOp::kSum, -1, 0, timeout_ms);
  HostOpData op_data({}, {});
  runner_->run(meta, Finish::kForward, op_data, [&] { exchange(meta, Plan(capacity_), false); });
}

}  // namespace mooncake
