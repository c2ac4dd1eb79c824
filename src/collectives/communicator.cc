#include "collectives/communicator.h"

#include <algorithm>
#include <cstring>

#include "collectives/reduce.h"
#include "core/env.h"
#include "core/error.h"

namespace mooncake {

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
  }
  return "op";
}

CommConfig CommConfig::from_env(int64_t timeout_ms) {
  CommConfig c;
  int64_t env_timeout = env_int("MOONCAKE_PG_TIMEOUT_MS");
  c.timeout_ms = env_timeout > 0 ? env_timeout : timeout_ms;
  int64_t chunk = env_int("MOONCAKE_CHUNK_BYTES");
  MC_CHECK_ARG(chunk >= 64 && chunk % 64 == 0 && chunk <= (1 << 30),
               "MOONCAKE_CHUNK_BYTES must be a multiple of 64 in [64, 2^30], got ", chunk);
  c.chunk_bytes = static_cast<size_t>(chunk);
  int64_t small = env_int("MOONCAKE_SMALL_MSG_BYTES");
  MC_CHECK_ARG(small >= 0, "MOONCAKE_SMALL_MSG_BYTES must be >= 0, got ", small);
  c.small_bytes = static_cast<size_t>(small);
  return c;
}

Layout make_layout(int capacity, size_t chunk_bytes) {
  Layout l;
  l.capacity = capacity;
  l.chunk_bytes = chunk_bytes;
  return l;
}

struct Communicator::OpMeta {
  OpType type;
  DType dtype;
  RedOp redop;
  int root;
  uint64_t numel;
  uint64_t seq;
  Deadline deadline;
  const char* name;
};

Communicator::Communicator(const TransferEngine& engine, Store& store, const std::string& prefix,
                           int rank, int size, const CommConfig& config)
    : rank_(rank), size_(size), config_(config) {
  MC_CHECK_ARG(size >= 1, "world size must be >= 1, got ", size);
  MC_CHECK_ARG(rank >= 0 && rank < size, "rank must be in [0, ", size, "), got ", rank);
  if (config_.chunk_bytes == 0 || config_.small_bytes == 0) {
    CommConfig env = CommConfig::from_env(config.timeout_ms);
    if (config_.chunk_bytes == 0) config_.chunk_bytes = env.chunk_bytes;
    if (config_.small_bytes == 0) config_.small_bytes = env.small_bytes;
  }
  Layout layout = make_layout(size, config_.chunk_bytes);
  endpoint_ = std::make_unique<Endpoint>(engine, store, prefix, rank, size, layout.total_bytes(),
                                         Deadline::after_ms(config_.timeout_ms));
  coll_ = std::make_unique<Channels>(*endpoint_, layout, Plane::kCollective);
  p2p_ = std::make_unique<Channels>(*endpoint_, layout, Plane::kP2P);
}

Communicator::~Communicator() = default;

void Communicator::stop() {
  coll_->set_stopping();
  p2p_->set_stopping();
}

Communicator::OpMeta Communicator::begin(OpType type, DType dtype, RedOp op, int root,
                                         uint64_t numel, int64_t timeout_ms) {
  int64_t t = timeout_ms >= 0 ? timeout_ms : config_.timeout_ms;
  return OpMeta{type, dtype, op, root, numel, ++op_seq_, Deadline::after_ms(t), op_name(type)};
}

void Communicator::check_root(int root, const char* what) const {
  MC_CHECK_ARG(root >= 0 && root < size_, what, ": root rank must be in [0, ", size_, "), got ",
               root);
}

std::string Communicator::validate(const OpMeta& meta, const MsgHeader& h, int peer,
                                   size_t expect_recv, size_t expect_send) const {
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
    return str(meta.name, ": tensor sizes differ: rank ", peer, " has ", h.numel,
               " elements, rank ", rank_, " has ", meta.numel);
  if (h.edge_bytes != expect_recv || h.edge_expect != expect_send)
    return str(meta.name, ": split sizes disagree between ranks ", peer, " and ", rank_, ": rank ",
               peer, " sends ", h.edge_bytes, " bytes and expects ", h.edge_expect, ", rank ",
               rank_, " expects ", expect_recv, " bytes and sends ", expect_send);
  return {};
}

