// Deadline: finite deadlines expire, infinite ones never do, remaining time is
// clamped, and the earliest of two is the sooner one.
#include "core/clock.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace mctest {
namespace {

using mooncake::Deadline;

TEST(Deadline, ZeroMillisecondsIsAlreadyExpired) {
  EXPECT_TRUE(Deadline::after_ms(0).expired());
  EXPECT_EQ(Deadline::after_ms(0).remaining_ms(100), 0);
}

TEST(Deadline, AFiniteDeadlineExpiresAfterItsTime) {
  Deadline d = Deadline::after_ms(20);
  EXPECT_FALSE(d.expired());
  EXPECT_FALSE(d.infinite());
  EXPECT_LE(d.remaining_ms(1000), 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(25));
  EXPECT_TRUE(d.expired());
  EXPECT_EQ(d.remaining_ms(1000), 0);
}

TEST(Deadline, NeverAndNegativeTimesAreInfinite) {
  for (Deadline d : {Deadline::never(), Deadline::after_ms(-1), Deadline::after_ms(-500)}) {
    EXPECT_TRUE(d.infinite());
    EXPECT_FALSE(d.expired());
    EXPECT_EQ(d.remaining_ms(1234), 1234);
  }
}

TEST(Deadline, RemainingTimeIsClampedToTheCap) {
  EXPECT_EQ(Deadline::after_ms(60000).remaining_ms(50), 50);
}

TEST(Deadline, EarliestPicksTheSoonerDeadline) {
  Deadline soon = Deadline::after_ms(10), late = Deadline::after_ms(60000);
  EXPECT_LE(soon.earliest(late).remaining_ms(100000), 10);
  EXPECT_LE(late.earliest(soon).remaining_ms(100000), 10);
  EXPECT_FALSE(Deadline::never().earliest(late).infinite());
  EXPECT_FALSE(late.earliest(Deadline::never()).infinite());
  EXPECT_TRUE(Deadline::never().earliest(Deadline::never()).infinite());
}

TEST(Clock, NowUsIsMonotonic) {
  int64_t last = mooncake::now_us();
  for (int i = 0; i < 1000; ++i) {
    int64_t now = mooncake::now_us();
    ASSERT_GE(now, last);
    last = now;
  }
}

}  // namespace
}  // namespace mctest
