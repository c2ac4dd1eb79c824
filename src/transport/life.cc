#include "transport/life.h"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>
#include <future>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>

#include "core/error.h"
#include "core/thread.h"
#include "transport/segment.h"

namespace mooncake {

namespace {

// Set once futex_waitv answered ENOSYS: the kernel has none.
std::atomic<bool> no_waitv{false};

void wake_all_waiters(std::atomic<uint32_t>* word, bool shared) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word),
            FUTEX_WAKE | (shared ? 0 : FUTEX_PRIVATE_FLAG), INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

bool LifeHold::hold(std::atomic<uint32_t>* word) {
  if (word_ != nullptr) return true;
  if (::syscall(SYS_get_robust_list, 0, &previous_, &previous_len_) != 0) previous_ = nullptr;
  // A list of one: head -> entry -> head; the word lies futex_offset past the entry.
  entry_.next = &head_.list;
  head_.list.next = &entry_;
  head_.futex_offset = reinterpret_cast<char*>(word) - reinterpret_cast<char*>(&entry_);
  head_.list_op_pending = nullptr;
  if (::syscall(SYS_set_robust_list, &head_, sizeof(head_)) != 0) return false;
  const auto tid = static_cast<uint32_t>(::syscall(SYS_gettid)) & FUTEX_TID_MASK;
  uint32_t v = word->load();
  // A peer may have armed the word (FUTEX_WAITERS) already: keep its bit.
  while (!word->compare_exchange_weak(v, tid | (v & FUTEX_WAITERS))) {
  }
  word_ = word;
  return true;
}

void LifeHold::release() {
  if (word_ == nullptr) return;
  // Off the list before the word is cleared and the thread exits: on the list
  // at the thread's exit, the word would be marked dead.
  if (previous_ != nullptr) {
    ::syscall(SYS_set_robust_list, previous_, previous_len_);
  } else {
    head_.list.next = &head_.list;
    ::syscall(SYS_set_robust_list, &head_, sizeof(head_));
  }
  word_->store(0);
  wake_all_waiters(word_, /*shared=*/true);
  word_ = nullptr;
}

bool life_owner_died(const std::atomic<uint32_t>& word) {
  return (word.load(std::memory_order_acquire) & FUTEX_OWNER_DIED) != 0;
}

bool life_held(uint32_t value) {
  return (value & FUTEX_OWNER_DIED) == 0 && (value & FUTEX_TID_MASK) != 0;
}

const char* life_wake_name(LifeWake how) {
  switch (how) {
    case LifeWake::kWoken: return "woken";
    case LifeWake::kTimeout: return "timed out";
    case LifeWake::kChanged: return "a word changed first";
    case LifeWake::kSkipped: return "did not sleep";
    case LifeWake::kOther: break;
  }
  return "interrupted";
}

bool life_wait(const std::vector<std::atomic<uint32_t>*>& words, std::atomic<uint32_t>* stop,
               int64_t timeout_ms, LifeWake* how) {
  LifeWake ended = LifeWake::kSkipped;
  if (how == nullptr) how = &ended;
  *how = LifeWake::kSkipped;
#ifdef __NR_futex_waitv
  if (no_waitv.load(std::memory_order_relaxed)) return false;
  std::vector<futex_waitv> w;
  w.push_back(futex_waitv{stop->load(), reinterpret_cast<uintptr_t>(stop),
                          FUTEX_32 | FUTEX_PRIVATE_FLAG, 0});
  if (w[0].val != 0) return true;
  bool died = false;
  for (std::atomic<uint32_t>* word : words) {
    if (w.size() == FUTEX_WAITV_MAX) break;  // the rest: the caller's other ways
    uint32_t v = word->load();
    if (v & FUTEX_OWNER_DIED) died = true;
    if (died || (v & FUTEX_TID_MASK) == 0) continue;  // nobody holds it
    // Armed, so that the kernel wakes a waiter when the holder dies.
    if (!(v & FUTEX_WAITERS) && !word->compare_exchange_strong(v, v | FUTEX_WAITERS)) {
      died = true;  // it just changed: look again at once
      continue;
    }
    w.push_back(futex_waitv{v | FUTEX_WAITERS, reinterpret_cast<uintptr_t>(word), FUTEX_32, 0});
  }
  if (!died) {
    timespec until{};
    clock_gettime(CLOCK_MONOTONIC, &until);
    const int64_t ns = until.tv_nsec + (timeout_ms % 1000) * 1000000;
    until.tv_sec += static_cast<time_t>(timeout_ms / 1000 + ns / 1000000000);
    until.tv_nsec = static_cast<long>(ns % 1000000000);
    const long r = ::syscall(__NR_futex_waitv, w.data(), static_cast<unsigned>(w.size()), 0, &until,
                             CLOCK_MONOTONIC);
    if (r < 0 && errno == ENOSYS) {
      no_waitv.store(true, std::memory_order_relaxed);
      return false;
    }
    *how = r >= 0               ? LifeWake::kWoken
           : errno == ETIMEDOUT ? LifeWake::kTimeout
           : errno == EAGAIN    ? LifeWake::kChanged
                                : LifeWake::kOther;
  }
  // The kernel wakes one waiter of a dead holder's word: this one wakes the rest.
  for (std::atomic<uint32_t>* word : words)
    if (life_owner_died(*word)) wake_all_waiters(word, /*shared=*/true);
  return true;
#else
  (void)words;
  (void)stop;
  (void)timeout_ms;
  (void)how;
  return false;
#endif
}

void life_stop(std::atomic<uint32_t>* stop) {
  stop->store(1);
  wake_all_waiters(stop, /*shared=*/false);
}

namespace {

// A life page's layout: the word first (LifeView::word), then what tells it
// from another file.
struct LifePage {
  std::atomic<uint32_t> word{0};
  uint32_t magic = 0;
  uint64_t nonce = 0;
};
static_assert(sizeof(LifePage) <= kLifePageBytes);
constexpr uint32_t kLifeMagic = 0x6d636c66;  // "mclf"

struct ProcessLife {
  pid_t pid = 0;  // the process that made it (a forked child makes its own)
  LifeRef ref;
  LifePage* page = nullptr;
};

std::mutex life_mu;
ProcessLife life;  // under life_mu

// A new life page and the thread that holds its word; {} where the kernel refuses.
ProcessLife make_life() {
  ProcessLife out;
  out.pid = ::getpid();
  const int fd = ::memfd_create("mooncake-life", MFD_CLOEXEC);
  if (fd < 0) return out;
  void* p = MAP_FAILED;
  uint64_t nonce = 0;
  // Owner-only, as a segment (transport/segment.cc).
  if (::fchmod(fd, 0600) == 0 && ::ftruncate(fd, kLifePageBytes) == 0 &&
      ::getrandom(&nonce, sizeof(nonce), 0) == sizeof(nonce))
    p = ::mmap(nullptr, kLifePageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    ::close(fd);
    return out;
  }
  auto* page = new (p) LifePage;
  page->magic = kLifeMagic;
  page->nonce = nonce | 1;  // never 0 (LifeRef::valid)
  std::promise<bool> held;
  std::future<bool> answer = held.get_future();
  bool ok = false;
  try {
    // Signals are the other threads' to take; this one holds the word and
    // sleeps until the process ends, which marks the word. (The promise is
    // the thread's: its shared state outlives this function's wait.)
    std::thread([page, held = std::move(held)]() mutable {
      begin_library_thread("mc-life");
      sigset_t all;
      sigfillset(&all);
      pthread_sigmask(SIG_BLOCK, &all, nullptr);
      LifeHold hold;  // on this stack, which lives as long as the process
      const bool holds = hold.hold(&page->word);
      held.set_value(holds);
      if (!holds) return;
      for (;;) ::pause();
    }).detach();
    ok = answer.get();
  } catch (const std::system_error&) {
    ok = false;  // no thread to hold it
  }
  if (!ok) {
    ::munmap(p, kLifePageBytes);
    ::close(fd);
    return out;
  }
  out.page = page;
  out.ref = LifeRef{static_cast<int32_t>(out.pid), fd, page->nonce};
  return out;
}

}  // namespace

LifeRef process_life() {
  static const bool forks_handled = [] {
    // A child forked while another thread held the lock would find it held.
    pthread_atfork(nullptr, nullptr, [] { new (&life_mu) std::mutex; });
    return true;
  }();
  (void)forks_handled;
  std::lock_guard<std::mutex> lock(life_mu);
  // A forked child makes its own: the parent's page is the parent's life.
  // (Its copy of the parent's mapping and descriptor is left as it is: the
  // child may have reused the descriptor's number since.)
  if (life.pid != ::getpid()) life = make_life();
  return life.ref;
}

LifeView::LifeView(const LifeRef& ref) {
  if (!ref.valid())
    throw_error(ErrorKind::kPeerFailed, -1, "no life page (pid ", ref.pid, ", fd ", ref.fd, ")");
  void* p = map_peer_file(ref.pid, ref.fd, kLifePageBytes, "life page");
  const auto* page = static_cast<const LifePage*>(p);
  if (page->magic != kLifeMagic || page->nonce != ref.nonce) {
    ::munmap(p, kLifePageBytes);
    throw_error(ErrorKind::kPeerFailed, -1, "/proc/", ref.pid, "/fd/", ref.fd,
                " is not the life page that process published (it is gone, and the pid reused?)");
  }
  page_ = p;
}

LifeView::~LifeView() {
  if (page_ != nullptr) ::munmap(page_, kLifePageBytes);
}

}  // namespace mooncake
