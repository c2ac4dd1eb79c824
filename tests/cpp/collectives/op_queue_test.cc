// OpQueue: tasks run one at a time in submission order, whether the queue's
// thread or a waiting caller runs them; a task's outcome completes its own
// request only; stop fails what is queued and lets the running task finish;
// waiting is bounded by its timeout; stop may be called from the queue's thread;
// run_now runs a task (and those before it) on the caller's thread at once.
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "collectives/request.h"
#include "collectives/request_error.h"
#include "core/clock.h"
#include "errors.h"
#include "harness.h"

namespace mctest {
namespace {

using mooncake::ErrorKind;
using mooncake::OpQueue;
using mooncake::Request;

constexpr int64_t kNever = 60'000'000;  // a start delay no test outlives

// Blocks a task until released (or for at most `limit_ms`).
class Gate {
 public:
  void open() { open_ = true; }
  void pass(int64_t limit_ms = 5000) {
    entered_ = true;
    mooncake::Deadline d = mooncake::Deadline::after_ms(limit_ms);
    while (!open_ && !d.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void wait_entered() {
    mooncake::Deadline d = mooncake::Deadline::after_ms(5000);
    while (!entered_ && !d.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_TRUE(entered_) << "the task never started";
  }

 private:
  std::atomic<bool> open_{false};
  std::atomic<bool> entered_{false};
};

TEST(OpQueue, TasksRunOneAtATimeInSubmissionOrderOnEitherThread) {
  for (int64_t delay_us : {int64_t{0}, int64_t{100}, kNever}) {
    OpQueue q(delay_us);
    std::vector<int> order;
    std::atomic<int> running{0}, most{0};
    std::vector<std::shared_ptr<Request>> requests;
    for (int i = 0; i < 200; ++i) {
      requests.push_back(q.submit([&, i] {
        most = std::max(most.load(), ++running);
        order.push_back(i);
        --running;
      }));
      if (i % 7 == 3) EXPECT_TRUE(q.wait(requests.back(), 5000));  // some run inline
    }
    EXPECT_TRUE(q.wait(requests.back(), 5000));
    for (auto& r : requests) EXPECT_TRUE(r->wait(5000));
    ASSERT_EQ(order.size(), 200u) << "delay " << delay_us;
    for (int i = 0; i < 200; ++i) ASSERT_EQ(order[i], i) << "delay " << delay_us;
    EXPECT_EQ(most.load(), 1) << "delay " << delay_us;
  }
}

TEST(OpQueue, ACallerWaitingForEverRunsQueuedTasksOnItsOwnThread) {
  OpQueue q(kNever);  // the queue's thread would never start them
  std::vector<std::thread::id> ran_on;
  std::vector<std::shared_ptr<Request>> requests;
  for (int i = 0; i < 3; ++i)
    requests.push_back(q.submit([&] { ran_on.push_back(std::this_thread::get_id()); }));
  EXPECT_TRUE(q.wait(requests.back(), -1));
  ASSERT_EQ(ran_on.size(), 3u);
  for (auto id : ran_on) EXPECT_EQ(id, std::this_thread::get_id());
}

TEST(OpQueue, RunNowRunsTheTaskAndTheOnesQueuedBeforeItOnTheCallersThread) {
  OpQueue q(kNever);  // the queue's thread would never start them
  std::vector<int> order;
  std::vector<std::thread::id> ran_on;
  auto record = [&](int i) {
    order.push_back(i);
    ran_on.push_back(std::this_thread::get_id());
  };
  auto first = q.submit([&] { record(0); });
  auto second = q.submit([&] { record(1); });
  auto now = q.run_now([&] { record(2); });
  EXPECT_TRUE(now->done()) << "run_now returned before its task finished";
  EXPECT_TRUE(first->done() && second->done());
  ASSERT_EQ(order, (std::vector<int>{0, 1, 2}));
  for (auto id : ran_on) EXPECT_EQ(id, std::this_thread::get_id());
  auto bad = q.run_now([] { throw mooncake::Error(ErrorKind::kTimeout, "task timed out"); });
  EXPECT_TRUE(throws_error(ErrorKind::kTimeout, rethrow_error_of(bad)));
}

// Times thread `tid` of this process has blocked (voluntary context switches).
int64_t sleeps_of(long tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/status");
  std::string key;
  while (in >> key)
    if (key == "voluntary_ctxt_switches:") {
      int64_t n = -1;
      in >> n;
      return n;
    }
  return -1;
}

TEST(OpQueue, SynchronousOpsDoNotWakeTheQueuesIdleThread) {
  // Once an async op has started the thread, every later op a caller runs
  // inline must leave it asleep: with eight ranks on two cores each needless
  // wake-up is a context switch per op.
  OpQueue q(0);
  std::atomic<long> tid{-1};
  ASSERT_TRUE(q.wait(q.submit([&] { tid = ::syscall(SYS_gettid); }), 5000));
  ASSERT_GT(tid.load(), 0) << "the queue's thread did not run the submitted task";
  auto run_for = [&](int64_t ms) {
    const mooncake::Deadline d = mooncake::Deadline::after_ms(ms);
    int n = 0;
    while (!d.expired()) {
      q.run_now([] {});
      ++n;
    }
    return n;
  };
  run_for(60);  // the thread lingers 20 ms after its own task, then sleeps
  const int64_t before = sleeps_of(tid);
  ASSERT_GE(before, 0);
  const int ops = run_for(100);
  const int64_t woken = sleeps_of(tid) - before;
  EXPECT_LE(woken, 5) << "the idle queue thread was woken " << woken << " times by " << ops
                      << " synchronous ops";
}

TEST(OpQueue, RunNowBehindATaskTheThreadRunsGoesOnAsSoonAsThatTaskEnds) {
  OpQueue q(kNever);  // the thread runs only what a deadline waiter marks due
  Gate gate;
  auto slow = q.submit([&] { gate.pass(); });
  EXPECT_FALSE(q.wait(slow, 1));  // marks it due: the thread starts it
  gate.wait_entered();
  std::atomic<bool> ran{false}, returned{false};
  std::thread caller([&] {
    q.run_now([&] { ran = true; });
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  gate.open();
  // Woken when the running task ended, not left to the start delay.
  mooncake::Deadline d = mooncake::Deadline::after_ms(3000);
  while (!returned && !d.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(returned.load()) << "run_now still waiting 3 s after the task before it ended";
  if (!returned) q.stop("the test gave up");  // releases the caller
  caller.join();
  EXPECT_TRUE(ran.load());
  EXPECT_TRUE(slow->done());
}

TEST(OpQueue, RunNowAfterStopFails) {
  OpQueue q(0);
  q.stop();
  bool ran = false;
  EXPECT_TRUE(
      throws_error(ErrorKind::kPeerFailed, rethrow_error_of(q.run_now([&] { ran = true; }))));
  EXPECT_FALSE(ran);
}

TEST(OpQueue, ATaskNobodyWaitsForStartsAfterTheStartDelay) {
  OpQueue q(50'000);
  const int64_t start = mooncake::now_us();
  std::atomic<int64_t> ran_at{0};
  auto r = q.submit([&] { ran_at = mooncake::now_us(); });
  ASSERT_TRUE(r->wait(5000));
  EXPECT_GE(ran_at.load() - start, 50'000);
}

TEST(OpQueue, ATaskThatThrowsFailsOnlyItsOwnRequest) {
  OpQueue q(0);
  auto bad = q.submit([] { throw mooncake::Error(ErrorKind::kTimeout, "task timed out"); });
  bool later_ran = false;
  auto good = q.submit([&] { later_ran = true; });
  EXPECT_TRUE(throws_error(ErrorKind::kTimeout, rethrow_error_of(bad)));
  ASSERT_TRUE(q.wait(good, 5000));
  EXPECT_EQ(good->error(), nullptr);
  EXPECT_TRUE(later_ran);
}

TEST(OpQueue, StopFailsQueuedTasksAndLetsTheRunningOneFinish) {
  OpQueue q(0);
  Gate gate;
  bool second_ran = false;
  auto first = q.submit([&] { gate.pass(); });
  auto second = q.submit([&] { second_ran = true; });
  gate.wait_entered();
  std::thread stopper([&] { q.stop("stopped by the test"); });
  EXPECT_TRUE(throws_error(ErrorKind::kPeerFailed, rethrow_error_of(second)));
  EXPECT_FALSE(first->done());
  gate.open();
  stopper.join();
  EXPECT_TRUE(first->done());
  EXPECT_EQ(first->error(), nullptr);
  EXPECT_FALSE(second_ran);
}

TEST(OpQueue, SubmitAfterStopFails) {
  OpQueue q(0);
  q.stop();
  EXPECT_TRUE(throws_error(ErrorKind::kPeerFailed, rethrow_error_of(q.submit([] {}))));
}

TEST(OpQueue, DestroyingTheQueueFailsWhatIsStillQueued) {
  std::shared_ptr<Request> queued;
  {
    OpQueue q(kNever);
    queued = q.submit([] {});
  }
  EXPECT_TRUE(throws_error(ErrorKind::kPeerFailed, rethrow_error_of(queued)));
}

TEST(OpQueue, ACallerWaitingWithADeadlineHasTheQueuesThreadStartTheTasksAtOnce) {
  OpQueue q(kNever);  // without the waiter's nudge the thread would never start them
  std::vector<std::thread::id> ran_on;
  std::vector<std::shared_ptr<Request>> requests;
  for (int i = 0; i < 3; ++i)
    requests.push_back(q.submit([&] { ran_on.push_back(std::this_thread::get_id()); }));
  EXPECT_TRUE(q.wait(requests[1], 5000));
  EXPECT_TRUE(q.wait(requests[2], 5000));
  ASSERT_EQ(ran_on.size(), 3u);
  for (auto id : ran_on) EXPECT_NE(id, std::this_thread::get_id());
}

TEST(OpQueue, WaitReturnsAtItsTimeoutEvenWhenTheTaskIsStillRunning) {
  OpQueue q(kNever);  // only a waiter gets the task started
  Gate gate;
  auto slow = q.submit([&] { gate.pass(/*limit_ms=*/2000); });
  const int64_t start = mooncake::now_us();
  const bool done = q.wait(slow, 100);
  const int64_t elapsed_ms = (mooncake::now_us() - start) / 1000;
  EXPECT_FALSE(done) << "wait(100 ms) reported done";
  EXPECT_LT(elapsed_ms, 1000) << "wait(request, 100 ms) returned after " << elapsed_ms
                              << " ms: it ran the 2 s task inline instead of honouring its timeout";
  gate.open();
  EXPECT_TRUE(q.wait(slow, 5000));
}

TEST(OpQueue, StopCalledFromACompletionCallbackOnTheQueuesThreadReturns) {
  // In its own process: if stop() deadlocks, the process is abandoned.
  run_ranks(1,
            [](Rank&) {
              OpQueue q(0);
              Gate gate;
              std::atomic<bool> stopped{false};
              auto r = q.submit([&] { gate.pass(); });  // runs on the queue's thread
              r->on_complete([&](std::exception_ptr) {
                q.stop();  // e.g. a callback that shuts the group down
                stopped = true;
              });
              gate.open();
              mooncake::Deadline d = mooncake::Deadline::after_ms(2000);
              while (!stopped && !d.expired())
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
              if (!stopped)
                fail_rank_now(
                    "OpQueue::stop() called from a completion callback on the queue's thread "
                    "did not return within 2 s (it waits for the task that is running it)");
            },
            {.timeout_ms = 10000});
}

TEST(OpQueue, ACompletionCallbackThatRunsAnotherTaskOnTheSameQueueDoesNotWaitForItself) {
  // A Work's callback that makes a blocking call on the same queue (run_now,
  // or a wait, for ever or with a timeout), on whichever thread ran the task:
  // it runs the next task nested, rather than wait for the task whose callback
  // it is.
  run_ranks(1,
            [](Rank&) {
              for (int64_t delay_us : {int64_t{0}, kNever}) {
                OpQueue q(delay_us);
                std::atomic<int> done{0};
                std::vector<int> order;
                auto first = q.submit([&] { order.push_back(1); });
                auto queued = q.submit([&] { order.push_back(2); });
                first->on_complete([&](std::exception_ptr) {
                  q.run_now([&] { order.push_back(3); });
                  done += 1;
                });
                std::atomic<bool> timed_ok{false};
                queued->on_complete([&](std::exception_ptr) {
                  // With a timeout too (a Work's wait(timeout)): no task could start
                  // while it waits, so it runs them as well.
                  timed_ok = q.wait(q.submit([&] { order.push_back(4); }), 5000);
                  done += 1;
                });
                // The thread runs them (no delay), or this waiter does.
                if (delay_us != 0) q.wait(queued, -1);
                mooncake::Deadline d = mooncake::Deadline::after_ms(2000);
                while (done < 2 && !d.expired())
                  std::this_thread::sleep_for(std::chrono::milliseconds(1));
                if (done < 2)
                  fail_rank_now(
                      "a completion callback's blocking call on its own queue did not "
                      "return within 2 s (it waits for the task whose callback it is)");
                if (order != std::vector<int>({1, 2, 3, 4}))
                  fail_rank_now("tasks ran out of submission order");
                if (!timed_ok) fail_rank_now("the callback's wait with a timeout failed");
              }
            },
            {.timeout_ms = 10000});
}

}  // namespace
}  // namespace mctest
