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

}  // namespace mooncake
