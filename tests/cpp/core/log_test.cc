#include "core/log.h"

#include <gtest/gtest.h>

#include <thread>

namespace mooncake {
namespace {

TEST(LogLimiter, AllowsAQuotaASecondThenSaysHowManyItLeftOut) {
  LogLimiter limit(3);
  testing::internal::CaptureStderr();
  int allowed = 0;
  for (int i = 0; i < 10; ++i) allowed += limit.allow("test lines");
  EXPECT_EQ(allowed, 3);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");  // the summary waits for a new second
  std::this_thread::sleep_for(std::chrono::milliseconds(1010));
  testing::internal::CaptureStderr();
  EXPECT_TRUE(limit.allow("test lines"));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("7 more test lines in the last second"), std::string::npos) << err;
  // A quiet second says nothing.
  std::this_thread::sleep_for(std::chrono::milliseconds(1010));
  testing::internal::CaptureStderr();
  EXPECT_TRUE(limit.allow("test lines"));
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

}  // namespace
}  // namespace mooncake
