// Liveness: a connected peer is alive, and is seen dead soon after its
// process exits (shm: through its pidfd; tcp: through its closed connection);
// a process that was stopped for a while does not take its live peers for
// silent when it resumes; what a peer wrote before it exited is in place once
// it is seen gone.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "core/clock.h"
#include "transport/endpoint_group.h"
#include "transport/loss_times.h"

namespace mctest {
namespace {

class Liveness : public TransportTest {};

TEST_P(Liveness, APeerIsAliveWhileItsProcessRuns) {
  run_ranks(3, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    for (int peer = 0; peer < r.size; ++peer) EXPECT_TRUE(ep->alive(peer)) << "peer " << peer;
    store_barrier(r.store, "checked", r.rank, r.size);
  });
}

TEST_P(Liveness, APeerIsSeenDeadSoonAfterItsProcessExits) {
  run_ranks(2, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    EXPECT_TRUE(ep->alive(1 - r.rank));
    store_barrier(r.store, "seen alive", r.rank, r.size);
    if (r.rank == 1) exit_rank_abruptly();  // no destructors: as after a crash
    const int64_t start = mooncake::now_us();
    while (ep->alive(1) && mooncake::now_us() - start < 3'000'000)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_FALSE(ep->alive(1)) << "rank 1 exited 3 s ago";
    EXPECT_FALSE(ep->alive(1)) << "dead peers stay dead";
    EXPECT_TRUE(ep->alive(0)) << "a rank is always alive to itself";
  });
}

// What a peer wrote before it exited is in place once it is seen gone, also
// when this rank's own sends to it broke first: over tcp the reset of our
// connection comes back while its last MiB still wait, unread, on its own.
// Rank 0 sends to rank 1 without pause while rank 1 writes 8 MiB, signals and
// exits; rank 0 then reads the flag and the data the moment it sees rank 1 gone.
// Not over ucx: a write it reports done may still sit in UCX's buffers in the
// process, and goes with a process that dies (docs/failures.md).
class ExitedWriter : public TransportTest {};

TEST_P(ExitedWriter, WhatAPeerWroteBeforeItExitedIsInPlaceWhenItIsSeenGone) {
  constexpr size_t kFlag = mooncake::kSegmentHeaderBytes, kData = kFlag + 64;
  constexpr size_t kBytes = 8 << 20;
  std::vector<uint8_t> sent(kBytes);
  for (size_t j = 0; j < kBytes; ++j) sent[j] = static_cast<uint8_t>(j * 7 + (j >> 12));
  run_ranks(2, [&](Rank& r) {
    auto ep = connect_endpoint(r, transport(), kData + kBytes);
    const auto to_peer = ep->link(1 - r.rank);
    ASSERT_TRUE(to_peer);
    store_barrier(r.store, "connected", r.rank, r.size);
    if (r.rank == 1) {
      to_peer->write(kData, sent.data(), kBytes, mooncake::Deadline::after_ms(20000));
      to_peer->signal(kFlag, 1, 0, mooncake::Deadline::after_ms(20000));
      exit_rank_abruptly();
    }
    const uint64_t word = 1;
    bool broke = false;
    const int64_t until = mooncake::now_us() + 20'000'000;
    while (ep->alive(1) && mooncake::now_us() < until) {
      try {
        to_peer->write(kFlag, &word, sizeof(word), mooncake::Deadline::after_ms(1000));
      } catch (const mooncake::Error&) {
        broke = true;
      }
    }
    ASSERT_FALSE(ep->alive(1)) << "rank 1 exited, and is not seen gone after 20 s";
    EXPECT_EQ(mooncake::load_flag(ep->base(), kFlag), 1u)
        << "rank 1 was seen gone before its last signal was in place"
        << (broke ? " (our send to it had broken)" : "");
    EXPECT_EQ(std::memcmp(ep->base() + kData, sent.data(), kBytes), 0)
        << "rank 1 was seen gone before its last write was in place";
  });
}

