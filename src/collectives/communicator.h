// Collective algorithms over the message channels, on raw CPU buffers.
//
// Two shapes of exchange serve every op:
//  * exchange(): each rank sends an arbitrary byte range to each peer and
//    receives one from each (all_gather, all_to_all, gather, scatter,
//    broadcast, barrier);
//  * reduce_exchange(): each rank sends each peer its contribution to that
//    peer's shard; the owner reduces all contributions in rank order.
// Both are pipelined in chunks through the channels, so tensors of any size
// pass through fixed slots. Small all_reduce/broadcast go direct (one hop);
// large ones use reduce-scatter + all-gather (scatter + all-gather for
// broadcast), so a rank moves O(size), not O(world * size).
//
// The first message of every op on every edge carries the op's metadata;
// all ranks check it before moving data, so mismatched calls (different
// sizes, dtypes, ops, roots) raise an invalid-argument error on every rank
// and leave the channels in step for the next op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/channel.h"
#include "core/dtype.h"
#include "store/store.h"
#include "transport/engine.h"

namespace mooncake {

enum class OpType : uint32_t {
  kBarrier = 1,
  kAllReduce,
  kBroadcast,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kReduce,
  kGather,
  kScatter
};
const char* op_name(OpType t);

struct CommConfig {
  int64_t timeout_ms = 30000;  // default deadline of one op; < 0: none
  size_t chunk_bytes = 0;      // 0: MOONCAKE_CHUNK_BYTES
  size_t small_bytes = 0;      // 0: MOONCAKE_SMALL_MSG_BYTES
  static CommConfig from_env(int64_t timeout_ms);
};

class Communicator {
 public:
  Communicator(const TransferEngine& engine, Store& store, const std::string& prefix, int rank,
               int size, const CommConfig& config);
  ~Communicator();

  int rank() const { return rank_; }
  int size() const { return size_; }
  const CommConfig& config() const { return config_; }
  const char* transport_of(int peer) const { return endpoint_->transport_of(peer); }
  Endpoint& endpoint() { return *endpoint_; }
  Channels& p2p_channels() { return *p2p_; }
  // Wakes blocked waits and makes them fail: the group is going away.
  void stop();

  // Every op blocks until done. timeout_ms < 0: the configured default.
  void all_reduce(void* data, size_t count, DType dtype, RedOp op, int64_t timeout_ms = -1);
  void reduce(void* data, size_t count, DType dtype, RedOp op, int root, int64_t timeout_ms = -1);
  void broadcast(void* data, size_t count, DType dtype, int root, int64_t timeout_ms = -1);
  // outs[p] receives rank p's `count` elements.
  void all_gather(const void* in, size_t count, DType dtype, void* const* outs,
                  int64_t timeout_ms = -1);
  // ins[p] is this rank's contribution to rank p's shard of `count` elements.
  void reduce_scatter(const void* const* ins, void* out, size_t count, DType dtype, RedOp op,
                      int64_t timeout_ms = -1);
  // ins[p]/in_counts[p] go to rank p; outs[p]/out_counts[p] come from rank p.
  void all_to_all(const void* const* ins, const size_t* in_counts, void* const* outs,
                  const size_t* out_counts, DType dtype, int64_t timeout_ms = -1);
  // outs (root only) receives every rank's `count` elements.
  void gather(const void* in, size_t count, DType dtype, void* const* outs, int root,
              int64_t timeout_ms = -1);
  // ins (root only) holds each rank's `count` elements.
  void scatter(const void* const* ins, void* out, size_t count, DType dtype, int root,
               int64_t timeout_ms = -1);
  void barrier(int64_t timeout_ms = -1);
  // Takes this rank's part in the next collective without running it: every
  // rank's call of it fails with an invalid-argument error that names this
  // rank, and the group stays in step. For arguments that the layer above
  // rejected on this rank only.
  void reject(const std::string& reason, int64_t timeout_ms = -1);

 private:
  struct OpMeta;
  struct Plan;
  // Starts an op. A non-empty `local_error` means this rank rejected its
  // arguments: the op then only tells the others and throws that error.
  OpMeta begin(OpType type, DType dtype, RedOp op, int root, uint64_t numel, int64_t timeout_ms,
               std::string local_error = {});
  MsgHeader header(const OpMeta& meta) const;
  // Step 0 of an op this rank rejected: the header, flagged, carries the error.
  void send_rejection(const OpMeta& meta, const MsgHeader& h, int peer);
  void exchange(const OpMeta& meta, const Plan& plan, bool agree_on_sizes);
  void agree(const OpMeta& meta, const MsgHeader& h, std::string& error);
  void reduce_exchange(const OpMeta& meta, const void* const* shard_src, const size_t* shard_counts,
                       void* out);
  std::string root_error(int root, const char* what) const;
  std::string redop_error(RedOp op, DType dtype, const char* what) const;
  std::string validate(const OpMeta& meta, const MsgHeader& h, int peer, size_t expect_recv,
                       size_t expect_send) const;
  void even_shards(size_t count, std::vector<size_t>& offsets, std::vector<size_t>& counts) const;
  // Whether an op of `count` elements goes direct (one hop) rather than sharded.
  bool direct(size_t count, DType dtype) const;

  int rank_;
  int size_;
  CommConfig config_;
  std::unique_ptr<Endpoint> endpoint_;
  std::unique_ptr<Channels> coll_;
  std::unique_ptr<Channels> p2p_;
  uint64_t op_seq_ = 0;
};

// Bytes a group segment needs for `capacity` ranks with `chunk_bytes` slots.
Layout make_layout(int capacity, size_t chunk_bytes);

}  // namespace mooncake
