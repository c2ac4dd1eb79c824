// The high-throughput EP device buffer (ElasticBuffer's device path): a
// workspace in device memory laid out by kernels/ep_ht/api.h (signals, then
// rings whose size does not depend on T), the same-host peers' workspaces
// mapped through CUDA IPC, the host-mapped words the kernels report into, and
// the launches of the layout pass, dispatch and combine (src/kernels/ep_ht)
// on a caller's stream. Nothing here waits for the device during a call.
//
// The machinery is the low-latency buffer's (device/ep.h, device/ipc.h,
// device/peers.h): the same cards and mappings, the same lost words that a
// watcher (the group's transport) sets, the same silent and status words.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "device/ep.h"
#include "device/ipc.h"
#include "device/peers.h"
#include "device/user_memory.h"
#include "kernels/ep_ht/api.h"

namespace mooncake {

// `n` int32 words of host memory the device maps, zeroed.
class HostWords {
 public:
  explicit HostWords(int64_t n);
  ~HostWords();
  HostWords(const HostWords&) = delete;
  HostWords& operator=(const HostWords&) = delete;

  int32_t* host() const { return host_; }
  int32_t* device() const { return dev_; }
  int32_t load(int64_t i) const;
  void store(int64_t i, int32_t v);

 private:
  int32_t* host_ = nullptr;
  int32_t* dev_ = nullptr;
};

class EpHtBuffer {
 public:
  // The workspace of rank `rank` of `ranks`, its tokens cut into `channels`,
  // with `ring_bytes` of rings, on `device`. Throws kInvalidArgument naming
  // the argument out of range, kSystem when CUDA cannot allocate.
  EpHtBuffer(int64_t ranks, int64_t rank, int64_t channels, size_t ring_bytes, int device);
  ~EpHtBuffer();
  EpHtBuffer(const EpHtBuffer&) = delete;
  EpHtBuffer& operator=(const EpHtBuffer&) = delete;

  int device() const { return device_; }
  int64_t ranks() const { return layout_.ranks; }
  int64_t rank() const { return rank_; }
  int64_t channels() const { return layout_.channels; }
  const kernels::ep_ht::HtLayout& layout() const { return layout_; }
  size_t bytes() const { return workspace_.size(); }
  int sm_count() const { return sm_count_; }
  // This workspace's card (peers.h), encoded, for the peers to map it.
  const std::string& card() const { return card_; }
  bool shares_gpu(const std::string& encoded) const;

  // Maps rank r's workspace from cards[r] where it runs on this host (anything
  // but a card: absent). Waits for this device's work first.
  struct Connection {
    std::vector<bool> reachable;  // per rank: mapped (this one included)
    std::vector<bool> present;    // per rank: a card was given
    int sharers = 1;              // processes on this GPU among the cards
  };
  Connection connect(const std::vector<std::string>& cards);

  // The ranks kernels masked since the last call, each with its
  // kernels::MaskReason, forgotten once taken.
  std::vector<std::pair<int64_t, int32_t>> take_masked();
  // The words whoever watches the peers sets (EpBuffer's kind).
  std::shared_ptr<LostWords> lost_words() const { return lost_; }
  int32_t status_code() const;
  std::vector<int32_t> status(bool clear);
  // Turns an earlier kernel's report into its error (and clears it):
  // kInvalidArgument for bad topk_idx values, kSystem for corrupt data; a
  // silent peer's report is cleared without one (the mask says it).
  void raise_reported(const char* what);

