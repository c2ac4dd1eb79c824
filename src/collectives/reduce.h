// CPU reductions for every dtype and op. Sources are combined in the order
// given (rank order), so every rank that reduces the same inputs gets bit-equal
// results, and float16/bfloat16 accumulate in float32 and are rounded once.
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace mooncake {

// out[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], for i < count.
// `out` may alias srcs[0]. AVG divides the sum by `avg_divisor`.
void reduce_arrays(DType dtype, RedOp op, void* out, const void* const* srcs, int nsrc,
                   size_t count, int avg_divisor);

// float <-> 16-bit float conversions (round to nearest even), exposed for tests.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace mooncake