namespace {

size_t pieces(size_t bytes, size_t chunk) {
  return bytes == 0 ? 1 : (bytes + chunk - 1) / chunk;
}
size_t piece_len(size_t bytes, size_t chunk, size_t k) {
  size_t begin = k * chunk;
  return begin >= bytes ? 0 : std::min(chunk, bytes - begin);
}

}  // namespace

void Communicator::exchange(const OpMeta& meta, const void* const* send, const size_t* send_bytes,
                            void* const* recv, const size_t* recv_bytes, bool agree_on_sizes) {
  const size_t chunk = coll_->layout().chunk_bytes;
  const int n = size_;
  if (send_bytes[rank_] != 0 || recv_bytes[rank_] != 0) {
    MC_CHECK_ARG(send_bytes[rank_] == recv_bytes[rank_], meta.name, ": rank ", rank_,
                 " sends itself ", send_bytes[rank_], " bytes but expects ", recv_bytes[rank_]);
    if (send[rank_] != recv[rank_]) std::memmove(recv[rank_], send[rank_], send_bytes[rank_]);
  }
  size_t steps = 1;
  for (int p = 0; p < n; ++p) {
    if (p == rank_) continue;
    steps = std::max({steps, pieces(send_bytes[p], chunk), pieces(recv_bytes[p], chunk)});
  }
  MsgHeader h{};
  h.op_seq = meta.seq;
  h.op_type = static_cast<uint32_t>(meta.type);
  h.dtype = static_cast<uint8_t>(meta.dtype);
  h.redop = static_cast<uint8_t>(meta.redop);
  h.root = meta.root;
  h.numel = meta.numel;
  std::string error;
  for (size_t k = 0; k < steps; ++k) {
    for (int i = 1; i < n; ++i) {
      int p = (rank_ + i) % n;
      size_t len = piece_len(send_bytes[p], chunk, k);
      if (k != 0 && len == 0) continue;
      h.edge_bytes = send_bytes[p];
      h.edge_expect = recv_bytes[p];
      coll_->send(p, h, static_cast<const uint8_t*>(send[p]) + k * chunk, len, meta.deadline,
                  meta.name);
    }
    for (int i = 1; i < n; ++i) {
      int p = (rank_ - i + n) % n;
      size_t len = piece_len(recv_bytes[p], chunk, k);
      if (k != 0 && len == 0) continue;
      const MsgHeader* msg = coll_->receive(p, meta.deadline, meta.name);
      if (k == 0) {
        std::string e = validate(meta, *msg, p, recv_bytes[p], send_bytes[p]);
        if (error.empty()) error = e;
      }
      if (error.empty()) {
        MC_ASSERT(msg->len == len, meta.name, " message from rank ", p, " has ", msg->len,
                  " bytes, expected ", len);
        std::memcpy(static_cast<uint8_t*>(recv[p]) + k * chunk, msg + 1, len);
      }
      coll_->release(p, meta.deadline);
    }
    if (k == 0 && agree_on_sizes && n > 1) {
      // Sizes here differ per edge, so a mismatch may be visible to only some
      // ranks: share each rank's verdict before anyone moves on.
      MsgHeader v = h;
      v.edge_bytes = v.edge_expect = 0;
      v.numel = error.empty() ? 0 : 1;
      for (int i = 1; i < n; ++i)
        coll_->send((rank_ + i) % n, v, nullptr, 0, meta.deadline, meta.name);
      int bad_peer = -1;
      for (int i = 1; i < n; ++i) {
        int p = (rank_ - i + n) % n;
        const MsgHeader* msg = coll_->receive(p, meta.deadline, meta.name);
        if (msg->numel != 0 && bad_peer < 0) bad_peer = p;
        coll_->release(p, meta.deadline);
      }
      if (error.empty() && bad_peer >= 0)
        error = str(meta.name, ": rank ", bad_peer,
                    " found that split sizes disagree between ranks; the op was not run");
    }
    if (k == 0 && !error.empty()) throw_error(ErrorKind::kInvalidArgument, -1, error);
  }
}

