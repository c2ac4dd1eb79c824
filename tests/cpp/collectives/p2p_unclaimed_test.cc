// P2P memory for messages no receive has claimed yet is capped per source
// (MOONCAKE_P2P_UNCLAIMED_BYTES): at the cap the receiver stops taking that
// source's messages, so its sends wait, and fail at their deadline if no
// receive comes; other sources go on; a receive that comes later gets every
// message whole and in order; a message larger than the cap whose receive
// comes while it arrives completes; a message whose sender gave up half way
// is dropped and fails the receive that had taken it; what a dead source left
// behind the cap is still received.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "collectives/p2p_group.h"
#include "collectives/samples.h"
#include "core/clock.h"
#include "errors.h"
#include "scoped_env.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::ErrorKind;
using mooncake::P2P;
using mooncake::Request;

constexpr uint64_t kCap = 64 << 10;
constexpr size_t kChunk = 4096;
constexpr size_t kMessage = 32 << 10;  // 8 chunks; two of them reach the cap
// What the receiver may keep for one source: it takes a chunk only below the cap.
constexpr uint64_t kBound = kCap + kChunk + P2P::kMessageOverheadBytes;

GroupOptions small_chunks(bool tcp) {
  GroupOptions o;
  o.tcp = tcp;
  o.chunk_bytes = kChunk;
  return o;
}

