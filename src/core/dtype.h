// Element types and reduction ops, independent of torch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake {

enum class DType : uint8_t {
  kBool,
  kUInt8,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kUInt16,
  kUInt32,
  kUInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
  kCount
};

enum class RedOp : uint8_t { kSum, kProduct, kMin, kMax, kAvg, kBand, kBor, kBxor, kCount };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* redop_name(RedOp op);
bool dtype_is_floating(DType t);

// Whether `op` is defined on `t` (e.g. AVG needs a floating type; the bitwise
// ops need an integer or bool type).
bool redop_supported(RedOp op, DType t);

}  // namespace mooncake
