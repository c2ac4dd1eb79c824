#include "transport/secret.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>

#include "core/error.h"
#include "core/hex.h"

namespace mooncake {

std::string random_secret() {
  uint8_t raw[kSecretBytes / 2];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = ::getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    MC_SYSCHECK(n);
    got += static_cast<size_t>(n);
  }
  return to_hex(raw, sizeof(raw));
}

void check_secret(std::string_view secret, std::string_view what) {
  MC_CHECK_ARG(secret.size() == kSecretBytes && from_hex(secret), what,
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
  const std::vector<uint8_t> bytes = *from_hex(secret);
  std::array<uint8_t, kSecretBytes / 2> key{};
  std::copy(bytes.begin(), bytes.end(), key.begin());
  return key;
}

}  // namespace mooncake
