// CommConfig::from_env: every field from its variable, MOONCAKE_PG_TIMEOUT_MS
// only when positive, and a value out of range refused naming the variable.
// (How the Communicator fills a config's unset fields from it is tested in
// tests/cpp/collectives/comm_config_test.cc.)
#include "core/comm_config.h"

#include <gtest/gtest.h>

#include "errors.h"
#include "scoped_env.h"

namespace mctest {
namespace {

using mooncake::CommConfig;
using mooncake::ErrorKind;

TEST(CommConfigFromEnv, EveryFieldComesFromItsVariable) {
  ScopedEnv chunk("MOONCAKE_CHUNK_BYTES", "1024");
  ScopedEnv small("MOONCAKE_SMALL_MSG_BYTES", "777");
  ScopedEnv recover("MOONCAKE_RECOVER", "0");
  ScopedEnv hang("MOONCAKE_HANG_MS", "0");
  const CommConfig c = CommConfig::from_env(1234);
  EXPECT_EQ(c.chunk_bytes, 1024u);
  EXPECT_EQ(c.small_bytes, 777u);
  EXPECT_EQ(c.recover, 0);
  EXPECT_EQ(c.hang_ms, 0);
}

TEST(CommConfigFromEnv, TakesThePgTimeoutOnlyWhenPositive) {
  {
    ScopedEnv timeout("MOONCAKE_PG_TIMEOUT_MS", "250");
    EXPECT_EQ(CommConfig::from_env(9000).timeout_ms, 250);
  }
  ScopedEnv timeout("MOONCAKE_PG_TIMEOUT_MS", "0");
  EXPECT_EQ(CommConfig::from_env(9000).timeout_ms, 9000);
}

TEST(CommConfigFromEnv, AValueOutOfRangeIsRefusedNamingTheVariable) {
  const std::pair<const char*, const char*> bad[] = {
      {"MOONCAKE_CHUNK_BYTES", "100"},
      {"MOONCAKE_CHUNK_BYTES", "0"},
      {"MOONCAKE_CHUNK_BYTES", "2147483648"},
      {"MOONCAKE_SMALL_MSG_BYTES", "-1"},
      {"MOONCAKE_RECOVER", "2"},
      {"MOONCAKE_HANG_MS", "-5"},
  };
  for (const auto& [name, value] : bad) {
    ScopedEnv env(name, value);
    EXPECT_TRUE(throws_error(
        ErrorKind::kInvalidArgument, [] { CommConfig::from_env(1000); }, name))
        << name << "=" << value;
  }
}

}  // namespace
}  // namespace mctest