// The receiver's count of what `src` has kept unclaimed, sampled; remembers the largest.
struct Held {
  P2P& p2p;
  int src;
  uint64_t max = 0;
  uint64_t sample() {
    const uint64_t now = p2p.unclaimed_bytes(src);
    max = std::max(max, now);
    return now;
  }
  // Polls until `src` is at the cap; false after kP2PWaitMs.
  bool reaches_cap() {
    const int64_t until = mooncake::now_us() + kP2PWaitMs * 1000;
    while (sample() < kCap) {
      if (mooncake::now_us() > until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }
  // A few samples over ~100 ms: the source stays held back.
  void stays_bounded() {
    for (int i = 0; i < 10; ++i) {
      sample();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_LE(max, kBound) << "bytes kept for rank " << src << " past the cap";
  }
};

TEST(P2PUnclaimed, TheSourceIsHeldAtTheCapUntilTheReceivesComeThenAllArriveInOrder) {
  ScopedEnv cap("MOONCAKE_P2P_UNCLAIMED_BYTES", std::to_string(kCap));
  for (bool tcp : {false, true}) {
    run_p2p(2, small_chunks(tcp), [](P2P& p2p, Communicator&, Rank& r) {
      constexpr uint64_t kCount = 16, kTag = 7;
      if (r.rank == 0) {
        std::vector<std::vector<uint8_t>> out;
        std::vector<std::shared_ptr<Request>> sends;
        out.reserve(kCount);
        for (uint64_t i = 0; i < kCount; ++i) {
          out.push_back(bytes_for(0, kMessage, i));
          sends.push_back(p2p.send(out.back().data(), kMessage, 1, kTag));
        }
        for (uint64_t i = 0; i < kCount; ++i) expect_ok(sends[i], "send " + std::to_string(i));
        return;
      }
      Held held{p2p, 0};
      ASSERT_TRUE(held.reaches_cap()) << "the sender's messages never reached the cap";
      held.stays_bounded();
      std::vector<std::vector<uint8_t>> in(kCount, std::vector<uint8_t>(kMessage));
      std::vector<std::shared_ptr<Request>> recvs;
      for (uint64_t i = 0; i < kCount; ++i)
        recvs.push_back(p2p.recv(in[i].data(), kMessage, 0, kTag));
      for (uint64_t i = 0; i < kCount; ++i) {
        expect_ok(recvs[i], "recv " + std::to_string(i));
        EXPECT_EQ(in[i], bytes_for(0, kMessage, i)) << "message " << i;
      }
      EXPECT_EQ(p2p.unclaimed_bytes(0), 0u);
    });
  }
}

TEST(P2PUnclaimed, SendsToARankThatDoesNotReceiveTimeOutAndOtherSourcesGoOn) {
  ScopedEnv cap("MOONCAKE_P2P_UNCLAIMED_BYTES", std::to_string(kCap));
  for (bool tcp : {false, true}) {
    run_p2p(3, small_chunks(tcp), [](P2P& p2p, Communicator&, Rank& r) {
      constexpr uint64_t kSends = 4, kFlood = 1, kOther = 2, kLater = 3, kAfter = 4;
      constexpr int64_t kSendTimeoutMs = 400;
      const auto small = message(r.rank, kOther, 100);
      if (r.rank == 0) {
        std::vector<std::vector<uint8_t>> out;
        std::vector<std::shared_ptr<Request>> sends;
        out.reserve(kSends);
        const int64_t start = mooncake::now_us();
        for (uint64_t i = 0; i < kSends; ++i) {
          out.push_back(bytes_for(0, kMessage, i));
          sends.push_back(p2p.send(out.back().data(), kMessage, 1, kFlood, kSendTimeoutMs));
        }
        // Those that fit under the cap go through; the rest time out, in order.
        uint64_t delivered = 0;
        for (uint64_t i = 0; i < kSends; ++i) {
          ASSERT_TRUE(sends[i]->wait(kP2PWaitMs)) << "send " << i << " hangs";
          if (!sends[i]->error() && delivered == i) {
            ++delivered;
            continue;
          }
          EXPECT_TRUE(throws_error(ErrorKind::kTimeout, rethrow_error_of(sends[i])))
              << "send " << i << " after " << delivered << " delivered";
        }
        EXPECT_GE(delivered, 1u);
        EXPECT_LT(delivered, kSends) << "no send was held back";
        EXPECT_LT((mooncake::now_us() - start) / 1000, kSendTimeoutMs * kSends + 2000);
        r.store.set("delivered", std::to_string(delivered));
        // The sender's other traffic goes on: to the third rank, and back from the receiver.
        auto to_2 = message(0, kLater, 100);
        expect_ok(p2p.send(to_2.data(), to_2.size() * 4, 2, kLater), "send to rank 2");
        std::vector<int32_t> from_1(100);
        expect_ok(p2p.recv(from_1.data(), from_1.size() * 4, 1, kLater), "recv from rank 1");
        EXPECT_EQ(from_1, message(1, kLater, 100));
        // Once the receiver has posted its receives, a new message follows the
        // held-back ones through the same channel.
        r.store.get("posted", kP2PWaitMs);
        auto after = message(0, kAfter, 100);
        expect_ok(p2p.send(after.data(), after.size() * 4, 1, kAfter), "send after");
      } else if (r.rank == 2) {
        r.store.get("blocked", kP2PWaitMs);
        expect_ok(p2p.send(small.data(), small.size() * 4, 1, kOther), "send from rank 2");
        std::vector<int32_t> from_0(100);
        expect_ok(p2p.recv(from_0.data(), from_0.size() * 4, 0, kLater), "recv from rank 0");
        EXPECT_EQ(from_0, message(0, kLater, 100));
      } else {
        Held held{p2p, 0};
        ASSERT_TRUE(held.reaches_cap()) << "rank 0's messages never reached the cap";
        r.store.set("blocked", "1");
        std::vector<int32_t> from_2(100);
        expect_ok(p2p.recv(from_2.data(), from_2.size() * 4, 2, kOther),
                  "recv from rank 2 while rank 0 is held back");
        EXPECT_EQ(from_2, message(2, kOther, 100));
        held.stays_bounded();
        const uint64_t delivered = std::stoull(r.store.get("delivered", kP2PWaitMs));
        held.stays_bounded();
        auto to_0 = message(1, kLater, 100);
        expect_ok(p2p.send(to_0.data(), to_0.size() * 4, 0, kLater), "send to rank 0");
        // The delivered messages, then one receive too many: it takes the
        // message whose send timed out half way, which its sender's next
        // message drops, failing that receive (not leaving it to hang).
        std::vector<std::vector<uint8_t>> in(delivered + 1, std::vector<uint8_t>(kMessage));
        std::vector<std::shared_ptr<Request>> recvs;
        for (auto& buffer : in) recvs.push_back(p2p.recv(buffer.data(), kMessage, 0, kFlood));
        std::vector<int32_t> after(100);
        auto recv_after = p2p.recv(after.data(), after.size() * 4, 0, kAfter);
        r.store.set("posted", "1");
        expect_ok(recv_after, "recv after");
        EXPECT_EQ(after, message(0, kAfter, 100));
        for (uint64_t i = 0; i < delivered; ++i) {
          expect_ok(recvs[i], "recv " + std::to_string(i));
          EXPECT_EQ(in[i], bytes_for(0, kMessage, i)) << "message " << i;
        }
        EXPECT_TRUE(
            throws_error(ErrorKind::kTimeout, rethrow_error_of(recvs[delivered], 5000), "gave up"));
        EXPECT_EQ(p2p.unclaimed_bytes(0), 0u);
      }
    });
  }
}

TEST(P2PUnclaimed, AMessageLargerThanTheCapCompletesWhenItsReceiveComesWhileItArrives) {
  ScopedEnv cap("MOONCAKE_P2P_UNCLAIMED_BYTES", std::to_string(kCap));
  for (bool tcp : {false, true}) {
    run_p2p(2, small_chunks(tcp), [](P2P& p2p, Communicator&, Rank& r) {
      constexpr size_t kLarge = 16 * kCap, kFirst = 40 << 10;
      if (r.rank == 0) {
        // An unclaimed message that stays, then one far larger than the cap.
        auto first = bytes_for(0, kFirst, 1), large = bytes_for(0, kLarge, 2);
        auto send_first = p2p.send(first.data(), first.size(), 1, 1);
        expect_ok(p2p.send(large.data(), large.size(), 1, 2), "send of the large message");
        expect_ok(send_first, "send of the first message");
        return;
      }
      Held held{p2p, 0};
      ASSERT_TRUE(held.reaches_cap()) << "the large message never reached the cap";
      held.stays_bounded();
      std::vector<uint8_t> large(kLarge);
      expect_ok(p2p.recv(large.data(), large.size(), 0, 2), "recv of the large message");
      EXPECT_EQ(large, bytes_for(0, kLarge, 2));
      EXPECT_EQ(p2p.unclaimed_bytes(0), kFirst + P2P::kMessageOverheadBytes);
      std::vector<uint8_t> first(kFirst);
      expect_ok(p2p.recv(first.data(), first.size(), 0, 1), "recv of the first message");
      EXPECT_EQ(first, bytes_for(0, kFirst, 1));
      EXPECT_EQ(p2p.unclaimed_bytes(0), 0u);
    });
  }
}

// Rank 0 sends two messages that take rank 1 to its cap, then a small one
// with another tag, which waits in the channel, and exits. The small one was
// sent before rank 0 died: a receive posted for it after the death gets it
// (the cap holds back a live source, not what a dead one left behind), and
// so do the receives for the first two.
TEST(P2PUnclaimed, WhatADeadSourceLeftBehindTheCapIsStillReceived) {
  ScopedEnv cap("MOONCAKE_P2P_UNCLAIMED_BYTES", std::to_string(kCap));
  for (bool tcp : {false, true}) {
    run_p2p(2, small_chunks(tcp), [](P2P& p2p, Communicator& comm, Rank& r) {
      constexpr uint64_t kFirst = 1, kLast = 2;
      const auto last = message(0, kLast, 100);
      if (r.rank == 0) {
        auto a = bytes_for(0, kMessage, 1), b = bytes_for(0, kMessage, 2);
        auto send_a = p2p.send(a.data(), kMessage, 1, kFirst);
        auto send_b = p2p.send(b.data(), kMessage, 1, kFirst);
        expect_ok(p2p.send(last.data(), last.size() * 4, 1, kLast), "send of the last message");
        expect_ok(send_a, "send of the first message");
        expect_ok(send_b, "send of the second message");
        r.store.get("at cap", kP2PWaitMs);
        exit_rank_abruptly();
      }
      Held held{p2p, 0};
      ASSERT_TRUE(held.reaches_cap()) << "rank 0's messages never reached the cap";
      r.store.set("at cap", "1");
      const int64_t until = mooncake::now_us() + kP2PWaitMs * 1000;
      while (comm.endpoint().alive(0) && mooncake::now_us() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ASSERT_FALSE(comm.endpoint().alive(0)) << "rank 0 exited, and is not seen gone";
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // housekeeping rounds
      std::vector<int32_t> got(100);
      expect_ok(p2p.recv(got.data(), got.size() * 4, 0, kLast), "recv of the last message");
      EXPECT_EQ(got, last);
      std::vector<uint8_t> in(kMessage);
      expect_ok(p2p.recv(in.data(), kMessage, 0, kFirst), "recv of the first message");
      EXPECT_EQ(in, bytes_for(0, kMessage, 1));
    });
  }
}

TEST(P2PUnclaimed, ACapThatIsNotPositiveIsRefused) {
  ScopedEnv cap("MOONCAKE_P2P_UNCLAIMED_BYTES", "0");
  run_group(1, GroupOptions{}, [](Communicator& comm, Rank& r) {
    EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument,
                             [&] { P2P p2p(comm.p2p_channels(), r.rank, r.size, kP2PWaitMs); }));
  });
}

}  // namespace
}  // namespace mctest
