// Reference implementations the library is checked against, written
// independently of it: 16-bit float codecs by formula and nearest-value
// search, and a plain element-by-element reduction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace mctest {

// IEEE binary16 and bfloat16: decoding by formula; encoding picks the nearest
// representable value (ties to the even pattern, overflow to infinity, NaN to
// a quiet NaN).
float ref_half_to_float(uint16_t bits);
float ref_bf16_to_float(uint16_t bits);
uint16_t ref_float_to_half(float value);
uint16_t ref_float_to_bf16(float value);

// What every rank of a reduction must produce: sources combined in the order
// given, element by element. Integers wrap around; bool SUM/MAX/BOR are OR,
// PRODUCT/MIN/BAND are AND, BXOR is XOR; a NaN anywhere makes MIN/MAX NaN;
// 16-bit floats accumulate in float32 and are rounded once; AVG is the sum
// divided by `divisor`.
std::vector<uint8_t> reference_reduce(mooncake::DType dtype, mooncake::RedOp op,
                                      const std::vector<const void*>& srcs, size_t count,
                                      int divisor);

// Every (dtype, op) pair the library defines.
struct DtypeOp {
  mooncake::DType dtype;
  mooncake::RedOp op;
};
std::vector<DtypeOp> supported_pairs();
std::vector<mooncake::DType> all_dtypes();
std::vector<mooncake::RedOp> all_ops();

}  // namespace mctest