// Rank 1 stops rank 0's whole process (heartbeat thread included) for 1.5 s.
// Rank 0's main thread samples silent_ms(1) all along: as soon as it runs
// again, before or after its heartbeat thread, rank 1 must not look silent
// (it was beating all the time; rank 0 is the one that stood still).
TEST_P(Liveness, AResumedProcessDoesNotTakeItsLivePeersForSilent) {
  run_ranks(2, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    if (r.rank == 1) {
      const pid_t pid = static_cast<pid_t>(std::stol(r.store.get("pid 0", 10000)));
      r.store.get("sampling", 10000);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ASSERT_EQ(::kill(pid, SIGSTOP), 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      ASSERT_EQ(::kill(pid, SIGCONT), 0);
      r.store.get("done", 20000);
      return;
    }
    // Rank 1's heartbeats reach this rank before the stop (ucx sets a
    // connection up on its first message, not at connect).
    const int64_t until = mooncake::now_us() + 10'000'000;
    while (ep->heartbeat(1) == 0 && mooncake::now_us() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_GT(ep->heartbeat(1), 0u) << "no heartbeat from rank 1 within 10 s";
    r.store.set("pid 0", std::to_string(::getpid()));
    r.store.set("sampling", "1");
    int64_t worst = 0;
    const int64_t start = mooncake::now_us();
    while (mooncake::now_us() - start < 3'000'000) worst = std::max(worst, ep->silent_ms(1));
    EXPECT_LT(worst, 500) << "rank 1 looked silent for " << worst << " ms";
    r.store.set("done", "1");
  });
}

// What a watcher (Endpoint::watch_peers) heard, as the heartbeat thread calls it.
struct Heard {
  std::mutex mu;
  std::vector<std::pair<int, mooncake::Endpoint::PeerLoss>> calls;
  size_t size() {
    std::lock_guard<std::mutex> l(mu);
    return calls.size();
  }
};

bool wait_until(const std::function<bool()>& done, int64_t us) {
  const int64_t until = mooncake::now_us() + us;
  while (!done() && mooncake::now_us() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return done();
}

// A watcher hears of a peer's death once (kGone), and a watcher added after it
// hears of it too; nothing for the live peer, nor after a watcher is dropped.
TEST_P(Liveness, WatchersHearOfADeadPeerOnce) {
  run_ranks(3, [this](Rank& r) {
    using Loss = mooncake::Endpoint::PeerLoss;
    auto ep = connect_endpoint(r, transport(), 4096);
    auto heard = std::make_shared<Heard>();
    const auto listen = [](std::shared_ptr<Heard> h) {
      return [h](int peer, Loss why) {
        std::lock_guard<std::mutex> l(h->mu);
        h->calls.emplace_back(peer, why);
        return true;
      };
    };
    ep->watch_peers(listen(heard), 0);
    int dropped_calls = 0;
    ep->watch_peers(
        [&dropped_calls](int, Loss) {
          ++dropped_calls;
          return false;  // dropped after its first call
        },
        0);
    store_barrier(r.store, "watching", r.rank, r.size);
    if (r.rank == 2) exit_rank_abruptly();
    ASSERT_TRUE(wait_until([&] { return heard->size() >= 1; }, 3'000'000)) << "nothing in 3 s";
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a few more rounds
    {
      std::lock_guard<std::mutex> l(heard->mu);
      EXPECT_EQ(heard->calls, (std::vector<std::pair<int, Loss>>{{2, Loss::kGone}}));
    }
    EXPECT_EQ(dropped_calls, 1);
    auto late = std::make_shared<Heard>();
    const uint64_t id = ep->watch_peers(listen(late), 0);
    ASSERT_TRUE(wait_until([&] { return late->size() >= 1; }, 1'000'000));
    ep->unwatch_peers(id);
    std::lock_guard<std::mutex> l(late->mu);
    EXPECT_EQ(late->calls, (std::vector<std::pair<int, Loss>>{{2, Loss::kGone}}));
    store_barrier(r.store, "checked", r.rank, 2);
  });
}

// A stopped peer is heard of as silent once its heartbeat stood still past the
// watcher's hang limit (and not by a watcher without one); after it resumes
// and beats again, a second stop is heard of again.
TEST_P(Liveness, WatchersHearOfAStoppedPeerAfterTheHangLimit) {
  run_ranks(2, [this](Rank& r) {
    using Loss = mooncake::Endpoint::PeerLoss;
    auto ep = connect_endpoint(r, transport(), 4096);
    if (r.rank == 1) {
      r.store.set("pid 1", std::to_string(::getpid()));
      r.store.get("done", 20000);
      return;
    }
    const pid_t pid = static_cast<pid_t>(std::stol(r.store.get("pid 1", 10000)));
    ASSERT_TRUE(wait_until([&] { return ep->heartbeat(1) > 0; }, 10'000'000));
    auto heard = std::make_shared<Heard>(), never = std::make_shared<Heard>();
    for (auto [h, hang] : {std::pair{heard, int64_t{300}}, std::pair{never, int64_t{0}}})
      ep->watch_peers(
          [h](int peer, Loss why) {
            std::lock_guard<std::mutex> l(h->mu);
            h->calls.emplace_back(peer, why);
            return true;
          },
          hang);
    for (size_t stop = 1; stop <= 2; ++stop) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      EXPECT_EQ(heard->size(), 2 * (stop - 1)) << "before stop " << stop;
      ASSERT_EQ(::kill(pid, SIGSTOP), 0);
      const bool told = wait_until([&] { return heard->size() >= 2 * stop - 1; }, 3'000'000);
      ASSERT_EQ(::kill(pid, SIGCONT), 0);
      ASSERT_TRUE(told) << "stop " << stop << ": not heard of in 3 s";
      ASSERT_TRUE(wait_until([&] { return heard->size() >= 2 * stop; }, 3'000'000))
          << "stop " << stop << ": not heard back in 3 s";
    }
    std::lock_guard<std::mutex> l(heard->mu);
    EXPECT_EQ(heard->calls,
              (std::vector<std::pair<int, Loss>>{
                  {1, Loss::kSilent}, {1, Loss::kBack}, {1, Loss::kSilent}, {1, Loss::kBack}}));
    EXPECT_EQ(never->size(), 0u);
    r.store.set("done", "1");
  });
}

// LossTimes keeps when its watch heard of each loss, on the clock of now_us(): a
// dead peer's time lies between its exit and the reading, a stopped peer's comes
// past the hang limit, and a live peer has none.
TEST_P(Liveness, LossTimesKeepWhenAPeerWasHeardGoneOrSilent) {
  run_ranks(3, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    if (r.rank != 0) {
      r.store.set("pid " + std::to_string(r.rank), std::to_string(::getpid()));
      store_barrier(r.store, "watching", r.rank, r.size);
      if (r.rank == 2) exit_rank_abruptly();
      r.store.get("done", 20000);
      return;
    }
    const auto times = std::make_shared<mooncake::LossTimes>(r.size);
    ep->watch_peers(times->listener(), 300);
    const pid_t pid = static_cast<pid_t>(std::stol(r.store.get("pid 1", 10000)));
    const int64_t before_exit = mooncake::now_us();
    store_barrier(r.store, "watching", r.rank, r.size);
    ASSERT_TRUE(wait_until([&] { return times->gone_us(2).has_value(); }, 3'000'000))
        << "rank 2's exit not heard of in 3 s";
    EXPECT_GE(*times->gone_us(2), before_exit);
    EXPECT_LE(*times->gone_us(2), mooncake::now_us());
    EXPECT_FALSE(times->gone_us(1).has_value()) << "rank 1 lives";
    EXPECT_FALSE(times->silent_us(2).has_value()) << "a dead peer is gone, not silent";
    const int64_t before_stop = mooncake::now_us();
    ASSERT_EQ(::kill(pid, SIGSTOP), 0);
    const bool told = wait_until([&] { return times->silent_us(1).has_value(); }, 3'000'000);
    ASSERT_EQ(::kill(pid, SIGCONT), 0);
    ASSERT_TRUE(told) << "rank 1's stop not heard of in 3 s";
    // Its last beat came at most a heartbeat period (20 ms) before the stop.
    EXPECT_GE(*times->silent_us(1) - before_stop, 250'000);
    EXPECT_FALSE(times->gone_us(1).has_value());
    r.store.set("done", "1");
  });
}

TEST(LossTimes, RejectsABadCapacityOrPeer) {
  EXPECT_THROW(mooncake::LossTimes(0), mooncake::Error);
  auto times = std::make_shared<mooncake::LossTimes>(2);
  EXPECT_THROW(times->gone_us(2), mooncake::Error);
  EXPECT_THROW(times->silent_us(-1), mooncake::Error);
  // A listener outlives its LossTimes: it asks to be dropped.
  auto listen = times->listener();
  EXPECT_TRUE(listen(1, mooncake::Endpoint::PeerLoss::kGone));
  EXPECT_TRUE(times->gone_us(1).has_value());
  EXPECT_TRUE(listen(7, mooncake::Endpoint::PeerLoss::kGone)) << "a slot past it is ignored";
  const std::weak_ptr<mooncake::LossTimes> held = times;
  times.reset();
  EXPECT_TRUE(held.expired());
  EXPECT_FALSE(listen(1, mooncake::Endpoint::PeerLoss::kGone));
}

INSTANTIATE_TEST_SUITE_P(Transports, Liveness, testing::ValuesIn(every_transport()),
                         transport_name);
INSTANTIATE_TEST_SUITE_P(Transports, ExitedWriter, testing::Values("shm", "tcp"), transport_name);

}  // namespace
}  // namespace mctest
