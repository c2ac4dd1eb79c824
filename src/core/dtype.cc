#include "core/dtype.h"

namespace mooncake {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBool:
    case DType::kUInt8:
    case DType::kInt8: return 1;
    case DType::kInt16:
    case DType::kUInt16:
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kInt32:
    case DType::kUInt32:
    case DType::kFloat32: return 4;
    case DType::kInt64:
    case DType::kUInt64:
    case DType::kFloat64: return 8;
    default: return 0;
  }
}

const char* dtype_name(DType t) {
  static const char* names[] = {"bool",     "uint8",   "int8",   "int16",  "int32",
                                "int64",    "uint16",  "uint32", "uint64", "float16",
                                "bfloat16", "float32", "float64"};
  auto i = static_cast<size_t>(t);
  return i < sizeof(names) / sizeof(names[0]) ? names[i] : "unknown";
}

const char* redop_name(RedOp op) {
  static const char* names[] = {"SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"};
  auto i = static_cast<size_t>(op);
  return i < sizeof(names) / sizeof(names[0]) ? names[i] : "unknown";
}

bool dtype_is_floating(DType t) {
  return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32 ||
         t == DType::kFloat64;
}

bool redop_supported(RedOp op, DType t) {
  if (static_cast<size_t>(t) >= static_cast<size_t>(DType::kCount)) return false;
  switch (op) {
    case RedOp::kSum:
    case RedOp::kProduct:
    case RedOp::kMin:
    case RedOp::kMax: return true;
    case RedOp::kAvg: return dtype_is_floating(t);
    case RedOp::kBand:
    case RedOp::kBor:
    case RedOp::kBxor: return !dtype_is_floating(t);
    default: return false;
  }
}

}  // namespace mooncake