void Communicator::reduce_exchange(const OpMeta& meta, const void* const* shard_src,
                                   const size_t* shard_counts, void* out) {
  const size_t esize = dtype_size(meta.dtype);
  const size_t chunk = coll_->layout().chunk_bytes;
  const int n = size_;
  const size_t my_bytes = shard_counts[rank_] * esize;
  size_t steps = pieces(my_bytes, chunk);
  for (int p = 0; p < n; ++p)
    if (p != rank_) steps = std::max(steps, pieces(shard_counts[p] * esize, chunk));
  MsgHeader h{};
  h.op_seq = meta.seq;
  h.op_type = static_cast<uint32_t>(meta.type);
  h.dtype = static_cast<uint8_t>(meta.dtype);
  h.redop = static_cast<uint8_t>(meta.redop);
  h.root = meta.root;
  h.numel = meta.numel;
  std::vector<const void*> srcs(static_cast<size_t>(n));
  std::string error;
  for (size_t k = 0; k < steps; ++k) {
    for (int i = 1; i < n; ++i) {
      int p = (rank_ + i) % n;
      size_t bytes = shard_counts[p] * esize;
      size_t len = piece_len(bytes, chunk, k);
      if (k != 0 && len == 0) continue;
      h.edge_bytes = bytes;
      h.edge_expect = my_bytes;
      coll_->send(p, h, static_cast<const uint8_t*>(shard_src[p]) + k * chunk, len, meta.deadline,
                  meta.name);
    }
    size_t len = piece_len(my_bytes, chunk, k);
    if (k != 0 && len == 0) continue;
    for (int p = 0; p < n; ++p) {
      if (p == rank_) {
        srcs[p] = static_cast<const uint8_t*>(shard_src[p]) + k * chunk;
        continue;
      }
      const MsgHeader* msg = coll_->receive(p, meta.deadline, meta.name);
      if (k == 0 && error.empty())
        error = validate(meta, *msg, p, my_bytes, shard_counts[p] * esize);
      srcs[p] = msg + 1;
    }
    if (error.empty())
      reduce_arrays(meta.dtype, meta.redop, static_cast<uint8_t*>(out) + k * chunk, srcs.data(), n,
                    len / esize, n);
    for (int p = 0; p < n; ++p)
      if (p != rank_) coll_->release(p, meta.deadline);
    if (!error.empty()) throw_error(ErrorKind::kInvalidArgument, -1, error);
  }
}

void Communicator::even_shards(size_t count, std::vector<size_t>& offsets,
                               std::vector<size_t>& counts) const {
  offsets.assign(static_cast<size_t>(size_), 0);
  counts.assign(static_cast<size_t>(size_), 0);
  size_t base = count / static_cast<size_t>(size_), extra = count % static_cast<size_t>(size_);
  size_t at = 0;
  for (int p = 0; p < size_; ++p) {
    offsets[p] = at;
    counts[p] = base + (static_cast<size_t>(p) < extra ? 1 : 0);
    at += counts[p];
  }
}

void Communicator::all_reduce(void* data, size_t count, DType dtype, RedOp op, int64_t timeout_ms) {
  MC_CHECK_ARG(redop_supported(op, dtype), "all_reduce: op ", redop_name(op),
               " is not supported for dtype ", dtype_name(dtype));
  OpMeta meta = begin(OpType::kAllReduce, dtype, op, -1, count, timeout_ms);
  const size_t esize = dtype_size(dtype);
  const int n = size_;
  auto* bytes = static_cast<uint8_t*>(data);
  if (count * esize <= config_.small_bytes || static_cast<size_t>(n) > count) {
    // Direct: everyone reduces the whole buffer.
    std::vector<const void*> src(static_cast<size_t>(n), data);
    std::vector<size_t> counts(static_cast<size_t>(n), count);
    reduce_exchange(meta, src.data(), counts.data(), data);
    return;
  }
  std::vector<size_t> offsets, counts;
  even_shards(count, offsets, counts);
  std::vector<const void*> src(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) src[p] = bytes + offsets[p] * esize;
  reduce_exchange(meta, src.data(), counts.data(), bytes + offsets[rank_] * esize);
  // All-gather the reduced shards in place.
  std::vector<const void*> send(static_cast<size_t>(n), bytes + offsets[rank_] * esize);
  std::vector<size_t> send_bytes(static_cast<size_t>(n), counts[rank_] * esize);
  std::vector<void*> recv(static_cast<size_t>(n));
  std::vector<size_t> recv_bytes(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    recv[p] = bytes + offsets[p] * esize;
    recv_bytes[p] = counts[p] * esize;
  }
  exchange(meta, send.data(), send_bytes.data(), recv.data(), recv_bytes.data(), false);
}

