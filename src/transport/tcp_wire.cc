#include "transport/tcp_wire.h"

#include <cstring>

#include "core/error.h"
#include "transport/segment.h"

namespace mooncake {

FrameDecoder::FrameDecoder(uint8_t* base, size_t size, int capacity, std::string_view secret,
                           int rank, uint32_t incarnation)
    : base_(base),
      size_(size),
      capacity_(capacity),
      secret_(secret),
      rank_(rank),
      incarnation_(incarnation) {
  check_secret(secret, "tcp");
  MC_ASSERT(size >= kSegmentHeaderBytes && capacity >= 1);
}

std::span<uint8_t> FrameDecoder::next() {
  switch (part_) {
    case Part::kHeader: return {reinterpret_cast<uint8_t*>(&frame_) + got_, sizeof(Frame) - got_};
    case Part::kSecret:
      return {reinterpret_cast<uint8_t*>(secret_got_) + got_, kSecretBytes - got_};
    case Part::kPayload: return {base_ + frame_.offset + got_, frame_.arg - got_};
    case Part::kBroken: break;
  }
  return {};
}

FrameDecoder::Step FrameDecoder::advance(size_t n) {
  MC_ASSERT(n >= 1 && n <= next().size(), "advance(", n, ") past what next() offered");
  got_ += n;
  switch (part_) {
    case Part::kHeader:
      if (got_ < sizeof(Frame)) return Step::kMore;
      got_ = 0;
      return on_frame();
    case Part::kSecret:
      if (got_ < kSecretBytes) return Step::kMore;
      got_ = 0;
      part_ = Part::kHeader;
      if (!secret_matches(secret_got_, secret_))
        return broken("its hello carries the wrong secret (another group, or not a peer)");
      return Step::kHello;
    case Part::kPayload:
      if (got_ == frame_.arg) {
        got_ = 0;
        part_ = Part::kHeader;
      }
      return Step::kMore;
    case Part::kBroken: break;
  }
  return Step::kBroken;
}

void FrameDecoder::accept() {
  MC_ASSERT(hello_rank_ >= 0 && !accepted_ && part_ == Part::kHeader);
  accepted_ = true;
}

FrameDecoder::Step FrameDecoder::broken(std::string why) {
  why_ = std::move(why);
  part_ = Part::kBroken;
  return Step::kBroken;
}

FrameDecoder::Step FrameDecoder::on_frame() {
  const Frame& f = frame_;
  if (f.type == kHello) {
    if (hello_rank_ >= 0) return broken("it sent a second hello");
    const uint64_t rank = f.arg & UINT32_MAX, inc = f.offset & UINT32_MAX;
    const uint64_t to_rank = f.arg >> 32, to_inc = f.offset >> 32;
    if (rank >= static_cast<uint64_t>(capacity_) || inc == UINT32_MAX || f.bell != kSecretBytes)
      return broken(str("its hello is malformed (rank ", rank, " of ", capacity_, ", incarnation ",
                        inc, ", secret of ", f.bell, " bytes)"));
    if (to_rank != static_cast<uint64_t>(rank_) || to_inc != incarnation_)
      return broken(str("its hello is for rank ", to_rank, " incarnation ", to_inc, ", not rank ",
                        rank_, " incarnation ", incarnation_,
                        " (the address it dialled is out of date)"));
    hello_rank_ = static_cast<int>(rank);
    hello_inc_ = static_cast<uint32_t>(inc);
    part_ = Part::kSecret;
    return Step::kMore;
  }
  if (!accepted_) return broken(str("it sent a frame of type ", f.type, " before its hello"));
  switch (f.type) {
    case kHeartbeat: return Step::kFrame;
    case kBye: bye_ = true; return Step::kFrame;
    case kSignal:
    case kSignalMax:
      if (f.offset > size_ - 8 || f.offset % 8 != 0 || f.bell >= static_cast<uint32_t>(kNumBells))
        return broken(str("it signals a flag outside the segment (offset ", f.offset, " of ", size_,
                          ", bell ", f.bell, ")"));
      if (f.type == kSignalMax)
        store_flag_max(base_, f.offset, f.arg);
      else
        store_flag(base_, f.offset, f.arg);
      ring(&reinterpret_cast<SegmentHeader*>(base_)->bells[f.bell]);
      return Step::kFrame;
    case kWrite:
      if (f.offset > size_ || f.arg > size_ - f.offset)
        return broken(str("it writes ", f.arg, " bytes at offset ", f.offset, ", outside the ",
                          size_, "-byte segment"));
      if (f.arg > 0) part_ = Part::kPayload;
      return Step::kFrame;
    default: return broken(str("it sent a frame of unknown type ", f.type));
  }
}

}  // namespace mooncake
