// The low-latency EP device buffer: a workspace in device memory (laid out by
// ep/layout.h) that same-host peers map, the table of peers' workspaces the
// kernels store through, the host-mapped words the kernels report into, and
// the launches of dispatch and combine (src/kernels/ep_ll) on a caller's
// stream. Nothing here waits for the device during a call, so calls can be
// captured in a CUDA graph.
//
// Who is mapped is the caller's choice: a process group maps every member at
// once (connect), an elastic buffer one slot at a time (map_peer, then
// publish_peer when the slot connects; unmap_peer when it leaves), exchanging
// the cards of peers.h through its own members.
//
// Health: the kernels mask a peer that stays silent past a call's deadline,
// or that the host has seen lost (lost_words(): the caller wires a watcher,
// e.g. the group's transport, to them), in the call's active_ranks (and
// slot_mask when given), and record it in host-mapped words, which
// take_masked() hands over; bad values (expert ids
// out of range, more rows for an expert than a call allows, corrupt counts or
// headers) are reported in the status words, which raise_reported() turns
// into typed errors on the next call.
//
// Fencing (kernels/api.h says what the kernels do): every workspace starts
// with a control block (kControlBytes, before what the layout places) holding
// its fence word, and each rank has a fence key (reserve, connect, map_peer:
// the caller's; an elastic buffer's slot incarnation, a group's EP membership
// generation). When this process's peers leave it out they set its fence word
// through their mapping (fence_peer, and connect for a slot whose process
// changed or left); its kernels then store into no peer, report it, and every
// later launch here raises a kLeftOut error before it starts. What is
// guaranteed, and what is not:
//  * a receiver takes a signal or header from slot r only with the tag of the
//    call and of the key it mapped at r: nothing a process of another key
//    stores (a resumed or late kernel of a process left out, of a slot since
//    given to a replacement) is taken for the current call, at any time;
//  * payload rows are never stored into a peer: receivers read them from the
//    source's own workspace through their current mapping, which a stale
//    process never had. Headers are the only data a writer stores into a
//    peer, and a header of another tag is dropped and reported (corrupt data,
//    a RuntimeError on the receiver's next call), never used;
//  * a stale kernel that looked at its fence word before it was set may still
//    store until its next look (they come right before each store phase, so
//    microseconds), and such a store may overwrite a current signal or header
//    of the same place: that call then waits out (or drops) the row, it is
//    never wrong. Peers set the word when they leave a process out, seconds
//    before its replacement can run a call, so this needs a kernel held up
//    between a look and its stores for that long;
//  * keys are 8 bits (1 + key mod 255 on the device, never 0: write_keys):
//    only 255 changes of key in one slot while a stale kernel of it still
//    runs could make its tag current again.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "device/cuda.h"
#include "device/ipc.h"
#include "device/peers.h"
#include "ep/layout.h"
#include "kernels/api.h"
#include "transport/engine.h"

namespace mooncake {

// The words the kernels read as Common::lost, one per rank, in host-mapped
// memory: set from any thread (a transport's heartbeat thread, the moment it
// sees a peer lost), read by the device over the bus; and their device copy
// (Common::lost_seen, lost_claim), which the kernels keep. Held by a
// shared_ptr, so that a watcher that outlives its buffer still writes into
// live memory.
class LostWords {
 public:
  LostWords(int64_t n, int device);  // n words, all clear; the copy on `device`
  ~LostWords();
  LostWords(const LostWords&) = delete;
  LostWords& operator=(const LostWords&) = delete;

  // A word's values: kernels mask a gone or silent rank in a wait on it (as
  // the host fails a silent peer only in an op that waits for it), and a
  // silent one may come back.
  enum Word : int32_t { kClear = 0, kGone = 1, kSilent = 2 };
  int64_t size() const { return n_; }
  // A launch's Common::lost, lost_seen and lost_claim: the words and their copy.
  void into(kernels::Common& c) const {
    c.lost = dev_;
    c.life = life_dev_;
    c.lost_seen = seen_;
    c.lost_claim = seen_ + n_;
  }
  void set(int64_t rank, Word w);  // ranks outside [0, size) are ignored
  // Clears the word if it holds `only` (kClear: whatever it holds).
  void clear(int64_t rank, Word only = kClear);
  Word get(int64_t rank) const;
  // Clears every word for a new peer table in the same words (their device
  // address stays, for captured graphs): listeners made before stop. The
  // life pages go too (until settle()).
  void renew();
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // Has the kernels read `rank`'s process's life page (transport/life.h; a
  // PeerCard's life_here()) beside its word, registered with the GPU: a wait
  // on that process then ends the moment it dies, with no host thread in
  // between. An invalid ref, or a page that cannot be mapped (its process is
  // gone: the host's word says so) or registered, leaves the word alone
  // (MOONCAKE_DEVICE_LIFE_PAGES=0: always). The page it replaces is kept
  // until settle(), as a launch may be reading it.
  void watch_life(int64_t rank, const LifeRef& ref);
  // Frees the pages replaced since the last call: the caller has made sure
  // that no launch that read them still runs.
  void settle();
  // Whether `rank` has a life page.
  bool has_life(int64_t rank) const;

