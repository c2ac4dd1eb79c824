// The device-driven collectives' host half (the kernel and its protocol:
// kernels/coll/direct.h): the group's state in device memory, the words its
// launches report into, and the launch itself, which needs no host op, no
// allocation and no host wait, so that it can be captured in a CUDA graph.
// DeviceCollectives (collectives.h) drives it: it owns the segments (each
// rank's area lies past the host-driven plane's part of its segment), sets it
// up with the members, and decides when a launch may run.
//
// Health: a launch masks a peer that stays silent past the deadline, or that
// the host has seen lost (lost_words(), which the group's transport sets), in
// the state's live words, in the caller's active_ranks (set_report) and in
// the silent words; a masked rank's signal is fenced (kernels/coll/direct.h),
// which keeps it out of later launches until the next install.
// take_reports() hands over what launches reported, for the log.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "device/ep.h"
#include "device/user_memory.h"
#include "kernels/coll/direct.h"

namespace mooncake {

// The slots watched launches leave their outcome in (kernels::DirectOutcome,
// host-mapped): one leased per launch, given back when the lease goes (after
// the launch's Work read it, or dropped it unread). Thread-safe: Works are
// waited on from any thread. Grows by chunks, never shrinks; freed when the
// last lease and the owner are gone.
class DirectOutcomes : public std::enable_shared_from_this<DirectOutcomes> {
 public:
  static std::shared_ptr<DirectOutcomes> make(int device);
  ~DirectOutcomes();
  DirectOutcomes(const DirectOutcomes&) = delete;
  DirectOutcomes& operator=(const DirectOutcomes&) = delete;

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept { *this = std::move(o); }
    Lease& operator=(Lease&& o) noexcept;
    ~Lease() { give_back(); }
    // For the launch (DirectOps::Op::outcome): the slot as the device sees it.
    kernels::DirectOutcome* device() const;
    uint64_t ticket() const { return ticket_; }
    // What the launch wrote (block 0 writes it once it has decided who takes
    // part, the ticket last); nullopt until then, and where no launch wrote
    // this ticket (the op ran another way, e.g. on the host-driven plane).
    std::optional<kernels::DirectOutcome> read() const;
    void give_back();

   private:
    friend class DirectOutcomes;
    std::shared_ptr<DirectOutcomes> pool_;
    uint32_t slot_ = 0;
    uint64_t ticket_ = 0;
  };
  Lease lease();

 private:
  static constexpr uint32_t kChunk = 256;
  explicit DirectOutcomes(int device) : device_(device) {}
  kernels::DirectOutcome* host(uint32_t slot) const;

  const int device_;
  std::mutex mu_;
  std::vector<kernels::DirectOutcome*> host_;  // chunks, host view
  std::vector<kernels::DirectOutcome*> dev_;   // the same, device view
  std::vector<uint32_t> free_;
  uint64_t next_ticket_ = 1;
};

class DirectOps {
 public:
  // No incarnation: a slot no install mapped.
  static constexpr uint32_t kNone = UINT32_MAX;

  // For a world of `ranks` processes (this one `rank`, at most
  // kernels::kDirectMaxRanks) whose areas are laid out as `layout`, each
  // `plane_bytes` into its segment (kernels::DirectArgs::plane_bytes; 0: a
  // mapped all_reduce cannot go through the segments, and writes nothing where
  // it cannot go in place).
  DirectOps(int device, int rank, int ranks, const kernels::DirectLayout& layout,
            size_t plane_bytes = 0);
  ~DirectOps();
  DirectOps(const DirectOps&) = delete;
  DirectOps& operator=(const DirectOps&) = delete;

  const kernels::DirectLayout& layout() const { return layout_; }
  // Whoever learns that a peer is lost sets its word (watch_lost).
  std::shared_ptr<LostWords> lost_words() const { return lost_; }
  // The caller's active_ranks (device int32 [ranks]; null: none): launches
  // set a rank they mask to 0 there. In force from the next install.
  void set_report(int32_t* active_ranks) { report_ = active_ranks; }

  // A setup agreed with the members: each rank's area as this process maps
  // it (null: out), the incarnation each was mapped from and its process's
  // life page (LostWords::watch_life; invalid: none), the generation the
  // members agreed on and the view's epoch. Queued on `stream` after what it
  // holds, and waited for: no launch may see the state change under it. No
  // launch of the last setup may still run (the caller synchronized).
  void install(const std::vector<uint8_t*>& areas, const std::vector<uint32_t>& incarnations,
               const std::vector<LifeRef>& lives, uint32_t gen, uint64_t epoch,
               cudaStream_t stream);
  bool installed() const { return installed_; }
  // The ranks the last install took in (retire() leaves it as it was).
  int installed_members() const { return installed_members_; }
  // Until the next install, not installed (DeviceCollectives::direct_resync).
  void invalidate() { installed_ = false; }
  uint64_t epoch() const { return epoch_; }
  uint32_t generation() const { return gen_; }
  // The incarnation of `slot`'s area at the last install (kNone: none).
  uint32_t incarnation(int slot) const;

