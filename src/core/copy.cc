#include "core/copy.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace mooncake {

void copy_past_cache(void* to_ptr, const void* from_ptr, size_t len) {
  auto* to = static_cast<uint8_t*>(to_ptr);
  const auto* from = static_cast<const uint8_t*>(from_ptr);
#if defined(__x86_64__)
  // SSE2 is part of x86-64: 16-byte streaming stores from an aligned start.
  const size_t head = std::min(len, (16 - reinterpret_cast<uintptr_t>(to) % 16) % 16);
  std::memcpy(to, from, head);
  to += head;
  from += head;
  len -= head;
  for (; len >= 64; len -= 64, to += 64, from += 64) {
    const __m128i* s = reinterpret_cast<const __m128i*>(from);
    __m128i* d = reinterpret_cast<__m128i*>(to);
    const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
    const __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
  _mm_sfence();
#endif
  std::memcpy(to, from, len);
}

}  // namespace mooncake
