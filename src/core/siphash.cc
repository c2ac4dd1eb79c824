#include "core/siphash.h"

#include <cstring>

namespace mooncake {

namespace {

uint64_t rotl(uint64_t x, int b) {
  return (x << b) | (x >> (64 - b));
}

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

struct State {
  uint64_t v0, v1, v2, v3;
  void round() {
    v0 += v1;
    v1 = rotl(v1, 13);
    v1 ^= v0;
    v0 = rotl(v0, 32);
    v2 += v3;
    v3 = rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = rotl(v1, 17);
    v1 ^= v2;
    v2 = rotl(v2, 32);
  }
  void absorb(uint64_t m) {
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  }
};

}  // namespace

uint64_t siphash24(const uint8_t key[16], const void* data, size_t len) {
  const uint64_t k0 = load_le64(key), k1 = load_le64(key + 8);
  State s{k0 ^ 0x736f6d6570736575ull, k1 ^ 0x646f72616e646f6dull, k0 ^ 0x6c7967656e657261ull,
          k1 ^ 0x7465646279746573ull};
  const auto* p = static_cast<const uint8_t*>(data);
  size_t left = len;
  for (; left >= 8; left -= 8, p += 8) s.absorb(load_le64(p));
  uint8_t last[8] = {};
  if (left > 0) std::memcpy(last, p, left);
  last[7] = static_cast<uint8_t>(len);
  s.absorb(load_le64(last));
  s.v2 ^= 0xff;
  for (int i = 0; i < 4; ++i) s.round();
  return s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
}

}  // namespace mooncake
