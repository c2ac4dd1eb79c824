// Uneven all_to_all over N processes: slice p of every rank's output is what
// rank p sent it, for split patterns with zeros, ones, and splits larger than
// a chunk.
#include <gtest/gtest.h>

#include <functional>

#include "collectives/group.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;

// Elements rank `src` sends to rank `dst`.
using Splits = std::function<size_t(int src, int dst)>;

struct Pattern {
  const char* name;
  Splits splits;
};

const std::vector<Pattern>& patterns() {
  static const std::vector<Pattern> p = {
      {"all zero", [](int, int) { return size_t{0}; }},
      {"all one", [](int, int) { return size_t{1}; }},
      {"only rank 0 sends", [](int src, int) { return src == 0 ? size_t{5} : size_t{0}; }},
      {"nothing to self", [](int src, int dst) { return src == dst ? size_t{0} : size_t{3}; }},
      {"uneven with zeros, up to several chunks",
       [](int src, int dst) {
         const size_t v = static_cast<size_t>((src * 7 + dst * 13 + 5) % 11);
         return v % 3 == 0 ? size_t{0} : v * 37;  // 0 or up to 370 (> 64 floats per chunk)
       }},
  };
  return p;
}

// What rank `src` sends rank `dst`.
std::vector<uint8_t> payload(DType t, const Splits& splits, int src, int dst, uint64_t seed) {
  return sample_input(t, splits(src, dst), src, seed * 64 + static_cast<uint64_t>(dst));
}

class AllToAll : public GroupTest {};

TEST_P(AllToAll, SliceFromEveryRankIsWhatThatRankSent) {
  run([](Communicator& comm, Rank& r) {
    uint64_t seed = 500;
    for (DType t : {DType::kFloat32, DType::kUInt8, DType::kFloat64}) {
      for (const Pattern& pattern : patterns()) {
        ++seed;
        std::vector<std::vector<uint8_t>> ins, outs;
        std::vector<size_t> in_counts, out_counts;
        for (int p = 0; p < r.size; ++p) {
          ins.push_back(payload(t, pattern.splits, r.rank, p, seed));
          in_counts.push_back(pattern.splits(r.rank, p));
          out_counts.push_back(pattern.splits(p, r.rank));
          outs.push_back(garbage(t, out_counts.back()));
        }
        comm.all_to_all(const_pointers(ins).data(), in_counts.data(), pointers(outs).data(),
                        out_counts.data(), t);
        for (int p = 0; p < r.size; ++p)
          EXPECT_TRUE(same_elements(t, outs[p], payload(t, pattern.splits, p, r.rank, seed)))
              << mooncake::dtype_name(t) << " pattern '" << pattern.name << "' from rank " << p;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, AllToAll, testing::ValuesIn(every_world_size()), group_param_name);

}  // namespace
}  // namespace mctest
