// The one registry of environment knobs. Every variable the library reads is
// declared in env.cc with its default and documentation; `python -m mooncake
// doctor` lists them from there, and tests/python/test_docs.py checks that
// docs/env.md does too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mooncake {

struct EnvVar {
  const char* name;
  const char* default_value;
  const char* doc;
};

// All declared variables, in declaration order.
const std::vector<EnvVar>& env_registry();

// The variable's value, or its declared default. Reading an undeclared name
// is an internal error.
std::string env_string(const char* name);
int64_t env_int(const char* name);

}  // namespace mooncake
