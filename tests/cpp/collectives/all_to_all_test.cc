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
      // Ranks 0 and 1 take several steps, the others one: all must still end
      // the op with the same rounds (the next pattern's op checks).
      {"one edge of several chunks",
       [](int src, int dst) { return src == 0 && dst == 1 ? size_t{200} : size_t{2}; }},
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

// An exchange of one step ends with the round of verdicts on the split sizes,
// which is also its commit round: two rounds of messages in all, not three.
// One of several steps still commits after its last step.
TEST_P(AllToAll, OneStepExchangeCommitsWithItsRoundOfVerdicts) {
  run([](Communicator& comm, Rank& r) {
    const size_t chunk_floats = comm.collective_channels().layout().chunk_bytes / sizeof(float);
    const uint64_t peers = static_cast<uint64_t>(r.size - 1);
    for (size_t count : {size_t{1}, chunk_floats, 3 * chunk_floats}) {
      std::vector<std::vector<float>> ins(r.size, std::vector<float>(count, 1.0f));
      std::vector<std::vector<float>> outs(r.size, std::vector<float>(count, 0.0f));
      std::vector<const void*> in_ptrs;
      std::vector<void*> out_ptrs;
      for (int p = 0; p < r.size; ++p) {
        in_ptrs.push_back(ins[p].data());
        out_ptrs.push_back(outs[p].data());
      }
      const std::vector<size_t> counts(r.size, count);
      const uint64_t before = comm.collective_channels().messages_sent();
      comm.all_to_all(in_ptrs.data(), counts.data(), out_ptrs.data(), counts.data(),
                      DType::kFloat32);
      const uint64_t steps = (count + chunk_floats - 1) / chunk_floats;
      const uint64_t want = steps == 1 ? 2 * peers : (steps + 2) * peers;
      EXPECT_EQ(comm.collective_channels().messages_sent() - before, want)
          << count << " floats, " << steps << " steps";
      for (int p = 0; p < r.size; ++p) EXPECT_EQ(outs[p], ins[p]) << "from rank " << p;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, AllToAll, testing::ValuesIn(every_world_size()), group_param_name);

}  // namespace
}  // namespace mctest
