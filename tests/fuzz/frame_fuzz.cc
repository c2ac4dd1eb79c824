// libFuzzer target: the bytes of one tcp connection, as a peer or a stranger
// could send them, fed to FrameDecoder (src/transport/tcp_wire.h).
//
// Input: one byte of options, then the stream. Option bit 0: accept the
// hello (a member) or not (the receiver drops a stale incarnation); the other
// bits seed how the stream is cut into recv() pieces. Checks, beyond
// ASan/UBSan's:
//  * a payload lands only inside the segment (the segment is heap memory
//    with red zones on both sides, so ASan sees any byte outside it);
//  * nothing is written before a hello with the right secret is accepted;
//  * the decoder ends in the same state, with the same segment, however the
//    stream is cut (one byte at a time, at random, or whole).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "transport/segment.h"
#include "transport/tcp_wire.h"

namespace {

using mooncake::FrameDecoder;

constexpr size_t kBytes = 4096;
constexpr int kCapacity = 8;
constexpr char kSecret[] = "0123456789abcdef0123456789abcdef";  // see the corpus

// The segment before any frame: a zeroed header (as a new segment has), then
// a pattern.
const std::vector<uint8_t>& initial() {
  static const std::vector<uint8_t> image = [] {
    std::vector<uint8_t> v(kBytes, 0xA5);
    std::fill_n(v.begin(), mooncake::kSegmentHeaderBytes, 0);
    return v;
  }();
  return image;
}

struct Outcome {
  std::vector<uint8_t> segment;
  bool broken = false;
  bool accepted = false;
  uint64_t frames = 0;
};

// Feeds `data` in pieces: the next piece is at most `piece(i)` bytes.
template <typename Piece>
Outcome feed(const uint8_t* data, size_t size, bool accept, Piece piece) {
  Outcome out;
  out.segment = initial();
  // The receiver is rank 0, incarnation 0: whom the corpus's hellos address.
  FrameDecoder decoder(out.segment.data(), kBytes, kCapacity, {kSecret, sizeof(kSecret) - 1}, 0, 0);
  size_t at = 0;
  for (int i = 0; at < size && !out.broken; ++i) {
    const std::span<uint8_t> into = decoder.next();
    if (into.empty()) abort();  // only a broken decoder offers no room
    const size_t n = std::min({into.size(), size - at, piece(i)});
    std::memcpy(into.data(), data + at, n);
    at += n;
    switch (decoder.advance(n)) {
      case FrameDecoder::Step::kMore: break;
      case FrameDecoder::Step::kFrame: ++out.frames; break;
      case FrameDecoder::Step::kHello:
        if (!accept) return out;  // the receiver drops the connection
        decoder.accept();
        out.accepted = true;
        break;
      case FrameDecoder::Step::kBroken:
        if (decoder.why().empty()) abort();  // a broken stream always says why
        out.broken = true;
        break;
    }
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t options = data[0];
  const bool accept = options & 1;
  ++data;
  --size;
  uint32_t rng = options | 1u;
  const Outcome whole = feed(data, size, accept, [](int) { return SIZE_MAX; });
  const Outcome bytes = feed(data, size, accept, [](int) { return size_t{1}; });
  const Outcome random = feed(data, size, accept, [&](int) {
    rng = rng * 1103515245u + 12345u;
    return size_t{1} + (rng >> 16) % 40;
  });
  for (const Outcome* o : {&bytes, &random})
    if (o->segment != whole.segment || o->broken != whole.broken || o->accepted != whole.accepted ||
        o->frames != whole.frames)
      abort();  // the outcome depends on how the stream was cut
  if (!whole.accepted && whole.segment != initial()) abort();  // a stranger changed the segment
  return 0;
}