  // Takes `slot` out of the launches queued after this on `stream` (its
  // process left the group: graph replays stop waiting for it).
  void retire(int slot, cudaStream_t stream);
  // The same, done before it returns (its mapping is about to go).
  void retire_now(int slot);

  // One op: what kernels::DirectArgs says of the same fields.
  struct Op {
    kernels::DirectKind kind = kernels::DirectKind::kAllReduce;
    const void* in = nullptr;
    void* out = nullptr;
    size_t count = 0;  // elements of one part
    // Elements between the parts' firsts in a multi-part in or out (0: count;
    // an op in pieces: its whole part's count).
    size_t stride = 0;
    DType dtype = DType::kFloat32;
    RedOp op = RedOp::kSum;  // reductions only
    int root = 0;            // rooted kinds only
    // Where the launch leaves what it decided (null: nowhere), and its ticket
    // (DirectOutcomes::Lease).
    kernels::DirectOutcome* outcome = nullptr;
    uint64_t ticket = 0;
    // A side given as one buffer per part (kernels::DirectList): `parts`, one
    // per part of that side at this rank, `count` elements each (that side's
    // in or out unused; no stride: an op in pieces offsets each).
    kernels::DirectList list = kernels::DirectList::kNone;
    std::vector<void*> parts;
    // all_reduce in place, read where each member's tensor lies
    // (kernels::DirectArgs::mapped; in == out): this rank's offer of it.
    bool mapped = false;
    UserExports::Offer offer;
    // all_to_all with per-pair sizes (kernels::DirectArgs::vary; `count` and
    // `list` unused): per rank p, the part for it (`in_parts[p]`,
    // `send_bytes[p]` bytes) and the part from it (`parts[p]`, `recv_bytes[p]`
    // bytes); null where a part is empty. Served at any size, in rounds.
    bool vary = false;
    std::vector<const void*> in_parts;
    std::vector<size_t> send_bytes, recv_bytes;
    // `stride` as it applies: count where it is 0.
    size_t part_stride() const { return stride != 0 ? stride : count; }
  };
  // Bytes of `op`'s input at this rank (every rank's input fits the area).
  size_t input_bytes(const Op& op) const;

  // The mapped all_reduce's tensors (kernels/coll/direct.h), from the first
  // install on: `p`'s `bytes` offered to the members (its export made on its
  // first offer, into this rank's area, on `stream`; gen 0: it cannot be),
  // and the members' exports that earlier launches lacked mapped here before
  // the next launch (`launches`: this group's, which may read the table).
  UserExports::Offer offer(const void* p, size_t bytes, cudaStream_t stream);
  void map_offers(LaunchOrder& launches, cudaStream_t stream);

  // Queues `op` (kernels/coll/direct.h) as one launch of `blocks` blocks on
  // `stream`; `reject`: this rank takes part without data; two_shot:
  // all_reduce's algorithm. timeout_ms > 0.
  void launch(const Op& op, bool two_shot, bool reject, int64_t timeout_ms, int blocks,
              cudaStream_t stream);

  // What launches reported since the last call (masked ranks, peers whose
  // calls did not match), one line each; clears the words. Reads host memory
  // only (no sync), so it sees what the launches that finished wrote.
  std::vector<std::string> take_reports();
  // Whether a launch found the others gone on to a newer setup without this
  // rank (they left it out): from the first report of it on.
  bool left_behind() const { return left_behind_; }

 private:
  void release();  // frees what the constructor allocated

  const int device_;
  const int rank_;
  const int ranks_;
  const kernels::DirectLayout layout_;
  const size_t plane_bytes_;
  kernels::DirectState* state_ = nullptr;  // device
  int32_t* report_ = nullptr;              // device, the caller's
  int32_t* status_host_ = nullptr;         // host-mapped kernels::kStatusWords
  int32_t* status_dev_ = nullptr;
  int32_t* silent_host_ = nullptr;  // host-mapped [ranks]
  int32_t* silent_dev_ = nullptr;
  std::shared_ptr<LostWords> lost_;
  std::vector<uint32_t> incarnations_;
  std::vector<const uint8_t*> areas_;     // the last install's
  std::unique_ptr<UserExports> exports_;  // into this rank's area
  std::unique_ptr<UserImports> imports_;
  bool installed_ = false;
  int installed_members_ = 0;
  bool left_behind_ = false;
  uint64_t epoch_ = 0;
  uint32_t gen_ = 0;
};

}  // namespace mooncake
