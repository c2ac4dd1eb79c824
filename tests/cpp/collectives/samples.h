// Deterministic test data for collectives: every rank can compute every other
// rank's input, so each checks its result against a locally computed
// reference without any communication.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace mctest {

// `count` elements of `dtype` for (rank, seed). Integers span their whole
// range (so sums and products wrap); floats are +-[0.5, 2) with a full
// random mantissa (so sums round, the combining order shows, and a product
// over 7 ranks stays finite); bools are 0 or 1. With `with_nan`, rank 1 puts
// a NaN in every 61st floating element.
std::vector<uint8_t> sample_input(mooncake::DType dtype, size_t count, int rank, uint64_t seed,
                                  bool with_nan = false);

// `n` bytes from `src` (a p2p message's payload), by seed.
inline std::vector<uint8_t> bytes_for(int src, size_t n, uint64_t seed) {
  return sample_input(mooncake::DType::kUInt8, n, src, seed);
}

// Bytes that no correct result contains by accident, for output buffers.
std::vector<uint8_t> garbage(mooncake::DType dtype, size_t count);

// Element-wise equality: bit-equal, or both NaN. Lists the first mismatches.
testing::AssertionResult same_elements(mooncake::DType dtype, const std::vector<uint8_t>& got,
                                       const std::vector<uint8_t>& want);

// One element, printed as its value.
std::string format_element(mooncake::DType dtype, const uint8_t* element);

// Pointers to each element of a vector of buffers.
template <typename Buffers>
std::vector<const void*> const_pointers(const Buffers& buffers) {
  std::vector<const void*> out;
  for (const auto& b : buffers) out.push_back(b.data());
  return out;
}
template <typename Buffers>
std::vector<void*> pointers(Buffers& buffers) {
  std::vector<void*> out;
  for (auto& b : buffers) out.push_back(b.data());
  return out;
}

}  // namespace mctest
