// The error helpers: each macro throws the kind its name promises, with a
// message that says what went wrong.
#include "core/error.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <set>
#include <string>

#include "errors.h"

namespace mctest {
namespace {

using mooncake::Error;
using mooncake::ErrorKind;

TEST(Error, CheckArgThrowsInvalidArgumentWithTheConcatenatedMessage) {
  try {
    MC_CHECK_ARG(1 + 1 == 3, "count must be ", 3, ", got ", 2);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_STREQ(e.what(), "count must be 3, got 2");
    EXPECT_EQ(e.peer(), -1);
  }
}

TEST(Error, AssertThrowsInternalNamingTheCondition) {
  try {
    const int x = 4;
    MC_ASSERT(x < 3, "x is ", x);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(std::string(e.what()).find("x < 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("x is 4"), std::string::npos) << e.what();
  }
}

TEST(Error, SyscheckReturnsTheResultOrThrowsSystemWithErrno) {
  EXPECT_EQ(MC_SYSCHECK(::dup2(1, 1)), 1);
  try {
    MC_SYSCHECK(::open("/nonexistent/mooncake", O_RDONLY));
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kSystem);
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos)
        << e.what();
  }
}

TEST(Error, ThrowErrorCarriesThePeer) {
  try {
    mooncake::throw_error(ErrorKind::kPeerFailed, 5, "rank ", 5, " is gone");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kPeerFailed);
    EXPECT_EQ(e.peer(), 5);
    EXPECT_STREQ(e.what(), "rank 5 is gone");
  }
}

TEST(Error, EveryKindHasItsOwnName) {
  std::set<std::string> names;
  for (ErrorKind k :
       {ErrorKind::kInvalidArgument, ErrorKind::kTimeout, ErrorKind::kPeerFailed,
        ErrorKind::kLeftOut, ErrorKind::kUnsupported, ErrorKind::kSystem, ErrorKind::kInternal})
    names.insert(mooncake::error_kind_name(k));
  EXPECT_EQ(names.size(), 7u);
  EXPECT_STREQ(mooncake::error_kind_name(ErrorKind::kLeftOut), "left out");
}

// Recovery and masking act on peer failures and timeouts only: this rank left
// out of the group is final, never a peer failure to recover from.
TEST(Error, OnlyPeerFailuresAndTimeoutsAreForRecovery) {
  auto of = [](ErrorKind k) { return Error(k, "x", 1).peer_or_timeout(); };
  EXPECT_TRUE(of(ErrorKind::kPeerFailed));
  EXPECT_TRUE(of(ErrorKind::kTimeout));
  for (ErrorKind k : {ErrorKind::kLeftOut, ErrorKind::kInvalidArgument, ErrorKind::kUnsupported,
                      ErrorKind::kSystem, ErrorKind::kInternal})
    EXPECT_FALSE(of(k)) << mooncake::error_kind_name(k);
}

}  // namespace
}  // namespace mctest
