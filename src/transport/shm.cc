#include "transport/shm.h"

#include <poll.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "core/error.h"
#include "core/siphash.h"
#include "transport/life.h"
#include "transport/secret.h"

namespace mooncake {

namespace {

// The seal of a segment: SipHash-2-4 keyed with the group's secret over who
// owns it. Only a member can make one, and a peer that maps the segment can
// check it before it writes anything.
uint64_t seal_of(const SegmentHeader& h, const PeerAddress& owner, std::string_view secret) {
  const uint64_t fields[] = {
      0x6d6f6f6e63616b65ull /* "mooncake" */, h.owner_rank,        h.owner_incarnation,
      static_cast<uint64_t>(owner.pid),       owner.segment_bytes, h.nonce};
  return siphash24(secret_key(secret).data(), fields, sizeof(fields));
}

class ShmLink : public PeerLink {
 public:
  ShmLink(const PeerAddress& addr, std::string_view secret)
      : pid_(addr.pid), mapping_(addr.pid, addr.segment_fd, addr.segment_bytes) {
    const auto& h = *reinterpret_cast<const SegmentHeader*>(mapping_.base());
    if (h.owner_rank != static_cast<uint32_t>(addr.rank) ||
        h.owner_incarnation != addr.incarnation || h.seal != seal_of(h, addr, secret))
      throw_error(ErrorKind::kPeerFailed, addr.rank, "the segment at /proc/", addr.pid, "/fd/",
                  addr.segment_fd, " is not the one rank ", addr.rank, " (incarnation ",
                  addr.incarnation,
                  ") published: its process is gone and the pid reused, or it is not a member "
                  "of this group");
    pidfd_ = static_cast<int>(::syscall(SYS_pidfd_open, addr.pid, 0));
  }
  ~ShmLink() override {
    if (pidfd_ >= 0) ::close(pidfd_);
  }
  const char* transport() const override { return "shm"; }
  PeerSpan mapping() override { return {mapping_.base(), mapping_.size()}; }

  void write(size_t offset, const void* src, size_t len, const Deadline&) override {
    MC_ASSERT(offset + len <= mapping_.size(), "write past the peer segment");
    if (len != 0) std::memcpy(mapping_.base() + offset, src, len);
  }

  void signal(size_t offset, uint64_t value, int bell, const Deadline&) override {
    MC_ASSERT(offset + 8 <= mapping_.size() && bell >= 0 && bell < kNumBells,
              "signal past the peer segment");
    store_flag(mapping_.base(), offset, value);
    ring(&reinterpret_cast<SegmentHeader*>(mapping_.base())->bells[bell]);
  }

  void signal_max(size_t offset, uint64_t value, int bell, const Deadline&) override {
    MC_ASSERT(offset + 8 <= mapping_.size() && bell >= 0 && bell < kNumBells,
              "signal past the peer segment");
    store_flag_max(mapping_.base(), offset, value);
    ring(&reinterpret_cast<SegmentHeader*>(mapping_.base())->bells[bell]);
  }

  bool alive() override {
    if (dead_.load(std::memory_order_acquire)) return false;
    // Held: the process dies only after the kernel has marked the word, so no
    // syscall is needed to know it lives (waits ask often).
    if (life_held(life_word()->load(std::memory_order_acquire))) return true;
    bool dead;
    if (life_owner_died(*life_word()) ||  // its heartbeat thread died: the process is going
        header()->closed.load(std::memory_order_acquire) != 0) {  // or its endpoint is gone
      dead = true;
    } else if (pidfd_ >= 0) {
      struct pollfd p = {pidfd_, POLLIN, 0};
      dead = ::poll(&p, 1, 0) > 0;  // readable once the process has exited
    } else {
      dead = ::kill(pid_, 0) != 0 && errno == ESRCH;
    }
    // Only ever set (several threads ask): a dead peer stays dead.
    if (dead) dead_.store(true, std::memory_order_release);
    return !dead;
  }

  int death_fd() const override { return pidfd_; }
  std::atomic<uint32_t>* life_word() override { return &header()->life; }
  uint64_t heartbeat() override {
    return reinterpret_cast<SegmentHeader*>(mapping_.base())
        ->heartbeat.load(std::memory_order_relaxed);
  }

 private:
  SegmentHeader* header() { return reinterpret_cast<SegmentHeader*>(mapping_.base()); }

  int pid_;
  int pidfd_ = -1;
  std::atomic<bool> dead_{false};
  RemoteMapping mapping_;
};

class SelfLink : public PeerLink {
 public:
  explicit SelfLink(Segment& segment) : segment_(segment) {}
  const char* transport() const override { return "self"; }
  PeerSpan mapping() override { return {segment_.base(), segment_.size()}; }
  void write(size_t offset, const void* src, size_t len, const Deadline&) override {
    MC_ASSERT(offset + len <= segment_.size(), "write past the segment");
    if (len != 0) std::memcpy(segment_.base() + offset, src, len);
  }
  void signal(size_t offset, uint64_t value, int bell, const Deadline&) override {
    store_flag(segment_.base(), offset, value);
    ring(segment_.bell(bell));
  }
  void signal_max(size_t offset, uint64_t value, int bell, const Deadline&) override {
    store_flag_max(segment_.base(), offset, value);
    ring(segment_.bell(bell));
  }
  bool alive() override { return true; }
  uint64_t heartbeat() override {
    return reinterpret_cast<SegmentHeader*>(segment_.base())
        ->heartbeat.load(std::memory_order_relaxed);
  }

 private:
  Segment& segment_;
};

}  // namespace

bool shm_can_reach(const PeerAddress& addr) {
  return addr.host_key == local_host_key() && addr.pid > 0 && addr.segment_fd >= 0;
}

std::unique_ptr<PeerLink> shm_connect(const PeerAddress& addr, std::string_view secret) {
  check_secret(secret, "shm");
  return std::make_unique<ShmLink>(addr, secret);
}

void shm_seal(Segment& segment, const PeerAddress& me, std::string_view secret) {
  check_secret(secret, "shm");
  auto& h = *reinterpret_cast<SegmentHeader*>(segment.base());
  h.owner_rank = static_cast<uint32_t>(me.rank);
  h.owner_incarnation = me.incarnation;
  MC_SYSCHECK(::getrandom(&h.nonce, sizeof(h.nonce), 0));
  h.seal = seal_of(h, me, secret);
}

std::unique_ptr<PeerLink> self_link(Segment& segment) {
  return std::make_unique<SelfLink>(segment);
}

}  // namespace mooncake
