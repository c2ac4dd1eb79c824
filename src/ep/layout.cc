#include "ep/layout.h"

#include <algorithm>

#include "core/error.h"

namespace mooncake {

namespace {

// Workspaces past 2^50 bytes are a mistake, not a plan; the bound also keeps
// every product below from overflowing.
constexpr uint64_t kMaxBytes = uint64_t{1} << 50;

size_t align_up(size_t n, size_t a) {
  return (n + a - 1) / a * a;
}

size_t checked_mul(size_t a, size_t b, const char* what) {
  MC_CHECK_ARG(a == 0 || b <= kMaxBytes / a, "get_ep_buffer_size_hint: the ", what,
               " region would exceed 2^50 bytes; the shape is too large");
  return a * b;
}

}  // namespace

EpLayout::EpLayout(const EpShape& s) : shape(s) {
  const char* f = "get_ep_buffer_size_hint";
  MC_CHECK_ARG(s.max_tokens >= 1, f, ": num_max_dispatch_tokens_per_rank must be >= 1, got ",
               s.max_tokens);
  MC_CHECK_ARG(s.hidden >= 1, f, ": hidden must be >= 1, got ", s.hidden);
  MC_CHECK_ARG(s.num_ranks >= 1, f, ": num_ranks must be >= 1, got ", s.num_ranks);
  MC_CHECK_ARG(s.num_experts >= 1, f, ": num_experts must be >= 1, got ", s.num_experts);
  MC_CHECK_ARG(s.num_experts % s.num_ranks == 0, f, ": num_experts (", s.num_experts,
               ") must be divisible by num_ranks (", s.num_ranks, ")");
  MC_CHECK_ARG(s.max_tokens <= (int64_t{1} << 31) && s.hidden <= (int64_t{1} << 31) &&
                   s.num_experts <= (int64_t{1} << 31),
               f, ": sizes must stay below 2^31");
  local_experts = s.num_experts / s.num_ranks;
  const auto T = static_cast<size_t>(s.max_tokens);
  const auto H = static_cast<size_t>(s.hidden);
  const auto E = static_cast<size_t>(s.num_experts);
  const size_t scales = (H + kFp8Block - 1) / kFp8Block;
  bf16_payload_bytes = 2 * H;
  fp8_payload_bytes = H + 4 * scales;
  row_bytes = align_up(std::max(bf16_payload_bytes, fp8_payload_bytes), 16);

  const size_t signals = align_up(2 * E * sizeof(int64_t), kAlign);
  const size_t slots = checked_mul(E, T, "headers");
  const size_t headers = align_up(checked_mul(slots, kHeaderBytes, "headers"), kAlign);
  const size_t rows = align_up(checked_mul(slots, row_bytes, "rows"), kAlign);
  const size_t stage = align_up(checked_mul(T, row_bytes, "stage"), kAlign);
  const size_t index = align_up(
      checked_mul(checked_mul(T, static_cast<size_t>(kMaxTopk), "index"), 8, "index"), kAlign);
  const size_t data = headers + rows + stage + index;
  half_bytes = signals + data;
  MC_CHECK_ARG(half_bytes <= kMaxBytes / 2, f, ": the workspace would exceed 2^50 bytes");
  // Both halves' signals first: their offsets depend on E and R only, so a call
  // of another T or H never reads a signal where an earlier call left data.
  for (int i = 0; i < 2; ++i) {
    const size_t at = 2 * signals + static_cast<size_t>(i) * data;
    halves[i].signals = {static_cast<size_t>(i) * signals, signals};
    halves[i].headers = {at, headers};
    halves[i].rows = {at + headers, rows};
    halves[i].stage = {at + headers + rows, stage};
    halves[i].index = {at + headers + rows + stage, index};
  }
  total_bytes = 2 * half_bytes;
}

}  // namespace mooncake
