// The host reduction (collectives/reduce.h) per element, beside the memory
// floor of the same bytes: `make bench` runs it (build/mooncake_reduce_bench).
// For each dtype and source count: ns per element for a SUM of 4 Mi elements
// (sources and output beyond the caches), and the floor: the bytes read and
// written at this machine's memcpy rate, measured in the same run. Target:
// float16 and bfloat16 at most 1.0 ns per element (each source count).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "collectives/reduce.h"
#include "core/dtype.h"

namespace {

using Clock = std::chrono::steady_clock;

double best_seconds(int reps, const auto& fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main() {
  using mooncake::DType;
  const size_t n = size_t{1} << 22;
  // The memcpy rate: bytes copied per second (each byte read once, written once).
  std::vector<uint8_t> from(n * 4, 1), to(n * 4);
  const double copy_s = best_seconds(5, [&] { std::memcpy(to.data(), from.data(), from.size()); });
  const double copy_rate = static_cast<double>(from.size()) / copy_s;
  std::printf("# memcpy: %.1f GB/s\n", copy_rate / 1e9);
  std::printf(
      "| dtype | sources | ns per element | floor ns | / floor |\n|---|---:|---:|---:|---:|\n");
  constexpr double kHalfTargetNs = 1.0;
  double worst_half_ns = 0;
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const size_t esize = mooncake::dtype_size(dt);
    for (int nsrc : {2, 4}) {
      std::vector<std::vector<uint8_t>> srcs(static_cast<size_t>(nsrc));
      std::vector<const void*> ptrs;
      for (auto& s : srcs) {
        s.assign(n * esize, 0);
        for (size_t i = 0; i < s.size(); i += 2) s[i + 1] = 0x3c;  // 1.0-ish values
        ptrs.push_back(s.data());
      }
      std::vector<uint8_t> out(n * esize);
      const double s = best_seconds(5, [&] {
        mooncake::reduce_arrays(dt, mooncake::RedOp::kSum, out.data(), ptrs.data(), nsrc, n, nsrc);
      });
      // The floor: nsrc inputs read and one output written, at the copy rate
      // (which counts a read and a write per byte: half of it per direction).
      const double floor_s = static_cast<double>((nsrc + 1) * n * esize) / (2 * copy_rate);
      std::printf("| %s | %d | %.2f | %.2f | %.2f |\n", mooncake::dtype_name(dt), nsrc, s / n * 1e9,
                  floor_s / n * 1e9, s / floor_s);
      if (esize == 2) worst_half_ns = std::max(worst_half_ns, s / n * 1e9);
    }
  }
  std::printf("# target: float16/bfloat16 <= %.1f ns per element: %s (worst %.2f)\n", kHalfTargetNs,
              worst_half_ns <= kHalfTargetNs ? "met" : "MISS", worst_half_ns);
  return 0;
}
