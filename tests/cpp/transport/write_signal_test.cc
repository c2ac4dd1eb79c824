// One-sided write + signal between two processes, over shm and forced tcp: a
// peer that sees the flag sees every byte written before it; empty writes
// change nothing; writes of several MiB (both ways at once) arrive whole; the
// signal rings the bell it names; a write past the peer's segment is refused
// at the sender and leaves the link working.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "core/wait.h"
#include "errors.h"
#include "transport/endpoint_group.h"

namespace mctest {
namespace {

using mooncake::Deadline;
using mooncake::Endpoint;
using mooncake::load_flag;

// Past the segment header (its doorbells, heartbeat and owner seal).
constexpr size_t kSignalFlag = mooncake::kSegmentHeaderBytes;  // in the receiver: "data is ready"
constexpr size_t kAck =
    kSignalFlag + 64;  // in the writer: the receiver's "data was checked" counter
constexpr size_t kSignalData = kSignalFlag + 192;  // where payloads go

// Waits until the flag at `offset` of this rank's segment reaches `value`.
bool wait_flag(Endpoint& ep, size_t offset, uint64_t value, int bell = 0, int64_t poll_ms = 50,
               int64_t timeout_ms = 5000) {
  return mooncake::wait_on(
      ep.bell(bell), [&] { return load_flag(ep.base(), offset) >= value; },
      Deadline::after_ms(timeout_ms), nullptr, poll_ms);
}

// Byte j of round i: every byte changes from one round to the next.
std::vector<uint8_t> pattern(uint64_t round, size_t n) {
  std::vector<uint8_t> p(n);
  for (size_t j = 0; j < n; ++j) p[j] = static_cast<uint8_t>(round * 131 + j * 7 + (j >> 8));
  return p;
}

class WriteSignal : public TransportTest {};

TEST_P(WriteSignal, APeerThatSeesTheFlagSeesEveryEarlierWrite) {
  run_ranks(2, [this](Rank& r) {
    constexpr size_t kBytes = 64 << 10, kPieces = 4;
    auto ep = connect_endpoint(r, transport(), kSignalData + kBytes);
    for (uint64_t round = 1; round <= 200; ++round) {
      if (r.rank == 0) {
        const auto p = pattern(round, kBytes);
        for (size_t k = 0; k < kPieces; ++k)  // several writes, then one signal
          ep->link(1)->write(kSignalData + k * kBytes / kPieces, p.data() + k * kBytes / kPieces,
                             kBytes / kPieces, Deadline::after_ms(5000));
        ep->link(1)->signal(kSignalFlag, round, 0, Deadline::after_ms(5000));
        ASSERT_TRUE(wait_flag(*ep, kAck, round)) << "no ack for round " << round;
      } else {
        ASSERT_TRUE(wait_flag(*ep, kSignalFlag, round)) << "no signal for round " << round;
        ASSERT_EQ(std::memcmp(ep->base() + kSignalData, pattern(round, kBytes).data(), kBytes), 0)
            << "round " << round << ": the flag was visible before the data";
        ep->link(0)->signal(kAck, round, 0, Deadline::after_ms(5000));
      }
    }
  });
}

TEST_P(WriteSignal, AnEmptyWriteChangesNothing) {
  run_ranks(2, [this](Rank& r) {
    constexpr size_t kBytes = 4096;
    auto ep = connect_endpoint(r, transport(), kBytes);
    if (r.rank == 1) {
      std::memset(ep->base() + kSignalData, 0x5A, kBytes - kSignalData);
      store_barrier(r.store, "filled", r.rank, r.size);
      ASSERT_TRUE(wait_flag(*ep, kSignalFlag, 1));
      EXPECT_EQ(std::memcmp(ep->base() + 512, "ABCDEFGH", 8), 0);
      for (size_t i = kSignalData; i < kBytes; ++i)
        if (i < 512 || i >= 520) ASSERT_EQ(ep->base()[i], 0x5A) << "byte " << i << " changed";
    } else {
      store_barrier(r.store, "filled", r.rank, r.size);
      const Deadline d = Deadline::after_ms(5000);
      ep->link(1)->write(kSignalData, nullptr, 0, d);
      ep->link(1)->write(kBytes, nullptr, 0, d);  // at the very end of the segment
      ep->link(1)->write(512, "ABCDEFGH", 8, d);  // the stream is still in step after them
      ep->link(1)->write(600, "ignored", 0, d);
      ep->link(1)->signal(kSignalFlag, 1, 0, d);
    }
  });
}

TEST_P(WriteSignal, WritesOfSeveralMiBArriveWholeInBothDirectionsAtOnce) {
  run_ranks(2, [this](Rank& r) {
    constexpr size_t kBytes = 6 << 20;
    auto ep = connect_endpoint(r, transport(), kSignalData + kBytes);
    store_barrier(r.store, "connected", r.rank, r.size);
    const int peer = 1 - r.rank;
    const auto mine = pattern(10 + r.rank, kBytes);
    ep->link(peer)->write(kSignalData, mine.data(), kBytes, Deadline::after_ms(10000));
    ep->link(peer)->signal(kSignalFlag, 1, 0, Deadline::after_ms(10000));
    ASSERT_TRUE(wait_flag(*ep, kSignalFlag, 1));
    EXPECT_EQ(std::memcmp(ep->base() + kSignalData, pattern(10 + peer, kBytes).data(), kBytes), 0);
    store_barrier(r.store, "checked", r.rank, r.size);  // the peer is done reading us too
  });
}

TEST_P(WriteSignal, TheSignalRingsTheBellItNames) {
  run_ranks(2, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    if (r.rank == 1) {
      store_barrier(r.store, "waiting", r.rank, r.size);
      // No polling: only a ring of bell 2 wakes this wait before its deadline.
      const int64_t start = mooncake::now_us();
      EXPECT_TRUE(wait_flag(*ep, kSignalFlag, 1, /*bell=*/2, /*poll_ms=*/600000));
      EXPECT_LT(mooncake::now_us() - start, 2'000'000);
    } else {
      store_barrier(r.store, "waiting", r.rank, r.size);
      std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the peer is asleep
      ep->link(1)->signal(kSignalFlag, 1, /*bell=*/2, Deadline::after_ms(5000));
    }
    store_barrier(r.store, "done", r.rank, r.size);
  });
}

TEST_P(WriteSignal, AWritePastThePeersSegmentIsRefusedAtTheSenderAndTheLinkStillWorks) {
  run_ranks(2, [this](Rank& r) {
    constexpr size_t kBytes = 4096;
    auto ep = connect_endpoint(r, transport(), kBytes);
    if (r.rank == 0) {
      const char junk[16] = {};
      EXPECT_TRUE(throws_error(
          mooncake::ErrorKind::kInternal,
          [&] { ep->link(1)->write(kBytes - 8, junk, sizeof(junk), Deadline::after_ms(5000)); }))
          << "a 16-byte write 8 bytes before the end of a " << kBytes << "-byte segment";
      EXPECT_NO_THROW({
        ep->link(1)->write(512, "ABCDEFGH", 8, Deadline::after_ms(5000));
        ep->link(1)->signal(kSignalFlag, 1, 0, Deadline::after_ms(5000));
      }) << "the link is unusable after the refused write";
    } else {
      const bool arrived = wait_flag(*ep, kSignalFlag, 1, 0, 50, /*timeout_ms=*/1500);
      EXPECT_TRUE(arrived) << "the link stopped working after the bad write";
      if (arrived) EXPECT_EQ(std::memcmp(ep->base() + 512, "ABCDEFGH", 8), 0);
      EXPECT_TRUE(ep->alive(0)) << "the writer is alive but its link was dropped";
    }
    store_barrier(r.store, "done", r.rank, r.size);
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, WriteSignal, testing::ValuesIn(every_transport()),
                         transport_name);

}  // namespace
}  // namespace mctest
