#include "transport/secret.h"

#include <sys/random.h>

#include <cerrno>

#include "core/error.h"

namespace mooncake {

namespace {
constexpr char kHex[] = "0123456789abcdef";
}  // namespace

std::string random_secret() {
  uint8_t raw[kSecretBytes / 2];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = ::getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    MC_SYSCHECK(n);
    got += static_cast<size_t>(n);
  }
  std::string out;
  for (uint8_t b : raw) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

void check_secret(std::string_view secret, std::string_view what) {
  MC_CHECK_ARG(secret.size() == kSecretBytes && secret.find_first_not_of(kHex) == secret.npos, what,
               ": the group secret must be ", kSecretBytes, " lowercase hex digits, got ",
               secret.size(), " bytes");
}

bool secret_matches(const char* got, std::string_view secret) {
  if (secret.size() != kSecretBytes) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < kSecretBytes; ++i) diff |= static_cast<unsigned char>(got[i] ^ secret[i]);
  return diff == 0;
}

std::array<uint8_t, kSecretBytes / 2> secret_key(std::string_view secret) {
  check_secret(secret, "secret_key");
  auto nibble = [](char c) { return static_cast<uint8_t>(c <= '9' ? c - '0' : c - 'a' + 10); };
  std::array<uint8_t, kSecretBytes / 2> key{};
  for (size_t i = 0; i < key.size(); ++i)
    key[i] = static_cast<uint8_t>(nibble(secret[2 * i]) << 4 | nibble(secret[2 * i + 1]));
  return key;
}

}  // namespace mooncake