void Communicator::reduce(void* data, size_t count, DType dtype, RedOp op, int root,
                          int64_t timeout_ms) {
  check_root(root, "reduce");
  MC_CHECK_ARG(redop_supported(op, dtype), "reduce: op ", redop_name(op),
               " is not supported for dtype ", dtype_name(dtype));
  OpMeta meta = begin(OpType::kReduce, dtype, op, root, count, timeout_ms);
  const size_t esize = dtype_size(dtype);
  const int n = size_;
  auto* bytes = static_cast<uint8_t*>(data);
  std::vector<const void*> src(static_cast<size_t>(n), data);
  if (count * esize <= config_.small_bytes || static_cast<size_t>(n) > count) {
    std::vector<size_t> counts(static_cast<size_t>(n), 0);
    counts[root] = count;
    reduce_exchange(meta, src.data(), counts.data(), data);
    return;
  }
  // Reduce-scatter into shards, then gather the shards to the root.
  std::vector<size_t> offsets, counts;
  even_shards(count, offsets, counts);
  for (int p = 0; p < n; ++p) src[p] = bytes + offsets[p] * esize;
  std::vector<uint8_t> mine(rank_ == root ? 0 : counts[rank_] * esize);
  uint8_t* my_out = rank_ == root ? bytes + offsets[rank_] * esize : mine.data();
  reduce_exchange(meta, src.data(), counts.data(), my_out);
  std::vector<const void*> send(static_cast<size_t>(n), my_out);
  std::vector<size_t> send_bytes(static_cast<size_t>(n), 0), recv_bytes(static_cast<size_t>(n), 0);
  std::vector<void*> recv(static_cast<size_t>(n), nullptr);
  send_bytes[root] = counts[rank_] * esize;
  if (rank_ == root)
    for (int p = 0; p < n; ++p) {
      recv[p] = bytes + offsets[p] * esize;
      recv_bytes[p] = counts[p] * esize;
    }
  else
    send_bytes[rank_] = 0;
  if (rank_ != root) recv[rank_] = my_out;
  exchange(meta, send.data(), send_bytes.data(), recv.data(), recv_bytes.data(), false);
}

void Communicator::broadcast(void* data, size_t count, DType dtype, int root, int64_t timeout_ms) {
  check_root(root, "broadcast");
  OpMeta meta = begin(OpType::kBroadcast, dtype, RedOp::kSum, root, count, timeout_ms);
  const size_t esize = dtype_size(dtype);
  const int n = size_;
  auto* bytes = static_cast<uint8_t*>(data);
  std::vector<const void*> send(static_cast<size_t>(n), data);
  std::vector<void*> recv(static_cast<size_t>(n), data);
  std::vector<size_t> send_bytes(static_cast<size_t>(n), 0), recv_bytes(static_cast<size_t>(n), 0);
  if (count * esize <= config_.small_bytes || static_cast<size_t>(n) > count) {
    if (rank_ == root)
      for (int p = 0; p < n; ++p) send_bytes[p] = p == root ? 0 : count * esize;
    else
      recv_bytes[root] = count * esize;
    exchange(meta, send.data(), send_bytes.data(), recv.data(), recv_bytes.data(), false);
    return;
  }
  // Scatter the shards from the root, then all-gather them.
  std::vector<size_t> offsets, counts;
  even_shards(count, offsets, counts);
  if (rank_ == root) {
    for (int p = 0; p < n; ++p) {
      send[p] = bytes + offsets[p] * esize;
      send_bytes[p] = p == root ? 0 : counts[p] * esize;
    }
  } else {
    recv[root] = bytes + offsets[rank_] * esize;
    recv_bytes[root] = counts[rank_] * esize;
  }
  exchange(meta, send.data(), send_bytes.data(), recv.data(), recv_bytes.data(), false);
  for (int p = 0; p < n; ++p) {
    send[p] = bytes + offsets[rank_] * esize;
    send_bytes[p] = p == rank_ ? 0 : counts[rank_] * esize;
    recv[p] = bytes + offsets[p] * esize;
    recv_bytes[p] = p == rank_ ? 0 : counts[p] * esize;
  }
  exchange(meta, send.data(), send_bytes.data(), recv.data(), recv_bytes.data(), false);
}

