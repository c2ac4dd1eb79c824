// Life words (transport/life.h): the kernel marks a holder's death at once and
// wakes one waiter, which wakes the others; a word released on purpose is no
// death; a thread that exits holding its word is one. A process's life page
// (process_life) marks its death, and its exit, for a peer that maps it.
#include "transport/life.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "errors.h"

namespace mctest {
namespace {

using mooncake::life_owner_died;
using mooncake::life_stop;
using mooncake::life_wait;
using mooncake::LifeHold;
using mooncake::LifeRef;
using mooncake::LifeView;
using mooncake::process_life;

// A word in memory that a forked child shares with this process.
std::atomic<uint32_t>* shared_word() {
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  return new (p) std::atomic<uint32_t>(0);
}

// A child process whose second thread holds `word`; it touches `mb` MiB of
// small pages (so that its exit, after a kill, takes a while) and then waits.
pid_t holder_process(std::atomic<uint32_t>* word, size_t mb) {
  int ready[2];
  EXPECT_EQ(pipe(ready), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    std::thread([&] {
      LifeHold hold;
      if (!hold.hold(word)) _exit(3);
      const size_t bytes = mb << 20;
      void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      madvise(m, bytes, MADV_NOHUGEPAGE);
      std::memset(m, 1, bytes);
      if (write(ready[1], "r", 1) != 1) _exit(4);
      for (;;) pause();
    }).detach();
    for (;;) pause();
  }
  char c = 0;
  EXPECT_EQ(read(ready[0], &c, 1), 1);
  close(ready[0]);
  close(ready[1]);
  return pid;
}

TEST(LifeWord, AHoldersDeathWakesEveryWaiterBeforeItsProcessHasExited) {
  std::atomic<uint32_t>* word = shared_word();
  const pid_t child = holder_process(word, 256);
  ASSERT_FALSE(life_owner_died(*word));
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, child, 0));
  ASSERT_GE(pidfd, 0);
  constexpr int kWaiters = 4;
  std::atomic<uint32_t> stop{0};
  std::atomic<int> woke{0}, exited_first{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < kWaiters; ++i)
    waiters.emplace_back([&] {
      const mooncake::Deadline d = mooncake::Deadline::after_ms(20000);
      while (!life_owner_died(*word) && stop.load() == 0 && !d.expired())
        if (!life_wait({word}, &stop, 20000)) return;  // no futex_waitv here
      if (!life_owner_died(*word)) return;
      pollfd p{pidfd, POLLIN, 0};
      if (poll(&p, 1, 0) > 0) exited_first.fetch_add(1);
      woke.fetch_add(1);
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // all asleep on the word
  ASSERT_EQ(kill(child, SIGKILL), 0);
  const mooncake::Deadline d = mooncake::Deadline::after_ms(5000);
  while (woke.load() < kWaiters && !d.expired())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(woke.load(), kWaiters) << "waiters left asleep 5 s after the holder's death";
  life_stop(&stop);
  for (auto& t : waiters) t.join();
  EXPECT_TRUE(life_owner_died(*word));
  // Marked as the thread died, not when the process (256 MiB to tear down) was gone.
  EXPECT_EQ(exited_first.load(), 0) << "the process had exited before a waiter woke";
  waitpid(child, nullptr, 0);
  close(pidfd);
}

TEST(LifeWord, AWordReleasedOnPurposeIsNoDeathAndWakesItsWaiters) {
  std::atomic<uint32_t>* word = shared_word();
  std::atomic<uint32_t> stop{0};
  std::atomic<bool> held{false}, go{false}, woke{false};
  std::thread holder([&] {
    LifeHold hold;
    held = hold.hold(word);
    while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    hold.release();
  });
  while (!held.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread waiter([&] {
    life_wait({word}, &stop, 20000);
    woke = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  go = true;
  holder.join();
  const mooncake::Deadline d = mooncake::Deadline::after_ms(5000);
  while (!woke.load() && !d.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(woke.load()) << "a waiter slept on after the word was released";
  life_stop(&stop);
  waiter.join();
  EXPECT_FALSE(life_owner_died(*word));
  EXPECT_EQ(word->load(), 0u);
}

TEST(LifeWord, AThreadThatExitsHoldingItsWordIsADeath) {
  std::atomic<uint32_t>* word = shared_word();
  auto hold = std::make_unique<LifeHold>();  // outlives the thread: the kernel reads it at its exit
  bool held = false;
  std::thread([&] { held = hold->hold(word); }).join();
  ASSERT_TRUE(held);
  EXPECT_TRUE(life_owner_died(*word));
}

// A child process that makes its life page and sends its LifeRef, then waits;
// with `go`, it exits normally (exit(0)) once a byte comes on *go.
pid_t life_process(LifeRef* ref, int* go = nullptr) {
  int sent[2], told[2];
  EXPECT_EQ(pipe(sent), 0);
  EXPECT_EQ(pipe(told), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    const LifeRef mine = process_life();
    if (write(sent[1], &mine, sizeof(mine)) != sizeof(mine)) _exit(4);
    if (go != nullptr) {
      char c = 0;
      if (read(told[0], &c, 1) != 1) _exit(5);
      exit(0);
    }
    for (;;) pause();
  }
  EXPECT_EQ(read(sent[0], ref, sizeof(*ref)), static_cast<ssize_t>(sizeof(*ref)));
  close(sent[0]);
  close(sent[1]);
  close(told[0]);
  if (go != nullptr)
    *go = told[1];
  else
    close(told[1]);
  return pid;
}

bool marked_within(const LifeView& view, int64_t ms) {
  const mooncake::Deadline d = mooncake::Deadline::after_ms(ms);
  while (!view.owner_died() && !d.expired())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return view.owner_died();
}

TEST(LifePage, APeersViewSeesTheProcessKilledAndKeepsThePageAfterItIsGone) {
  LifeRef ref;
  const pid_t child = life_process(&ref);
  ASSERT_TRUE(ref.valid()) << "the kernel refused a life page";
  EXPECT_EQ(ref.pid, child);
  LifeView view(ref);
  EXPECT_FALSE(view.owner_died());
  EXPECT_NE(view.word().load() & FUTEX_TID_MASK, 0u) << "no thread holds the word";
  ASSERT_EQ(kill(child, SIGKILL), 0);
  EXPECT_TRUE(marked_within(view, 5000)) << "the death was not marked within 5 s";
  waitpid(child, nullptr, 0);
  // The process is gone and reaped: the view's page (one page) is still there.
  EXPECT_TRUE(view.owner_died());
  // And no one can map it anew.
  EXPECT_TRUE(throws_error(mooncake::ErrorKind::kPeerFailed, [&] { LifeView again(ref); }));
}

TEST(LifePage, AProcessThatExitsNormallyIsMarkedToo) {
  LifeRef ref;
  int go = -1;
  const pid_t child = life_process(&ref, &go);
  ASSERT_TRUE(ref.valid());
  LifeView view(ref);
  EXPECT_FALSE(view.owner_died());
  ASSERT_EQ(write(go, "g", 1), 1);
  int status = 0;
  waitpid(child, &status, 0);
  close(go);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_TRUE(marked_within(view, 5000)) << "a normal exit left the word held";
}

TEST(LifePage, AViewRefusesWhatIsNotThatProcesssPage) {
  LifeRef ref;
  const pid_t child = life_process(&ref);
  ASSERT_TRUE(ref.valid());
  LifeRef wrong = ref;
  wrong.nonce ^= 2;
  EXPECT_TRUE(throws_error(
      mooncake::ErrorKind::kPeerFailed, [&] { LifeView v(wrong); }, "is not the life page"));
  wrong = ref;
  wrong.fd = 0;  // its stdin: not a one-page file
  EXPECT_TRUE(throws_error(mooncake::ErrorKind::kPeerFailed, [&] { LifeView v(wrong); }));
  EXPECT_TRUE(throws_error(
      mooncake::ErrorKind::kPeerFailed, [&] { LifeView v(LifeRef{}); }, "no life page"));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
}

TEST(LifePage, AForkedChildHasAPageOfItsOwn) {
  const LifeRef mine = process_life();
  ASSERT_TRUE(mine.valid());
  EXPECT_EQ(process_life(), mine) << "a second call made another page";
  LifeRef theirs;
  const pid_t child = life_process(&theirs);
  ASSERT_TRUE(theirs.valid());
  EXPECT_EQ(theirs.pid, child);
  EXPECT_NE(theirs.nonce, mine.nonce);
  LifeView view(mine);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_FALSE(view.owner_died()) << "the child's death marked the parent's page";
}

}  // namespace
}  // namespace mctest