 private:
  struct LifePage;  // a LifeView registered with the GPU
  int32_t* host_ = nullptr;
  int32_t* dev_ = nullptr;
  // The device address of each rank's life word (0: none), host-mapped:
  // Common::life.
  uint64_t* life_host_ = nullptr;
  uint64_t* life_dev_ = nullptr;
  std::vector<std::unique_ptr<LifePage>> lives_;    // [n]
  std::vector<std::unique_ptr<LifePage>> retired_;  // replaced, until settle()
  uint64_t* seen_ = nullptr;                        // n_ + 1 words
  int device_ = 0;
  int64_t n_ = 0;
  std::atomic<uint64_t> generation_{0};
};

// A listener for Endpoint::watch_peers that sets the word in `lost` of every
// peer it hears of (the endpoint's slots are the buffer's ranks), for as long
// as the words live and are not renewed.
Endpoint::LossListener set_lost(std::weak_ptr<LostWords> lost);

// endpoint.watch_peers(set_lost(lost), hang_ms): its id.
uint64_t watch_lost(Endpoint& endpoint, std::weak_ptr<LostWords> lost, int64_t hang_ms);

// What every launch of one call shares.
struct EpCall {
  // A call of `shape` numbered `seq`, each wait phase bounded by `timeout_ns`,
  // over the ranks `active_ranks` says are healthy.
  static EpCall of(const EpShape& shape, uint64_t seq, int64_t timeout_ns, int32_t* active_ranks) {
    EpCall c;
    c.max_tokens = shape.max_tokens;
    c.hidden = shape.hidden;
    c.num_experts = shape.num_experts;
    c.ranks = shape.num_ranks;
    c.seq = seq;
    c.timeout_ns = timeout_ns;
    c.active_ranks = active_ranks;
    return c;
  }

  int64_t max_tokens = 0;   // T
  int64_t hidden = 0;       // H
  int64_t num_experts = 0;  // E
  int64_t ranks = 0;        // R: the ranks (or elastic slots) the call covers
  uint64_t seq = 0;         // >= 1, the same on every rank for the same call
  int64_t timeout_ns = 0;   // per wait phase
  int32_t phases = kernels::kBoth;
  int32_t num_blocks = 0;           // 0: the buffer's (num_blocks())
  int32_t* active_ranks = nullptr;  // device int32 [R], 1 = healthy
  int32_t* slot_mask = nullptr;     // optional device int32 [>= R]
};

// One call's device arrays, owned, for a C++ caller with BF16 tokens and
// int64 expert ids (the torch binding passes its tensors instead): the
// tokens, the dispatch's outputs and the combine's, each shaped as api.h says.
struct EpArrays {
  EpArrays(const EpShape& shape, int64_t num_tokens, int32_t topk);

  // Launch arguments over these arrays (the EpCall's part is EpBuffer's).
  kernels::DispatchArgs dispatch_args() const;
  // The combine of `expert_out`: the experts' outputs in recv_x's layout
  // (recv_x itself for experts that return their input).
  kernels::CombineArgs combine_args(const void* expert_out) const;

  const EpShape shape;
  const int64_t num_tokens;           // N <= T
  const int32_t topk;                 // K
  DeviceArray<uint16_t> x;            // [N, H] bf16
  DeviceArray<int64_t> topk_idx;      // [N, K], -1: no expert
  DeviceArray<float> topk_weights;    // [N, K]
  DeviceArray<uint16_t> recv_x;       // [E/R, R*T, H]
  DeviceArray<int32_t> recv_count;    // [E/R]
  DeviceArray<int32_t> src_info;      // [E/R, R*T]
  DeviceArray<int64_t> layout_range;  // [E/R, R]
  DeviceArray<uint16_t> out;          // [N, H]: the combine's result
};

class EpBuffer {
 public:
  // Bytes before the workspace proper in every process's segment: the fence
  // word, then room to keep the workspace's alignment.
  static constexpr size_t kControlBytes = 256;

  // A workspace of `bytes` on `device`, with no peer table yet.
  EpBuffer(size_t bytes, int device);
  ~EpBuffer();
  EpBuffer(const EpBuffer&) = delete;
  EpBuffer& operator=(const EpBuffer&) = delete;

  int device() const { return device_; }
  size_t bytes() const { return bytes_; }
  // The workspace's first byte (device memory of bytes() bytes on device()).
  uint8_t* workspace() const { return workspace_.data() + kControlBytes; }
  int sm_count() const { return sm_count_; }
  // This workspace's card (peers.h), encoded, for the peers to map it.
  const std::string& card() const { return card_; }
  // Whether the process of `encoded` runs on this process's GPU.
  bool shares_gpu(const std::string& encoded) const;