void Communicator::all_gather(const void* in, size_t count, DType dtype, void* const* outs,
                              int64_t timeout_ms) {
  OpMeta meta = begin(OpType::kAllGather, dtype, RedOp::kSum, -1, count, timeout_ms);
  const size_t bytes = count * dtype_size(dtype);
  std::vector<const void*> send(static_cast<size_t>(size_), in);
  std::vector<size_t> sizes(static_cast<size_t>(size_), bytes);
  exchange(meta, send.data(), sizes.data(), outs, sizes.data(), false);
}

void Communicator::reduce_scatter(const void* const* ins, void* out, size_t count, DType dtype,
                                  RedOp op, int64_t timeout_ms) {
  MC_CHECK_ARG(redop_supported(op, dtype), "reduce_scatter: op ", redop_name(op),
               " is not supported for dtype ", dtype_name(dtype));
  OpMeta meta = begin(OpType::kReduceScatter, dtype, op, -1, count, timeout_ms);
  std::vector<size_t> counts(static_cast<size_t>(size_), count);
  reduce_exchange(meta, ins, counts.data(), out);
}

void Communicator::all_to_all(const void* const* ins, const size_t* in_counts, void* const* outs,
                              const size_t* out_counts, DType dtype, int64_t timeout_ms) {
  OpMeta meta = begin(OpType::kAllToAll, dtype, RedOp::kSum, -1, 0, timeout_ms);
  const size_t esize = dtype_size(dtype);
  std::vector<size_t> send_bytes(static_cast<size_t>(size_)),
      recv_bytes(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) {
    send_bytes[p] = in_counts[p] * esize;
    recv_bytes[p] = out_counts[p] * esize;
  }
  exchange(meta, ins, send_bytes.data(), outs, recv_bytes.data(), true);
}

void Communicator::gather(const void* in, size_t count, DType dtype, void* const* outs, int root,
                          int64_t timeout_ms) {
  check_root(root, "gather");
  OpMeta meta = begin(OpType::kGather, dtype, RedOp::kSum, root, count, timeout_ms);
  const size_t bytes = count * dtype_size(dtype);
  const size_t n = static_cast<size_t>(size_);
  std::vector<const void*> send(n, in);
  std::vector<void*> recv(n, nullptr);
  std::vector<size_t> send_bytes(n, 0), recv_bytes(n, 0);
  send_bytes[root] = bytes;
  if (rank_ == root) {
    for (size_t p = 0; p < n; ++p) {
      recv[p] = outs[p];
      recv_bytes[p] = bytes;
    }
  }
  exchange(meta, send.data(), send_bytes.data(), recv.data(), recv_bytes.data(), false);
}

void Communicator::scatter(const void* const* ins, void* out, size_t count, DType dtype, int root,
                           int64_t timeout_ms) {
  check_root(root, "scatter");
  OpMeta meta = begin(OpType::kScatter, dtype, RedOp::kSum, root, count, timeout_ms);
  const size_t bytes = count * dtype_size(dtype);
  const size_t n = static_cast<size_t>(size_);
  std::vector<const void*> send(n, nullptr);
  std::vector<void*> recv(n, out);
  std::vector<size_t> send_bytes(n, 0), recv_bytes(n, 0);
  recv_bytes[root] = bytes;
  if (rank_ == root) {
    for (size_t p = 0; p < n; ++p) {
      send[p] = ins[p];
      send_bytes[p] = bytes;
    }
  }
  exchange(meta, send.data(), send_bytes.data(), recv.data(), recv_bytes.data(), false);
}

void Communicator::barrier(int64_t timeout_ms) {
  OpMeta meta = begin(OpType::kBarrier, DType::kUInt8, RedOp::kSum, -1, 0, timeout_ms);
  const size_t n = static_cast<size_t>(size_);
  std::vector<const void*> send(n, nullptr);
  std::vector<void*> recv(n, nullptr);
  std::vector<size_t> zero(n, 0);
  exchange(meta, send.data(), zero.data(), recv.data(), zero.data(), false);
}

}  // namespace mooncake
