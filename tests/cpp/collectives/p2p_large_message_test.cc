// P2P volume: messages many chunks long arrive whole, whether the receive was
// posted before or after they arrived; many sends may be in flight to every
// peer at once, in both directions, without deadlock.
#include <gtest/gtest.h>

#include "collectives/p2p_group.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::P2P;
using mooncake::Request;

// Message sizes around and far above the 256-byte chunk.
const std::vector<size_t> kSizes = {0, 1, 255, 256, 257, 10000, 100003};

TEST(P2PLargeMessage, MessagesLongerThanTheChunkArriveWholeWithTheReceivePostedFirst) {
  for (bool tcp : {false, true}) {
    run_p2p(2, tcp, [](P2P& p2p, Communicator&, Rank& r) {
      for (size_t i = 0; i < kSizes.size(); ++i) {
        const std::string posted = "posted " + std::to_string(i);
        if (r.rank == 1) {
          std::vector<uint8_t> got(kSizes[i], 0xEE);
          auto recv = p2p.recv(got.data(), got.size(), 0, i);
          r.store.set(posted, "1");
          expect_ok(recv, "recv of " + std::to_string(kSizes[i]) + " bytes");
          EXPECT_EQ(got, bytes_for(0, kSizes[i], i)) << kSizes[i] << " bytes";
        } else {
          r.store.get(posted, kP2PWaitMs);
          auto m = bytes_for(0, kSizes[i], i);
          expect_ok(p2p.send(m.data(), m.size(), 1, i), "send");
        }
      }
    });
  }
}

TEST(P2PLargeMessage, MessagesLongerThanTheChunkArriveWholeWithTheReceivePostedAfter) {
  for (bool tcp : {false, true}) {
    run_p2p(2, tcp, [](P2P& p2p, Communicator&, Rank& r) {
      if (r.rank == 0) {
        for (size_t i = 0; i < kSizes.size(); ++i) {
          auto m = bytes_for(0, kSizes[i], i);
          expect_ok(p2p.send(m.data(), m.size(), 1, i), "send");
        }
        r.store.set("all sent", "1");
      } else {
        r.store.get("all sent", kP2PWaitMs);  // every message is buffered on arrival
        for (size_t i = 0; i < kSizes.size(); ++i) {
          std::vector<uint8_t> got(kSizes[i], 0xEE);
          expect_ok(p2p.recv(got.data(), got.size(), 0, i),
                    "recv of " + std::to_string(kSizes[i]) + " bytes");
          EXPECT_EQ(got, bytes_for(0, kSizes[i], i)) << kSizes[i] << " bytes";
        }
      }
    });
  }
}

TEST(P2PLargeMessage, ManySendsInFlightToEveryPeerAtOnce) {
  for (auto [ranks, tcp] : {std::pair{4, false}, {3, true}}) {
    run_p2p(ranks, tcp, [](P2P& p2p, Communicator&, Rank& r) {
      constexpr uint64_t kPerPeer = 24;
      auto size_of = [](int src, int dst, uint64_t tag) {
        return static_cast<size_t>((src * 131 + dst * 71 + tag * 37) % 900);  // 0 to ~3.5 chunks
      };
      std::vector<std::vector<uint8_t>> out, in;
      std::vector<std::shared_ptr<Request>> requests;
      out.reserve(r.size * kPerPeer);
      in.reserve(r.size * kPerPeer);
      for (int peer = 0; peer < r.size; ++peer) {
        if (peer == r.rank) continue;
        for (uint64_t tag = 0; tag < kPerPeer; ++tag) {
          in.emplace_back(size_of(peer, r.rank, tag));
          requests.push_back(p2p.recv(in.back().data(), in.back().size(), peer, tag));
        }
      }
      for (int peer = 0; peer < r.size; ++peer) {
        if (peer == r.rank) continue;
        for (uint64_t tag = 0; tag < kPerPeer; ++tag) {
          out.push_back(bytes_for(r.rank, size_of(r.rank, peer, tag), tag * 64 + peer));
          requests.push_back(p2p.send(out.back().data(), out.back().size(), peer, tag));
        }
      }
      expect_ok(mooncake::all_of(requests), "every send and receive");
      size_t k = 0;
      for (int peer = 0; peer < r.size; ++peer) {
        if (peer == r.rank) continue;
        for (uint64_t tag = 0; tag < kPerPeer; ++tag, ++k)
          EXPECT_EQ(in[k], bytes_for(peer, size_of(peer, r.rank, tag), tag * 64 + r.rank))
              << "from rank " << peer << " tag " << tag;
      }
    });
  }
}

TEST(P2PLargeMessage, BothDirectionsAtOnceDoNotDeadlock) {
  for (bool tcp : {false, true}) {
    run_p2p(2, tcp, [](P2P& p2p, Communicator&, Rank& r) {
      const int peer = 1 - r.rank;
      auto m = bytes_for(r.rank, 256 << 10, 1);
      auto send = p2p.send(m.data(), m.size(), peer, 0);  // before either side receives
      std::vector<uint8_t> got(256 << 10);
      expect_ok(p2p.recv(got.data(), got.size(), peer, 0), "recv");
      expect_ok(send, "send");
      EXPECT_EQ(got, bytes_for(peer, 256 << 10, 1));
    });
  }
}

}  // namespace
}  // namespace mctest
