// A process's life word: a futex word in its segment that the kernel marks
// FUTEX_OWNER_DIED the moment the thread holding it dies, through that
// thread's robust futex list. That happens at the start of the thread's exit,
// before the process's memory is torn down; a pidfd becomes readable only
// after the whole process has exited, which for a process holding hundreds of
// MB takes tens of ms (17-22 ms for a bare torch process, about 100 ms with
// 1 GB of tensors, measured on a 2-core VM) against about 0.2 ms for the mark.
//
// The holder's word holds its thread id; waiters set FUTEX_WAITERS in it so
// that the kernel wakes one of them at the death, which wakes the others.
// Linux only; where the kernel refuses (no robust lists, no futex_waitv),
// peers fall back to the pidfd.
#pragma once

#include <linux/futex.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace mooncake {

// Holds a life word on the calling thread, which must live as long as the
// word is published, and call release() itself before it exits normally (a
// thread that exits holding it is a death to the peers).
class LifeHold {
 public:
  // Puts this thread's id in `word` and the word on this thread's robust list
  // (replacing the C library's registration: the thread must hold no robust
  // mutex of its own). False where the kernel refuses.
  bool hold(std::atomic<uint32_t>* word);
  // Takes the word off the list and clears it (waiters are woken and see a
  // word nobody holds); restores the C library's registration.
  void release();

 private:
  std::atomic<uint32_t>* word_ = nullptr;
  robust_list entry_{};  // the kernel's robust list ABI (linux/futex.h): a list of one
  robust_list_head head_{};
  void* previous_ = nullptr;  // the C library's head for this thread
  size_t previous_len_ = 0;
};

// Whether the thread that held `word` died (the kernel's mark).
bool life_owner_died(const std::atomic<uint32_t>& word);
// Whether a word's value says a live thread holds it.
bool life_held(uint32_t value);

// How a life_wait() ended, for the log.
enum class LifeWake : uint8_t {
  kWoken,    // the kernel (or another waiter) woke it: a holder died, or stop
  kTimeout,  // timeout_ms passed
  kChanged,  // a word changed before it slept (a holder died, or stop)
  kSkipped,  // a holder had already died, or stop was set: it did not sleep
  kOther,    // interrupted, or an error
};
const char* life_wake_name(LifeWake how);

// Sleeps until one of `words`' holders dies, `stop` becomes nonzero, or
// timeout_ms passes (a word nobody holds is not waited on). Wakes the other
// waiters of a word whose holder died (the kernel wakes only one). Returns
// false, at once, where the kernel has no futex_waitv: the caller then waits
// its own way. `how` (optional) says how it ended.
bool life_wait(const std::vector<std::atomic<uint32_t>*>& words, std::atomic<uint32_t>* stop,
               int64_t timeout_ms, LifeWake* how = nullptr);

// Sets `stop` and wakes a life_wait() on it.
void life_stop(std::atomic<uint32_t>* stop);

// A process's life page: one page of its own (a memfd), whose word a thread of
// the process holds for as long as it runs. Unlike a segment's word, which
// its heartbeat thread releases when the endpoint closes, nothing releases
// it: the process's exit marks it as its death does. A peer can keep it
// mapped (and registered with a GPU, whose kernels then read a death with no
// host thread in between: device/ep.h) at the cost of one page, where a
// mapping of the segment would keep the whole dead segment's memory.
constexpr size_t kLifePageBytes = 4096;

// Where a process's life page is, for a peer on the same host to map it
// (/proc/<pid>/fd/<fd>); the nonce tells it from whatever else may lie
// there once the process is gone and its pid reused.
struct LifeRef {
  int32_t pid = 0;
  int32_t fd = -1;
  uint64_t nonce = 0;
  bool valid() const { return pid > 0 && fd >= 0 && nonce != 0; }
  friend bool operator==(const LifeRef&, const LifeRef&) = default;
};

// This process's life page, made on the first call (and again in a forked
// child, which has no holder thread). An invalid LifeRef where the kernel
// refuses (no memfd, no robust lists): peers then rely on the host's notice.
LifeRef process_life();

// A peer's life page mapped here. Throws (kPeerFailed) where `ref` names no
// live process's life page: gone, or its pid and fd number now another's.
class LifeView {
 public:
  explicit LifeView(const LifeRef& ref);
  ~LifeView();
  LifeView(const LifeView&) = delete;
  LifeView& operator=(const LifeView&) = delete;

  // The page (kLifePageBytes, page-aligned) and its word, at its start.
  void* page() const { return page_; }
  const std::atomic<uint32_t>& word() const { return *static_cast<std::atomic<uint32_t>*>(page_); }
  bool owner_died() const { return life_owner_died(word()); }

 private:
  void* page_ = nullptr;
};

}  // namespace mooncake
