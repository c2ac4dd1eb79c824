// P2P failures: a receive whose size differs from the message fails with an
// invalid-argument error without writing past its buffer, and the next
// message still arrives; receives time out, notice a dead source, and fail
// when the P2P stops; ranks outside the group are refused.
#include <gtest/gtest.h>

#include <thread>

#include "collectives/p2p_group.h"
#include "core/clock.h"
#include "errors.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::ErrorKind;
using mooncake::P2P;
using mooncake::Request;

// Receives with a buffer of `want` ints inside guard bytes, from a message of
// `sent` ints; then a correctly sized message with the same tag.
void check_wrong_size(P2P& p2p, Rank& r, size_t sent, size_t want, bool post_first) {
  const uint64_t tag = sent * 10000 + want * 10 + post_first;
  const std::string ready = "ready " + std::to_string(tag);
  if (r.rank == 0) {
    if (post_first) r.store.get(ready, kP2PWaitMs);
    auto bad = message(0, tag, sent), good = message(0, tag + 1, want);
    expect_ok(p2p.send(bad.data(), bad.size() * 4, 1, tag), "send of the wrong size");
    expect_ok(p2p.send(good.data(), good.size() * 4, 1, tag), "send of the right size");
    if (!post_first) r.store.set(ready, "1");
    return;
  }
  std::vector<int32_t> buffer(want + 64, -1);  // want ints, then guard ints
  std::shared_ptr<Request> recv;
  if (post_first) {
    recv = p2p.recv(buffer.data(), want * 4, 0, tag);
    r.store.set(ready, "1");
  } else {
    r.store.get(ready, kP2PWaitMs);
    recv = p2p.recv(buffer.data(), want * 4, 0, tag);
  }
  EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, rethrow_error_of(recv)))
      << sent << " ints sent, " << want << " expected, receive posted "
      << (post_first ? "first" : "after");
  for (size_t i = want; i < buffer.size(); ++i)
    ASSERT_EQ(buffer[i], -1) << "written past the receive buffer at int " << i;
  std::vector<int32_t> next(want);
  expect_ok(p2p.recv(next.data(), want * 4, 0, tag), "the next message");
  EXPECT_EQ(next, message(0, tag + 1, want));
}

TEST(P2PErrors, AReceiveOfTheWrongSizeFailsAndTheNextMessageStillArrives) {
  for (bool tcp : {false, true}) {
    run_p2p(2, tcp, [](P2P& p2p, Communicator&, Rank& r) {
      for (bool post_first : {true, false}) {
        check_wrong_size(p2p, r, 16, 25, post_first);  // shorter than the buffer
        check_wrong_size(p2p, r, 700, 4, post_first);  // several chunks, much longer
        check_wrong_size(p2p, r, 0, 3, post_first);    // empty
      }
    });
  }
}

TEST(P2PErrors, AReceiveTimesOutWhenNothingArrives) {
  run_p2p(2, false, [](P2P& p2p, Communicator&, Rank& r) {
    if (r.rank != 0) return;
    int32_t x;
    for (int src : {1, -1}) {
      const int64_t start = mooncake::now_us();
      auto recv = p2p.recv(&x, 4, src, 77, /*timeout_ms=*/200);
      EXPECT_TRUE(throws_error(ErrorKind::kTimeout, rethrow_error_of(recv))) << "src " << src;
      const int64_t elapsed_ms = (mooncake::now_us() - start) / 1000;
      EXPECT_GE(elapsed_ms, 200) << "src " << src;
      EXPECT_LT(elapsed_ms, 1200) << "src " << src;
    }
  });
}

TEST(P2PErrors, AReceiveFromAnExitedPeerFailsPromptly) {
  for (bool tcp : {false, true}) {
    GroupOptions o;
    o.tcp = tcp;
    run_group(2, o, [](Communicator& comm, Rank& r) {
      if (r.rank == 1) exit_rank_abruptly();
      P2P p2p(comm.p2p_channels(), r.rank, r.size, 20000);
      int32_t x;
      const int64_t start = mooncake::now_us();
      auto recv = p2p.recv(&x, 4, 1, 5);
      EXPECT_TRUE(throws_error(ErrorKind::kPeerFailed, rethrow_error_of(recv)));
      EXPECT_LT(mooncake::now_us() - start, 3'000'000) << "far sooner than the 20 s timeout";
    });
  }
}

// The sender writes the first chunk of a three-chunk message and then dies
// (or stalls) before the receive is posted: the receive claims the message
// that started to arrive, and must still fail when its sender dies or its
// own deadline passes, instead of waiting for the rest.
void check_claimed_partial_message(bool sender_dies) {
  GroupOptions o;
  o.chunk_bytes = 4096;
  run_group(2, o, [sender_dies](Communicator& comm, Rank& r) {
    if (r.rank == 1) {
      std::vector<uint8_t> chunk(4096, 7);
      mooncake::MsgHeader h{};
      h.op_seq = 9;   // the tag
      h.op_type = 1;  // the first chunk of a message
      h.numel = 3 * chunk.size();
      comm.p2p_channels().send(0, h, chunk.data(), chunk.size(),
                               mooncake::Deadline::after_ms(kP2PWaitMs), "send");
      r.store.set("first chunk sent", "1");
      if (sender_dies) exit_rank_abruptly();
      r.store.get("receiver done", 30000);
      return;
    }
    P2P p2p(comm.p2p_channels(), r.rank, r.size, 20000);
    r.store.get("first chunk sent", kP2PWaitMs);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // it lands unexpected
    std::vector<uint8_t> buffer(3 * 4096);
    const int64_t start = mooncake::now_us();
    auto recv = p2p.recv(buffer.data(), buffer.size(), 1, 9, sender_dies ? -1 : 300);
    ASSERT_TRUE(recv->wait(8000)) << "the receive never completed";
    EXPECT_TRUE(throws_error(sender_dies ? ErrorKind::kPeerFailed : ErrorKind::kTimeout,
                             rethrow_error_of(recv)));
    EXPECT_LT(mooncake::now_us() - start, 3'000'000) << "far sooner than the 20 s timeout";
    r.store.set("receiver done", "1");
  });
}

TEST(P2PErrors, AReceiveClaimingAPartlyArrivedMessageFailsWhenItsSenderDies) {
  check_claimed_partial_message(true);
}

TEST(P2PErrors, AReceiveClaimingAPartlyArrivedMessageTimesOut) {
  check_claimed_partial_message(false);
}

TEST(P2PErrors, StoppingFailsPostedAndLaterReceives) {
  run_p2p(2, false, [](P2P& p2p, Communicator&, Rank& r) {
    if (r.rank != 0) return;
    int32_t x;
    auto posted = p2p.recv(&x, 4, 1, 5);
    p2p.stop();
    EXPECT_TRUE(throws_error(ErrorKind::kPeerFailed, rethrow_error_of(posted)));
    EXPECT_TRUE(throws_error(ErrorKind::kPeerFailed, rethrow_error_of(p2p.recv(&x, 4, 1, 5))));
  });
}

TEST(P2PErrors, RanksOutsideTheGroupAreRefused) {
  run_p2p(2, false, [](P2P& p2p, Communicator&, Rank& r) {
    int32_t x = 0;
    EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, [&] { p2p.send(&x, 4, r.size, 1); }));
    EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, [&] { p2p.send(&x, 4, -1, 1); }));
    EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, [&] { p2p.recv(&x, 4, r.size, 1); }));
  });
}

}  // namespace
}  // namespace mctest
