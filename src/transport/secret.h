// The group's secret: a random token the first member puts in the store and
// every member reads (Endpoint). A tcp connection proves it in its hello
// (tcp_wire.h); an shm segment carries a seal keyed with it (shm.cc).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mooncake {

constexpr size_t kSecretBytes = 32;  // lowercase hex digits of 16 random bytes

// A fresh token: kSecretBytes hex digits of getrandom() bytes.
std::string random_secret();

// Throws kInvalidArgument, starting with `what`, unless `secret` is
// kSecretBytes lowercase hex digits.
void check_secret(std::string_view secret, std::string_view what);

// Whether the kSecretBytes bytes at `got` are `secret` (constant time: how
// much of a guess was right does not show in how long the answer takes).
bool secret_matches(const char* got, std::string_view secret);

// The 16 bytes a checked secret's hex digits stand for (a hash key).
std::array<uint8_t, kSecretBytes / 2> secret_key(std::string_view secret);

}  // namespace mooncake
