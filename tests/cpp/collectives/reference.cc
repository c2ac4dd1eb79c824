#include "collectives/reference.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>

namespace mctest {

using mooncake::DType;
using mooncake::RedOp;

namespace {

// A binary floating-point format with `exp_bits` exponent and `man_bits`
// mantissa bits in a 16-bit pattern.
struct Format16 {
  int exp_bits;
  int man_bits;

  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  uint16_t exp_mask() const { return static_cast<uint16_t>(((1 << exp_bits) - 1) << man_bits); }
  uint16_t inf_bits() const { return exp_mask(); }
  uint16_t quiet_nan_bits() const {
    return static_cast<uint16_t>(exp_mask() | (1 << (man_bits - 1)));
  }

  // The value of a pattern; the pattern after the largest finite one (the
  // infinity pattern) counts as 2^(emax+1), which is where rounding overflows.
  double magnitude(uint16_t bits) const {
    const int e = (bits & exp_mask()) >> man_bits;
    const int m = bits & ((1 << man_bits) - 1);
    if (e == 0) return std::ldexp(static_cast<double>(m), 1 - bias() - man_bits);
    return std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -man_bits), e - bias());
  }

  double decode(uint16_t bits) const {
    const double sign = (bits & 0x8000) ? -1.0 : 1.0;
    if ((bits & exp_mask()) == exp_mask())
      return (bits & ((1 << man_bits) - 1)) ? std::numeric_limits<double>::quiet_NaN()
                                            : sign * std::numeric_limits<double>::infinity();
    return sign * magnitude(bits & 0x7fff);
  }

  uint16_t encode(float value) const {
    if (std::isnan(value)) return quiet_nan_bits();
    const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(value));
    if (std::isinf(a)) return sign | inf_bits();
    // The largest pattern whose magnitude is <= a (patterns are monotone).
    uint16_t lo = 0, hi = inf_bits();
    while (hi - lo > 1) {
      uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
      (magnitude(mid) <= a ? lo : hi) = mid;
    }
    if (magnitude(lo) == a) return sign | lo;
    const double below = a - magnitude(lo), above = magnitude(hi) - a;
    const uint16_t nearest = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
    return sign | nearest;
  }
};

constexpr Format16 kHalf{5, 10};
constexpr Format16 kBFloat16{8, 7};

template <typename T>
T load(const void* p, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const uint8_t*>(p) + i * sizeof(T), sizeof(T));
  return v;
}

template <typename T>
void store(std::vector<uint8_t>& out, size_t i, T v) {
  std::memcpy(out.data() + i * sizeof(T), &v, sizeof(T));
}

bool bool_combine(RedOp op, bool a, bool b) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kMax:
    case RedOp::kBor: return a || b;
    case RedOp::kProduct:
    case RedOp::kMin:
    case RedOp::kBand: return a && b;
    case RedOp::kBxor: return a != b;
    default: throw std::logic_error("no such bool op");
  }
}

// Integers, in 64-bit two's complement arithmetic truncated at the end
// (which is arithmetic modulo 2^bits).
template <typename T>
T int_combine(RedOp op, T a, T b) {
  const uint64_t ua = static_cast<uint64_t>(a), ub = static_cast<uint64_t>(b);
  switch (op) {
    case RedOp::kSum: return static_cast<T>(ua + ub);
    case RedOp::kProduct: return static_cast<T>(ua * ub);
    case RedOp::kMin: return b < a ? b : a;
    case RedOp::kMax: return a < b ? b : a;
    case RedOp::kBand: return static_cast<T>(ua & ub);
    case RedOp::kBor: return static_cast<T>(ua | ub);
    case RedOp::kBxor: return static_cast<T>(ua ^ ub);
    default: throw std::logic_error("no such integer op");
  }
}

template <typename F>
F float_combine(RedOp op, F a, F b) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: return a + b;
    case RedOp::kProduct: return a * b;
    case RedOp::kMin:
      if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<F>::quiet_NaN();
      return b < a ? b : a;
    case RedOp::kMax:
      if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<F>::quiet_NaN();
      return a < b ? b : a;
    default: throw std::logic_error("no such floating op");
  }
}

