// One step of a reduction: the arithmetic that the host's reduce_arrays
// (reduce.h) and the CUDA backend's kernel (kernels/reduce.cu) share, so that
// both paths give bit-identical results.
#pragma once

#include <type_traits>

#include "core/dtype.h"
#include "core/hd.h"

namespace mooncake {

// `a` op `b` on accumulators. The op is a template argument so that loops
// over elements have no branch per element. Floating MIN and MAX propagate
// NaN (b != b only for NaN: no -ffast-math here); integers wrap around, as
// torch's do.
template <RedOp Op, typename A>
MC_HD inline A combine(A a, A b) {
  if constexpr (std::is_same_v<A, bool>) {
    if constexpr (Op == RedOp::kSum || Op == RedOp::kMax || Op == RedOp::kBor) return a || b;
    if constexpr (Op == RedOp::kProduct || Op == RedOp::kMin || Op == RedOp::kBand) return a && b;
    if constexpr (Op == RedOp::kBxor) return a != b;
    return a;
  } else if constexpr (std::is_floating_point_v<A>) {
    if constexpr (Op == RedOp::kSum || Op == RedOp::kAvg) return a + b;
    if constexpr (Op == RedOp::kProduct) return a * b;
    if constexpr (Op == RedOp::kMin) return (b != b || b < a) ? b : a;
    if constexpr (Op == RedOp::kMax) return (b != b || b > a) ? b : a;
    return a;
  } else {
    // In an unsigned type at least as wide as int, so that narrow types are
    // not promoted to (signed) int.
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    if constexpr (Op == RedOp::kSum) return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
    if constexpr (Op == RedOp::kProduct)
      return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
    if constexpr (Op == RedOp::kMin) return b < a ? b : a;
    if constexpr (Op == RedOp::kMax) return b > a ? b : a;
    if constexpr (Op == RedOp::kBand) return a & b;
    if constexpr (Op == RedOp::kBor) return a | b;
    if constexpr (Op == RedOp::kBxor) return a ^ b;
    return a;
  }
}

}  // namespace mooncake
