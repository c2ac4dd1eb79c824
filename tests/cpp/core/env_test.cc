// The environment registry: declared variables fall back to their defaults,
// integers are parsed strictly, and reading an undeclared name is an error.
#include "core/env.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "errors.h"
#include "scoped_env.h"

namespace mctest {
namespace {

using mooncake::env_int;
using mooncake::env_string;
using mooncake::ErrorKind;

TEST(Env, EveryVariableIsDeclaredOnceWithAPrefixDefaultAndDoc) {
  std::set<std::string> names;
  for (const auto& v : mooncake::env_registry()) {
    EXPECT_EQ(std::string(v.name).rfind("MOONCAKE_", 0), 0u) << v.name;
    EXPECT_NE(v.default_value, nullptr) << v.name;
    EXPECT_GT(std::string(v.doc).size(), 10u) << v.name;
    EXPECT_TRUE(names.insert(v.name).second) << v.name << " is declared twice";
  }
  EXPECT_TRUE(names.count("MOONCAKE_CHUNK_BYTES"));
}

TEST(Env, UnsetOrEmptyVariablesReadAsTheirDefault) {
  {
    ScopedEnv unset("MOONCAKE_CHUNK_BYTES", std::nullopt);
    EXPECT_EQ(env_string("MOONCAKE_CHUNK_BYTES"), "262144");
    EXPECT_EQ(env_int("MOONCAKE_CHUNK_BYTES"), 262144);
  }
  ScopedEnv empty("MOONCAKE_CHUNK_BYTES", "");
  EXPECT_EQ(env_int("MOONCAKE_CHUNK_BYTES"), 262144);
}

TEST(Env, SetVariablesReadAsTheirValue) {
  ScopedEnv set("MOONCAKE_CHUNK_BYTES", "-4096");
  EXPECT_EQ(env_string("MOONCAKE_CHUNK_BYTES"), "-4096");
  EXPECT_EQ(env_int("MOONCAKE_CHUNK_BYTES"), -4096);
}

TEST(Env, ABadIntegerIsAnInvalidArgumentNamingTheVariable) {
  for (const char* bad : {"abc", "12abc", "1.5", "0x10"}) {
    ScopedEnv set("MOONCAKE_CHUNK_BYTES", bad);
    try {
      env_int("MOONCAKE_CHUNK_BYTES");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const mooncake::Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << bad;
      EXPECT_NE(std::string(e.what()).find("MOONCAKE_CHUNK_BYTES"), std::string::npos) << e.what();
    }
  }
}

TEST(Env, AnIntegerOutOfRangeIsAnInvalidArgumentNotClamped) {
  ScopedEnv set("MOONCAKE_CHUNK_BYTES", "99999999999999999999");  // > INT64_MAX
  int64_t value = 0;
  EXPECT_TRUE(
      throws_error(ErrorKind::kInvalidArgument, [&] { value = env_int("MOONCAKE_CHUNK_BYTES"); }))
      << "read as " << value;
}

TEST(Env, ReadingAnUndeclaredNameIsAnError) {
  ScopedEnv set("MOONCAKE_NOT_DECLARED", "1");
  EXPECT_TRUE(throws_error(ErrorKind::kInternal, [] { env_string("MOONCAKE_NOT_DECLARED"); }));
  EXPECT_TRUE(throws_error(ErrorKind::kInternal, [] { env_int("MOONCAKE_NOT_DECLARED"); }));
}

}  // namespace
}  // namespace mctest
