// Request: completes once, wakes waiters, runs callbacks once; all_of
// completes after every part, with the first error to arrive.
#include "collectives/request.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "core/clock.h"
#include "errors.h"

namespace mctest {
namespace {

using mooncake::all_of;
using mooncake::Error;
using mooncake::ErrorKind;
using mooncake::Request;

std::exception_ptr error_named(const std::string& what) {
  return std::make_exception_ptr(Error(ErrorKind::kInvalidArgument, what));
}

std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  }
}

TEST(Request, WaitReturnsFalseAtItsTimeoutWhileNotDone) {
  Request r;
  const int64_t start = mooncake::now_us();
  EXPECT_FALSE(r.wait(50));
  EXPECT_GE(mooncake::now_us() - start, 50'000);
  EXPECT_FALSE(r.done());
}

TEST(Request, CompletionWakesAWaiterOnAnotherThread) {
  Request r;
  std::thread completer([&] { r.complete(); });
  EXPECT_TRUE(r.wait(5000));
  completer.join();
  EXPECT_TRUE(r.done());
  EXPECT_EQ(r.error(), nullptr);
}

TEST(Request, OnlyTheFirstCompletionCounts) {
  Request r;
  r.complete(error_named("first"));
  r.complete(error_named("second"));
  r.complete();
  ASSERT_NE(r.error(), nullptr);
  EXPECT_EQ(message_of(r.error()), "first");
}

TEST(Request, CallbacksRunOnceWhenDoneOrAtOnceIfAlreadyDone) {
  Request r;
  int before = 0, after = 0;
  std::exception_ptr seen;
  r.on_complete([&](std::exception_ptr e) {
    ++before;
    seen = e;
  });
  EXPECT_EQ(before, 0);
  r.complete(error_named("boom"));
  r.complete();
  EXPECT_EQ(before, 1);
  EXPECT_EQ(message_of(seen), "boom");
  r.on_complete([&](std::exception_ptr) { ++after; });
  EXPECT_EQ(after, 1);
}

TEST(Request, SourceRankIsMinusOneUntilSet) {
  Request r;
  EXPECT_EQ(r.source_rank(), -1);
  r.set_source_rank(3);
  EXPECT_EQ(r.source_rank(), 3);
}

TEST(AllOf, NoPartsIsDoneAtOnce) {
  auto all = all_of({});
  EXPECT_TRUE(all->done());
  EXPECT_EQ(all->error(), nullptr);
}

TEST(AllOf, IsDoneOnlyAfterEveryPart) {
  std::vector<std::shared_ptr<Request>> parts(3);
  for (auto& p : parts) p = std::make_shared<Request>();
  auto all = all_of(parts);
  parts[2]->complete();
  parts[0]->complete();
  EXPECT_FALSE(all->done());
  parts[1]->complete();
  EXPECT_TRUE(all->done());
  EXPECT_EQ(all->error(), nullptr);
}

TEST(AllOf, CarriesTheFirstErrorToArriveNotTheFirstInTheList) {
  std::vector<std::shared_ptr<Request>> parts(3);
  for (auto& p : parts) p = std::make_shared<Request>();
  auto all = all_of(parts);
  parts[2]->complete(error_named("arrived first"));
  parts[0]->complete(error_named("arrived second"));
  parts[1]->complete();
  ASSERT_TRUE(all->done());
  EXPECT_EQ(message_of(all->error()), "arrived first");
}

TEST(AllOf, PartsAlreadyDoneCount) {
  auto done = std::make_shared<Request>();
  done->complete();
  auto pending = std::make_shared<Request>();
  auto all = all_of({done, pending});
  EXPECT_FALSE(all->done());
  pending->complete();
  EXPECT_TRUE(all->done());
}

TEST(AllOf, PartsCompletedConcurrentlyCompleteItExactlyOnce) {
  constexpr int kParts = 256, kThreads = 8;
  std::vector<std::shared_ptr<Request>> parts(kParts);
  for (auto& p : parts) p = std::make_shared<Request>();
  auto all = all_of(parts);
  std::atomic<int> callbacks{0};
  all->on_complete([&](std::exception_ptr) { ++callbacks; });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = t; i < kParts; i += kThreads) parts[i]->complete();
    });
  for (auto& t : threads) t.join();
  EXPECT_TRUE(all->done());
  EXPECT_EQ(callbacks.load(), 1);
}

}  // namespace
}  // namespace mctest