template <typename T>
std::vector<uint8_t> reduce_plain(RedOp op, const std::vector<const void*>& srcs, size_t count,
                                  int divisor) {
  std::vector<uint8_t> out(count * sizeof(T));
  for (size_t i = 0; i < count; ++i) {
    T acc = load<T>(srcs[0], i);
    for (size_t s = 1; s < srcs.size(); ++s) {
      T v = load<T>(srcs[s], i);
      if constexpr (std::is_same_v<T, bool>)
        acc = bool_combine(op, acc, v);
      else if constexpr (std::is_floating_point_v<T>)
        acc = float_combine(op, acc, v);
      else
        acc = int_combine(op, acc, v);
    }
    if constexpr (std::is_floating_point_v<T>)
      if (op == RedOp::kAvg) acc = acc / static_cast<T>(divisor);
    store(out, i, acc);
  }
  return out;
}

std::vector<uint8_t> reduce_16bit(const Format16& f, RedOp op, const std::vector<const void*>& srcs,
                                  size_t count, int divisor) {
  std::vector<uint8_t> out(count * 2);
  for (size_t i = 0; i < count; ++i) {
    float acc = static_cast<float>(f.decode(load<uint16_t>(srcs[0], i)));
    for (size_t s = 1; s < srcs.size(); ++s)
      acc = float_combine(op, acc, static_cast<float>(f.decode(load<uint16_t>(srcs[s], i))));
    if (op == RedOp::kAvg) acc = acc / static_cast<float>(divisor);
    store(out, i, f.encode(acc));
  }
  return out;
}

}  // namespace

float ref_half_to_float(uint16_t bits) {
  return static_cast<float>(kHalf.decode(bits));
}
float ref_bf16_to_float(uint16_t bits) {
  return static_cast<float>(kBFloat16.decode(bits));
}
uint16_t ref_float_to_half(float value) {
  return kHalf.encode(value);
}
uint16_t ref_float_to_bf16(float value) {
  return kBFloat16.encode(value);
}

std::vector<uint8_t> reference_reduce(DType dtype, RedOp op, const std::vector<const void*>& srcs,
                                      size_t count, int divisor) {
  switch (dtype) {
    case DType::kBool: return reduce_plain<bool>(op, srcs, count, divisor);
    case DType::kUInt8: return reduce_plain<uint8_t>(op, srcs, count, divisor);
    case DType::kInt8: return reduce_plain<int8_t>(op, srcs, count, divisor);
    case DType::kInt16: return reduce_plain<int16_t>(op, srcs, count, divisor);
    case DType::kInt32: return reduce_plain<int32_t>(op, srcs, count, divisor);
    case DType::kInt64: return reduce_plain<int64_t>(op, srcs, count, divisor);
    case DType::kUInt16: return reduce_plain<uint16_t>(op, srcs, count, divisor);
    case DType::kUInt32: return reduce_plain<uint32_t>(op, srcs, count, divisor);
    case DType::kUInt64: return reduce_plain<uint64_t>(op, srcs, count, divisor);
    case DType::kFloat16: return reduce_16bit(kHalf, op, srcs, count, divisor);
    case DType::kBFloat16: return reduce_16bit(kBFloat16, op, srcs, count, divisor);
    case DType::kFloat32: return reduce_plain<float>(op, srcs, count, divisor);
    case DType::kFloat64: return reduce_plain<double>(op, srcs, count, divisor);
    default: throw std::logic_error("no such dtype");
  }
}

std::vector<DType> all_dtypes() {
  std::vector<DType> out;
  for (int t = 0; t < static_cast<int>(DType::kCount); ++t) out.push_back(static_cast<DType>(t));
  return out;
}

std::vector<RedOp> all_ops() {
  std::vector<RedOp> out;
  for (int op = 0; op < static_cast<int>(RedOp::kCount); ++op)
    out.push_back(static_cast<RedOp>(op));
  return out;
}

std::vector<DtypeOp> supported_pairs() {
  // The rule, stated here rather than read from the library: AVG needs a
  // floating type, the bitwise ops an integer or bool type.
  std::vector<DtypeOp> out;
  for (DType t : all_dtypes()) {
    const bool floating = t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32 ||
                          t == DType::kFloat64;
    for (RedOp op : all_ops()) {
      const bool bitwise = op == RedOp::kBand || op == RedOp::kBor || op == RedOp::kBxor;
      if ((op == RedOp::kAvg && !floating) || (bitwise && floating)) continue;
      out.push_back({t, op});
    }
  }
  return out;
}

}  // namespace mctest
