// The low-latency EP buffer (device/ep.h) among processes on the GPU: what a
// dispatch delivers (counts, rows in source-rank then token order, their
// bytes) and what a combine sums, against a host model of the routing; then
// a rank that dies before a call, masked by the survivors at their deadline;
// then fencing: a rank its peers fenced stores into nobody (canaries in their
// workspaces), and signals of another fence key are never taken.
// Each test needs a GPU (gpu.h).
#include "device/ep.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "collectives/reduce.h"
#include "device/cuda.h"
#include "gpu.h"
#include "scoped_env.h"

namespace mctest {
namespace {

using mooncake::DeviceArray;
using mooncake::EpBuffer;
using mooncake::EpCall;

constexpr int64_t kT = 24, kH = 128, kK = 3, kEpr = 3;  // experts per rank

// Token t of rank r selects experts (t * 5 + r + 7k) mod E, distinct for k < 3
// while E > 14, and -1 for every fourth token's last column; each channel of
// the token holds a small integer (exact in bf16 after the weights).
int64_t expert(int r, int64_t t, int k, int64_t E) {
  if (k == kK - 1 && t % 4 == 3) return -1;
  return (t * 5 + r + 7 * k) % E;
}
float token(int r, int64_t t) {
  return static_cast<float>((r * 7 + t) % 32 + 1);
}
constexpr float kWeight[kK] = {0.5f, 0.25f, 0.125f};

struct Step {
  std::vector<int32_t> recv_count, src_info;
  std::vector<int64_t> layout_range;
  std::vector<uint16_t> recv_x, out;
};

// One dispatch and combine of `seq` with identity experts, everyone live
// unless `live` says otherwise.
Step step(EpBuffer& ep, int rank, int R, uint64_t seq, std::vector<int32_t>& live,
          int64_t timeout_ns, cudaStream_t stream) {
  const mooncake::EpShape shape{kT, kH, R, kEpr * R};
  mooncake::EpArrays io(shape, kT, kK);
  std::vector<uint16_t> x(kT * kH);
  std::vector<int64_t> topk(kT * kK);
  std::vector<float> w(kT * kK);
  for (int64_t t = 0; t < kT; ++t) {
    for (int64_t h = 0; h < kH; ++h) x[t * kH + h] = mooncake::float_to_bf16(token(rank, t));
    for (int j = 0; j < kK; ++j) {
      topk[t * kK + j] = expert(rank, t, j, shape.num_experts);
      w[t * kK + j] = kWeight[j];
    }
  }
  io.x.put(x);
  io.topk_idx.put(topk);
  io.topk_weights.put(w);
  DeviceArray<int32_t> active(live);
  const EpCall call = EpCall::of(shape, seq, timeout_ns, active.get());
  ep.dispatch(call, io.dispatch_args(), stream);
  ep.combine(call, io.combine_args(io.recv_x.get()), stream);
  mooncake::cuda_check(cudaStreamSynchronize(stream), "EP step");
  ep.raise_reported("EP step");
  live = active.take();
  return Step{io.recv_count.take(), io.src_info.take(), io.layout_range.take(), io.recv_x.take(),
              io.out.take()};
}

// Checks `s` on `rank` against the model, with the ranks `live` says took part.
void check(const Step& s, int rank, int R, const std::vector<int32_t>& live) {
  const int64_t E = kEpr * R, cols = R * kT;
  for (int64_t le = 0; le < kEpr; ++le) {
    const int64_t e = rank * kEpr + le;
    int64_t row = 0;
    for (int src = 0; src < R; ++src) {
      // This expert's rows from src: src's tokens that select it, in token order.
      std::vector<int64_t> tokens;
      for (int64_t t = 0; live[src] && t < kT; ++t)
        for (int j = 0; j < kK; ++j)
          if (expert(src, t, j, E) == e) tokens.push_back(t);
      const int64_t range = s.layout_range[le * R + src];
      ASSERT_EQ(range >> 32, row) << "expert " << e << " from " << src;
      ASSERT_EQ(range & 0xffffffff, static_cast<int64_t>(tokens.size()));
      for (int64_t t : tokens) {
        ASSERT_EQ(s.src_info[le * cols + row], t);
        ASSERT_EQ(mooncake::bf16_to_float(s.recv_x[(le * cols + row) * kH + kH - 1]),
                  token(src, t));
        ++row;
      }
    }
    ASSERT_EQ(s.recv_count[le], row);
  }
  for (int64_t t = 0; t < kT; ++t) {
    float want = 0;
    for (int j = 0; j < kK; ++j) {
      const int64_t e = expert(rank, t, j, E);
      if (e >= 0 && live[e / kEpr]) want += kWeight[j] * token(rank, t);
    }
    ASSERT_EQ(mooncake::bf16_to_float(s.out[t * kH]), want) << "token " << t;
  }
}

// A rank with its EP buffer, connected to the others' through the store.
struct EpRank {
  explicit EpRank(Rank& r) : g(r) {
    const mooncake::EpShape shape{kT, kH, r.size, kEpr * r.size};
    ep = std::make_unique<EpBuffer>(mooncake::EpLayout(shape).total_bytes, g.device);
    r.store.set("card/" + std::to_string(r.rank), ep->card());
    std::vector<std::string> cards;
    for (int p = 0; p < r.size; ++p)
      cards.push_back(r.store.get("card/" + std::to_string(p), 10000));
    const EpBuffer::Connection c = ep->connect(cards, r.rank);
    for (int p = 0; p < r.size; ++p) {
      EXPECT_TRUE(c.present[p]);
      EXPECT_TRUE(c.reachable[p]) << "rank " << p << " is on this host";
    }
  }
  GpuRank g;
  std::unique_ptr<EpBuffer> ep;
};

class EpBufferTest : public ::testing::TestWithParam<int> {};

TEST_P(EpBufferTest, DispatchAndCombineMatchTheModel) {
  MC_REQUIRE_GPU();
  run_ranks(GetParam(),
            [](Rank& r) {
              EpRank e(r);
              // Both halves, then the first again; then the calls whose 24 bits of
              // number are 0 and 1, with the buffer's fence key 0: a tag is never
              // what a cleared signal word reads.
              for (const uint64_t seq : {uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{1} << 24,
                                         (uint64_t{1} << 24) + 1}) {
                std::vector<int32_t> live(static_cast<size_t>(r.size), 1);
                const Step s = step(*e.ep, r.rank, r.size, seq, live, 5'000'000'000, e.g.stream);
                check(s, r.rank, r.size, live);
                EXPECT_TRUE(e.ep->take_masked().empty());
              }
            },
            {60000});
}

INSTANTIATE_TEST_SUITE_P(Worlds, EpBufferTest, ::testing::Values(1, 2, 3));

TEST(EpBuffer, SurvivorsMaskARankThatDiedAtTheirDeadline) {
  MC_REQUIRE_GPU();
  run_ranks(3,
            [](Rank& r) {
              // Nor its life page (the next test): the deadline is what is tested.
              ScopedEnv no_life("MOONCAKE_DEVICE_LIFE_PAGES", "0");
              EpRank e(r);
              std::vector<int32_t> live(3, 1);
              check(step(*e.ep, r.rank, 3, 1, live, 5'000'000'000, e.g.stream), r.rank, 3, live);
              e.g.comm.barrier();
              if (r.rank == 2) exit_rank_abruptly();
              // Nobody told the kernels: they wait out the 200 ms deadline, then mask it.
              live.assign(3, 1);
              const Step s = step(*e.ep, r.rank, 3, 2, live, 200'000'000, e.g.stream);
              EXPECT_EQ(live, (std::vector<int32_t>{1, 1, 0}));
              check(s, r.rank, 3, live);
              using Masked = std::vector<std::pair<int64_t, int32_t>>;
              EXPECT_EQ(e.ep->take_masked(), (Masked{{2, mooncake::kernels::kMaskedSilent}}));
            },
            {60000});
}

// With the group's transport watching for them (watch_lost), the kernels hear of
// a dead peer from the host: a call with a 60 s deadline masks it at once. (Had
// it waited for the deadline, the ranks would run past the test's 30 s limit,
// and the reason would say silent.)
TEST(EpBuffer, SurvivorsMaskALostRankAtOnce) {
  MC_REQUIRE_GPU();
  run_ranks(3,
            [](Rank& r) {
              EpRank e(r);
              watch_lost(e.g.comm.endpoint(), e.ep->lost_words(), 0);
              std::vector<int32_t> live(3, 1);
              check(step(*e.ep, r.rank, 3, 1, live, 5'000'000'000, e.g.stream), r.rank, 3, live);
              e.g.comm.barrier();
              if (r.rank == 2) exit_rank_abruptly();
              live.assign(3, 1);
              const Step s = step(*e.ep, r.rank, 3, 2, live, 60'000'000'000, e.g.stream);
              EXPECT_EQ(live, (std::vector<int32_t>{1, 1, 0}));
              check(s, r.rank, 3, live);
              using Masked = std::vector<std::pair<int64_t, int32_t>>;
              EXPECT_EQ(e.ep->take_masked(), (Masked{{2, mooncake::kernels::kMaskedLost}}));
              // The same rank in the next call: masked again by its first wait on it.
              live.assign(3, 1);
              check(step(*e.ep, r.rank, 3, 3, live, 60'000'000'000, e.g.stream), r.rank, 3,
                    (std::vector<int32_t>{1, 1, 0}));
              EXPECT_EQ(live, (std::vector<int32_t>{1, 1, 0}));
            },
            {30000});
}

// With no host watching (no watch_lost, as on a group without a mooncake
// backend), the kernels still hear of a dead peer at once: they read its
// process's life page (its card's), which the kernel marked as it died. A
// 60 s deadline would run the ranks past the test's 30 s limit, and the
// reason would say silent.
TEST(EpBuffer, SurvivorsMaskADeadRankFromItsLifePage) {
  MC_REQUIRE_GPU();
  run_ranks(3,
            [](Rank& r) {
              EpRank e(r);
              for (int p = 0; p < 3; ++p)
                EXPECT_EQ(e.ep->lost_words()->has_life(p), p != r.rank) << "rank " << p;
              std::vector<int32_t> live(3, 1);
              check(step(*e.ep, r.rank, 3, 1, live, 5'000'000'000, e.g.stream), r.rank, 3, live);
              e.g.comm.barrier();
              if (r.rank == 2) exit_rank_abruptly();
              live.assign(3, 1);
              const auto t0 = std::chrono::steady_clock::now();
              const Step s = step(*e.ep, r.rank, 3, 2, live, 60'000'000'000, e.g.stream);
              EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
              EXPECT_EQ(live, (std::vector<int32_t>{1, 1, 0}));
              check(s, r.rank, 3, live);
              using Masked = std::vector<std::pair<int64_t, int32_t>>;
              EXPECT_EQ(e.ep->take_masked(), (Masked{{2, mooncake::kernels::kMaskedLost}}));
            },
            {30000});
}

// Bytes [offset, offset + n) of this rank's workspace, read back.
std::vector<uint8_t> read_workspace(const EpBuffer& ep, size_t offset, size_t n) {
  std::vector<uint8_t> out(n);
  mooncake::cuda_check(cudaMemcpy(out.data(), ep.workspace() + offset, n, cudaMemcpyDeviceToHost),
                       "reading the workspace");
  return out;
}

// Whether every place of call `seq`'s half where `src` stores into this rank
// (its counts, its headers, the combine flags of its experts) is still zero.
bool untouched_by(const EpBuffer& ep, int R, uint64_t seq, int src) {
  const mooncake::EpLayout l(mooncake::EpShape{kT, kH, R, kEpr * R});
  bool clean = true;
  auto zero = [&](size_t offset, size_t n) {
    for (uint8_t b : read_workspace(ep, offset, n)) clean &= b == 0;
  };
  for (int64_t le = 0; le < kEpr; ++le) {
    zero(l.dispatch_count(seq, le, src), 8);
    zero(l.header(seq, le, src, 0), static_cast<size_t>(kT) * mooncake::EpLayout::kHeaderBytes);
    zero(l.combine_flag(seq, src * kEpr + le), 8);
  }
  return clean;
}

// Whether `fn` throws a kLeftOut Error.
bool left_out_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const mooncake::Error& e) {
    return e.kind() == mooncake::ErrorKind::kLeftOut &&
           std::string(e.what()).find("left out") != std::string::npos;
  }
  return false;
}

// Rank 2's peers fence it, as they do when they leave it out; its next call,
// every rank marked live, stores into neither (their canaries: its places in
// their workspaces stay zero), reports it, and raises kLeftOut, as does every
// later launch. The others' call among themselves is exact.
TEST(EpBuffer, AFencedRankStoresIntoNobody) {
  MC_REQUIRE_GPU();
  run_ranks(
      3,
      [](Rank& r) {
        EpRank e(r);
        std::vector<int32_t> live(3, 1);
        check(step(*e.ep, r.rank, 3, 1, live, 5'000'000'000, e.g.stream), r.rank, 3, live);
        if (r.rank == 0) e.ep->fence_peer(2);
        e.g.comm.barrier();
        if (r.rank == 2) {
          live.assign(3, 1);
          EXPECT_TRUE(left_out_error([&] { step(*e.ep, 2, 3, 2, live, 200'000'000, e.g.stream); }));
          EXPECT_TRUE(e.ep->left_out());
          EXPECT_TRUE(left_out_error([&] { step(*e.ep, 2, 3, 3, live, 200'000'000, e.g.stream); }));
          e.g.comm.barrier();
          return;
        }
        e.g.comm.barrier();  // rank 2's calls are over
        // Call 2's half: no call had used it before rank 2's.
        EXPECT_TRUE(untouched_by(*e.ep, 3, 2, 2));
        live.assign({1, 1, 0});
        const Step s = step(*e.ep, r.rank, 3, 2, live, 5'000'000'000, e.g.stream);
        EXPECT_EQ(live, (std::vector<int32_t>{1, 1, 0}));
        check(s, r.rank, 3, live);
      },
      {60000});
}

// Ranks 0 and 1 expect rank 2's process at fence key 2 (a replacement's); the
// process at rank 2 writes key 1 (the one its slot had before), unfenced:
// nothing it sends is taken. The survivors wait it out and mask it, and their
// rows and sums are exactly those of {0, 1}.
TEST(EpBuffer, SignalsOfAnotherFenceKeyAreNeverTaken) {
  MC_REQUIRE_GPU();
  run_ranks(3,
            [](Rank& r) {
              EpRank e(r);
              std::vector<std::string> cards;
              for (int p = 0; p < 3; ++p)
                cards.push_back(r.store.get("card/" + std::to_string(p), 10000));
              e.ep->connect(cards, r.rank, r.rank == 2 ? 1 : 2);
              e.g.comm.barrier();
              std::vector<int32_t> live(3, 1);
              const Step s = step(*e.ep, r.rank, 3, 1, live, 300'000'000, e.g.stream);
              if (r.rank == 2) {
                EXPECT_EQ(live, (std::vector<int32_t>{0, 0, 1}));
                return;
              }
              EXPECT_EQ(live, (std::vector<int32_t>{1, 1, 0}));
              check(s, r.rank, 3, live);
            },
            {60000});
}

}  // namespace
}  // namespace mctest
