#include "collectives/reduce.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "collectives/combine.h"
#include "core/error.h"

namespace mooncake {

float half_to_float(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

uint16_t float_to_half(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

namespace {

constexpr size_t kBlock = 2048;

struct Half {
  uint16_t bits;
};
struct BFloat {
  uint16_t bits;
};

// How an element type is loaded into and stored from its accumulator type.
template <typename T>
struct Acc {
  using type = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
};
template <>
struct Acc<Half> {
  using type = float;
  static float load(Half v) { return half_to_float(v.bits); }
  static Half store(float v) { return Half{float_to_half(v)}; }
};
template <>
struct Acc<BFloat> {
  using type = float;
  static float load(BFloat v) { return bf16_to_float(v.bits); }
  static BFloat store(float v) { return BFloat{float_to_bf16(v)}; }
};

template <typename T, RedOp Op>
void reduce_typed_op(void* out_v, const void* const* srcs_v, int nsrc, size_t count,
                     int avg_divisor) {
  using A = typename Acc<T>::type;
  T* out = static_cast<T*>(out_v);
  A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = count - base < kBlock ? count - base : kBlock;
    const T* s0 = static_cast<const T*>(srcs_v[0]) + base;
    for (size_t i = 0; i < n; ++i) acc[i] = Acc<T>::load(s0[i]);
    for (int s = 1; s < nsrc; ++s) {
      const T* src = static_cast<const T*>(srcs_v[s]) + base;
      for (size_t i = 0; i < n; ++i) acc[i] = combine<Op, A>(acc[i], Acc<T>::load(src[i]));
    }
    if constexpr (std::is_floating_point_v<A> && Op == RedOp::kAvg)
      for (size_t i = 0; i < n; ++i) acc[i] = acc[i] / static_cast<A>(avg_divisor);
    for (size_t i = 0; i < n; ++i) out[base + i] = Acc<T>::store(acc[i]);
  }
}

template <typename T>
void reduce_typed(RedOp op, void* out, const void* const* srcs, int nsrc, size_t count,
                  int avg_divisor) {
  switch (op) {
    case RedOp::kSum: return reduce_typed_op<T, RedOp::kSum>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kProduct:
      return reduce_typed_op<T, RedOp::kProduct>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kMin: return reduce_typed_op<T, RedOp::kMin>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kMax: return reduce_typed_op<T, RedOp::kMax>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kAvg: return reduce_typed_op<T, RedOp::kAvg>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kBand: return reduce_typed_op<T, RedOp::kBand>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kBor: return reduce_typed_op<T, RedOp::kBor>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kBxor: return reduce_typed_op<T, RedOp::kBxor>(out, srcs, nsrc, count, avg_divisor);
    default: MC_ASSERT(false, "unknown reduce op");
  }
}

}  // namespace

void reduce_arrays(DType dtype, RedOp op, void* out, const void* const* srcs, int nsrc,
                   size_t count, int avg_divisor) {
  MC_CHECK_ARG(redop_supported(op, dtype), "reduce op ", redop_name(op),
               " is not supported for dtype ", dtype_name(dtype));
  MC_ASSERT(nsrc >= 1);
  if (count == 0) return;
  switch (dtype) {
    case DType::kBool: return reduce_typed<bool>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kUInt8: return reduce_typed<uint8_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kInt8: return reduce_typed<int8_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kInt16: return reduce_typed<int16_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kInt32: return reduce_typed<int32_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kInt64: return reduce_typed<int64_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kUInt16: return reduce_typed<uint16_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kUInt32: return reduce_typed<uint32_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kUInt64: return reduce_typed<uint64_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kFloat16: return reduce_typed<Half>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kBFloat16: return reduce_typed<BFloat>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kFloat32: return reduce_typed<float>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kFloat64: return reduce_typed<double>(op, out, srcs, nsrc, count, avg_divisor);
    default: MC_ASSERT(false, "unknown dtype");
  }
}

}  // namespace mooncake
