#include "collectives/samples.h"

#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "collectives/reference.h"

namespace mctest {

using mooncake::DType;

namespace {

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
void put(uint8_t* out, T v) {
  std::memcpy(out, &v, sizeof(T));
}

template <typename T>
T get(const uint8_t* in) {
  T v;
  std::memcpy(&v, in, sizeof(T));
  return v;
}

bool is_nan(DType t, const uint8_t* e) {
  switch (t) {
    case DType::kFloat16: return std::isnan(ref_half_to_float(get<uint16_t>(e)));
    case DType::kBFloat16: return std::isnan(ref_bf16_to_float(get<uint16_t>(e)));
    case DType::kFloat32: return std::isnan(get<float>(e));
    case DType::kFloat64: return std::isnan(get<double>(e));
    default: return false;
  }
}

}  // namespace

std::vector<uint8_t> sample_input(DType dtype, size_t count, int rank, uint64_t seed,
                                  bool with_nan) {
  const size_t esize = mooncake::dtype_size(dtype);
  std::vector<uint8_t> out(count * esize);
  for (size_t i = 0; i < count; ++i) {
    const uint64_t r = mix(seed * 0x100000001b3ull ^ mix(static_cast<uint64_t>(rank) << 40 ^ i));
    uint8_t* e = out.data() + i * esize;
    // +-[0.5, 2) with a full random mantissa, so that sums round and the
    // order in which sources are combined shows in the result.
    double d = (1.0 + static_cast<double>(r >> 11) / 9007199254740992.0) * ((r & 1) ? 0.5 : 1.0) *
               ((r & 2) ? -1.0 : 1.0);
    if (with_nan && rank == 1 && i % 61 == 7) d = NAN;
    const float f = static_cast<float>(d);
    switch (dtype) {
      case DType::kBool: put<bool>(e, (r >> 7) & 1); break;
      case DType::kUInt8:
      case DType::kInt8: put<uint8_t>(e, static_cast<uint8_t>(r)); break;
      case DType::kInt16:
      case DType::kUInt16: put<uint16_t>(e, static_cast<uint16_t>(r)); break;
      case DType::kInt32:
      case DType::kUInt32: put<uint32_t>(e, static_cast<uint32_t>(r)); break;
      case DType::kInt64:
      case DType::kUInt64: put<uint64_t>(e, r); break;
      case DType::kFloat16: put<uint16_t>(e, ref_float_to_half(f)); break;
      case DType::kBFloat16: put<uint16_t>(e, ref_float_to_bf16(f)); break;
      case DType::kFloat32: put<float>(e, f); break;
      case DType::kFloat64: put<double>(e, d); break;
      default: throw std::logic_error("no such dtype");
    }
  }
  return out;
}

std::vector<uint8_t> garbage(DType dtype, size_t count) {
  return std::vector<uint8_t>(count * mooncake::dtype_size(dtype), 0xA5);
}

std::string format_element(DType dtype, const uint8_t* e) {
  std::ostringstream os;
  switch (dtype) {
    case DType::kBool: os << static_cast<int>(e[0]); break;
    case DType::kUInt8: os << static_cast<int>(get<uint8_t>(e)); break;
    case DType::kInt8: os << static_cast<int>(get<int8_t>(e)); break;
    case DType::kInt16: os << get<int16_t>(e); break;
    case DType::kUInt16: os << get<uint16_t>(e); break;
    case DType::kInt32: os << get<int32_t>(e); break;
    case DType::kUInt32: os << get<uint32_t>(e); break;
    case DType::kInt64: os << get<int64_t>(e); break;
    case DType::kUInt64: os << get<uint64_t>(e); break;
    case DType::kFloat16: os << ref_half_to_float(get<uint16_t>(e)); break;
    case DType::kBFloat16: os << ref_bf16_to_float(get<uint16_t>(e)); break;
    case DType::kFloat32: os << get<float>(e); break;
    case DType::kFloat64: os << get<double>(e); break;
    default: os << "?";
  }
  return os.str();
}

testing::AssertionResult same_elements(DType dtype, const std::vector<uint8_t>& got,
                                       const std::vector<uint8_t>& want) {
  if (got.size() != want.size())
    return testing::AssertionFailure()
           << "sizes differ: " << got.size() << " vs " << want.size() << " bytes";
  const size_t esize = mooncake::dtype_size(dtype);
  const size_t count = got.size() / esize;
  size_t mismatches = 0;
  std::ostringstream first;
  for (size_t i = 0; i < count; ++i) {
    const uint8_t* g = got.data() + i * esize;
    const uint8_t* w = want.data() + i * esize;
    if (std::memcmp(g, w, esize) == 0 || (is_nan(dtype, g) && is_nan(dtype, w))) continue;
    if (++mismatches <= 5)
      first << "\n  [" << i << "] got " << format_element(dtype, g) << ", want "
            << format_element(dtype, w);
  }
  if (mismatches == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure()
         << mismatches << " of " << count << " " << mooncake::dtype_name(dtype)
         << " elements differ" << first.str();
}

}  // namespace mctest
