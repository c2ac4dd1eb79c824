// CPU reductions for every dtype and op. Sources are combined in the order
// given (rank order), so every rank that reduces the same inputs gets bit-equal
// results, and float16/bfloat16 accumulate in float32 and are rounded once.
#pragma once

#include <cstddef>

#include "core/dtype.h"
#include "kernels/common/numeric.h"

namespace mooncake {

// out[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], for i < count.
// `out` may alias srcs[0]. AVG divides the sum by `avg_divisor`.
void reduce_arrays(DType dtype, RedOp op, void* out, const void* const* srcs, int nsrc,
                   size_t count, int avg_divisor);

// The float <-> 16-bit float conversions it uses (round to nearest even),
// half_to_float, float_to_half, bf16_to_float and float_to_bf16, come with
// kernels/common/numeric.h, which the CUDA kernel shares (tests use them).

}  // namespace mooncake