  // The launches: the Common part is filled here from the call's number,
  // budget and mask (device int32 [R], 1 = takes part).
  void layout(kernels::ep_ht::LayoutArgs a, uint64_t seq, int64_t timeout_ns, int32_t* active,
              int blocks, cudaStream_t stream);
  void dispatch(kernels::ep_ht::DispatchArgs a, uint64_t seq, int64_t timeout_ns, int32_t* active,
                int blocks, cudaStream_t stream);
  void combine(kernels::ep_ht::CombineArgs a, uint64_t seq, int64_t timeout_ns, int32_t* active,
               int blocks, cudaStream_t stream);
  // The first n words of a plan (device int32: HtRouting::plan; its summary
  // and each local expert's padded rows, n at most kHeadWords) once `stream`
  // has run to here: copied into pinned memory, then the stream waited for.
  static constexpr int64_t kHeadWords =
      kernels::ep_ht::HtPlan::kSummary + kernels::ep_ht::kMaxLocalExperts;
  std::vector<int32_t> plan_head(const int32_t* plan, int64_t n, cudaStream_t stream);
  // The layout pass's per-expert scratch (device int32 [kMaxExperts], zero between calls).
  int32_t* expert_scratch() const { return etotal_; }
  // One copy (MOONCAKE_EP_HT_ONE_COPY, read when the buffer is made; the
  // ranks must agree, which the layout pass's signature checks): a dest reads
  // a same-host source's x where it lies (user_memory.h).
  bool one_copy() const { return imports_ != nullptr; }
  // Since the buffer was made: the (source, channel) pairs this rank read
  // straight from the source's x, and those it read from the source's ring
  // after an offer, in dispatches, then in combines (blocking; tests and
  // benchmarks). And the peers' allocations mapped now.
  std::vector<int64_t> one_copy_counts() const;
  int one_copy_mapped() const { return imports_ ? imports_->mapped() : 0; }
  // Profiling: later dispatches and combines write each block's start and end
  // times into `stamps` (device uint64 [2 * blocks]; null: off), which the
  // caller keeps alive until then.
  void set_stamps(uint64_t* stamps) { stamps_ = stamps; }

 private:
  kernels::ep_ht::HtCommon common(uint64_t seq, int64_t timeout_ns, int32_t* active, int counter,
                                  const char* what) const;
  // One copy (on, with peers): the imports brought up to date, and into `a`
  // (DispatchArgs or CombineArgs) the tables and, when `offer`, the offer of
  // `rows` rows of `row_bytes`, `stride` apart, at `p`, with `q_bytes` at `q`
  // beside them (null: none). `what` names the call.
  template <typename Args>
  void with_one_copy(Args& a, cudaStream_t stream, const char* what, bool offer, const void* p,
                     int64_t rows, int64_t stride, int64_t row_bytes, const void* q,
                     int64_t q_bytes);
  // `launch()` on `stream` after the last call, on this device.
  template <typename Launch>
  void ordered(cudaStream_t stream, Launch&& launch) {
    OnDevice on(device_);
    order_->before(stream);
    launch();
    order_->after(stream);
  }

  const int device_;
  const int64_t rank_;
  kernels::ep_ht::HtLayout layout_;
  DeviceSegment workspace_;
  PeerCard mine_;
  std::string card_;
  std::vector<std::unique_ptr<PeerMapping>> maps_;  // per rank; null: not mapped
  uint8_t** peers_ = nullptr;                       // device [R]
  std::vector<const uint8_t*> bases_;               // its host copy
  std::unique_ptr<UserExports> exports_;            // one copy (null: off)
  std::unique_ptr<UserImports> imports_;
  unsigned long long* xcounts_ = nullptr;  // device [4]
  HostWords silent_;
  HostWords status_;
  HostWords head_{kHeadWords};  // plan_head's (pinned: a copy into it is one DMA)
  std::mutex head_mu_;          // held from that copy until its words are read
  std::shared_ptr<LostWords> lost_;
  // Calls share the rings, the counters and the scratch: one after another
  // whatever stream each is queued on.
  std::unique_ptr<LaunchOrder> order_;
  uint32_t* counters_ = nullptr;  // device [2]: the layout's and the dispatch's last-block tickets
  int32_t* etotal_ = nullptr;
  uint64_t* stamps_ = nullptr;
  int sm_count_ = 0;
};

}  // namespace mooncake