  // Sizes the peer table (a group's ranks, or an elastic buffer's capacity)
  // with this process at `rank`, fence key `key`, and no peer mapped. Waits
  // for this device's work first, so no kernel sees the table change under it.
  void reserve(int64_t capacity, int64_t rank, uint32_t key = 0);
  // A group's table at once: maps rank r from cards[r] where it is on this
  // host (anything but a card, e.g. zeros: absent), every rank with fence
  // key `key` (the members agree on it), and sizes launches by the processes
  // on this GPU among the cards. A rank mapped before whose card is gone or
  // another is fenced first (fence_peer): its process left the group.
  struct Connection {
    std::vector<bool> reachable;  // per rank: mapped (this one included)
    std::vector<bool> present;    // per rank: a card was given
  };
  Connection connect(const std::vector<std::string>& cards, int64_t rank, uint32_t key = 0);
  // Maps `slot`'s workspace from its card, staged: kernels do not see it
  // before publish_peer, which also puts `key` (the fence key of that slot's
  // process) in force. False when it cannot be mapped (absent, another
  // host, or its process is gone).
  bool map_peer(int64_t slot, const std::string& card, uint32_t key = 0);
  // Puts a mapped slot into the kernels' table, after this device's earlier work.
  void publish_peer(int64_t slot);
  // Takes a slot out of the table and releases its mapping, after this
  // device's earlier work.
  void unmap_peer(int64_t slot);
  // Sets the fence word of `slot`'s process (mapped: else nothing to do) at
  // once, without waiting for this device's work: its peers left it out, and
  // its kernels must stop storing into them.
  void fence_peer(int64_t slot);
  // Whether a kernel here found this process fenced (its next launch raises).
  bool left_out() const { return left_out_; }

  // Launch sizes: every block of a launch must be resident at once (blocks
  // wait for each other's stores), and `processes` processes on this GPU
  // (this one included) run their kernels side by side: each takes its share.
  void share_gpu(int processes);
  int num_blocks() const { return num_blocks_; }

  // Launch a call's `phases` on `stream`: the EpCall fills the kernels' Common
  // part (checked against this workspace); the caller the rest.
  void dispatch(const EpCall& call, kernels::DispatchArgs args, cudaStream_t stream);
  void combine(const EpCall& call, kernels::CombineArgs args, cudaStream_t stream);
  // The rows region of call `seq`'s half for a shape: the zero-copy combine
  // buffer, [E/R, R*T, H] rows of 2H bytes. Valid while this buffer lives.
  uint8_t* combine_rows(int64_t T, int64_t H, int64_t E, int64_t R, uint64_t seq,
                        const char* what) const;

  // The ranks kernels masked since the last call, each with its
  // kernels::MaskReason (silent past the deadline, or lost), and forgets them.
  std::vector<std::pair<int64_t, int32_t>> take_masked();
  // The lost words of the current peer table (replaced by reserve/connect,
  // cleared for a slot by map_peer): whoever learns that a peer is lost sets
  // its word, and kernels stop waiting for it.
  std::shared_ptr<LostWords> lost_words() const { return lost_; }
  // The first status word (0 while no kernel has reported anything).
  int32_t status_code() const;
  // The status words as the device last wrote them (no sync); `clear`
  // resets them for the next report.
  std::vector<int32_t> status(bool clear);
  // Turns a report of an earlier kernel into its error (and clears it):
  // kInvalidArgument for bad values the caller passed, kSystem for corrupt
  // data; a silent peer's report is cleared without an error (the mask says it).
  void raise_reported(const char* what);

 private:
  // The layout of a call's shape, checked against this workspace.
  EpLayout layout(int64_t T, int64_t H, int64_t E, int64_t R, const char* what) const;
  [[noreturn]] void throw_left_out(const char* what) const;
  // Copies keys_host_[first, first + n) to the device's keys, as the 8
  // nonzero bits that tags carry.
  void write_keys(int64_t first, int64_t n);
  kernels::Common common(const EpCall& call, const char* what) const;
  void check_peer_slot(int64_t slot, const char* what) const;
  // Copies table_[first, first + n) to the device's peer table.
  void write_table(int64_t first, int64_t n);

  const int device_;
  const size_t bytes_;  // the workspace proper (the segment has kControlBytes more)
  DeviceSegment workspace_;
  std::string card_;
  PeerCard mine_;
  std::vector<std::unique_ptr<PeerMapping>> maps_;  // per slot; null: not mapped
  std::vector<std::string> cards_;                  // per slot: the card it was mapped from
  std::vector<uint8_t*> table_;                     // what the device's table holds
  uint8_t** peers_ = nullptr;
  std::vector<uint32_t> keys_host_;      // per slot: its fence key (in force once published)
  uint32_t* keys_ = nullptr;             // device [num_ranks_]
  cudaStream_t fence_stream_ = nullptr;  // fence_peer's: never behind this process's kernels
  bool left_out_ = false;
  int32_t* silent_ = nullptr;  // host-mapped [num_ranks_]
  int32_t* silent_dev_ = nullptr;
  std::shared_ptr<LostWords> lost_;  // [num_ranks_]
  int64_t num_ranks_ = 0;
  int64_t rank_ = 0;
  int32_t* status_host_ = nullptr;
  int32_t* status_dev_ = nullptr;
  uint32_t* grid_sync_ = nullptr;
  int sm_count_ = 0;
  int num_blocks_ = 1;
};

}  // namespace mooncake
