// P2P matching: a receive takes the message with its source and tag whatever
// the arrival order; messages with one source and tag are received in the
// order they were sent; any-source receives take every source and report it.
#include <gtest/gtest.h>

#include "collectives/p2p_group.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::P2P;
using mooncake::Request;

TEST(P2PMatching, TagsAreMatchedWhateverOrderTheReceivesArePostedIn) {
  for (bool tcp : {false, true}) {
    run_p2p(2, tcp, [](P2P& p2p, Communicator&, Rank& r) {
      const std::vector<uint64_t> tags = {1, 2, 3, 4, 5};
      if (r.rank == 0) {
        std::vector<std::vector<int32_t>> sent;
        for (uint64_t tag : tags) sent.push_back(message(0, tag, 10 + tag));
        std::vector<std::shared_ptr<Request>> sends;
        for (size_t i = 0; i < tags.size(); ++i)
          sends.push_back(p2p.send(sent[i].data(), sent[i].size() * 4, 1, tags[i]));
        for (auto& s : sends) expect_ok(s, "send");
      } else {
        // Receives posted in reverse order, some of them after the messages arrived.
        std::vector<std::vector<int32_t>> got;
        std::vector<std::shared_ptr<Request>> recvs;
        for (auto it = tags.rbegin(); it != tags.rend(); ++it) {
          got.emplace_back(10 + *it);
          recvs.push_back(p2p.recv(got.back().data(), got.back().size() * 4, 0, *it));
        }
        for (size_t i = 0; i < recvs.size(); ++i) {
          const uint64_t tag = tags[tags.size() - 1 - i];
          expect_ok(recvs[i], "recv tag " + std::to_string(tag));
          EXPECT_EQ(got[i], message(0, tag, 10 + tag)) << "tag " << tag;
          EXPECT_EQ(recvs[i]->source_rank(), 0);
        }
      }
    });
  }
}

TEST(P2PMatching, ReceivesPostedBeforeTheMessagesMatchByTag) {
  run_p2p(2, false, [](P2P& p2p, Communicator&, Rank& r) {
    if (r.rank == 1) {
      std::vector<int32_t> a(7), b(9);
      auto ra = p2p.recv(a.data(), a.size() * 4, 0, 20);
      auto rb = p2p.recv(b.data(), b.size() * 4, 0, 10);
      r.store.set("posted", "1");
      expect_ok(ra, "recv tag 20");
      expect_ok(rb, "recv tag 10");
      EXPECT_EQ(a, message(0, 20, 7));
      EXPECT_EQ(b, message(0, 10, 9));
    } else {
      r.store.get("posted", kP2PWaitMs);
      auto b = message(0, 10, 9), a = message(0, 20, 7);
      expect_ok(p2p.send(b.data(), b.size() * 4, 1, 10), "send tag 10");
      expect_ok(p2p.send(a.data(), a.size() * 4, 1, 20), "send tag 20");
    }
  });
}

TEST(P2PMatching, MessagesWithOneSourceAndTagArriveInSendOrder) {
  run_p2p(2, false, [](P2P& p2p, Communicator&, Rank& r) {
    constexpr int kCount = 16;
    if (r.rank == 0) {
      std::vector<std::vector<int32_t>> sent;
      for (int i = 0; i < kCount; ++i) sent.push_back(message(0, static_cast<uint64_t>(i), 100));
      std::vector<std::shared_ptr<Request>> sends;
      for (auto& m : sent) sends.push_back(p2p.send(m.data(), m.size() * 4, 1, /*tag=*/3));
      for (auto& s : sends) expect_ok(s, "send");
    } else {
      std::vector<std::vector<int32_t>> got(kCount, std::vector<int32_t>(100));
      std::vector<std::shared_ptr<Request>> recvs;
      for (auto& g : got) recvs.push_back(p2p.recv(g.data(), g.size() * 4, 0, /*tag=*/3));
      for (int i = 0; i < kCount; ++i) {
        expect_ok(recvs[i], "recv #" + std::to_string(i));
        EXPECT_EQ(got[i], message(0, static_cast<uint64_t>(i), 100)) << "receive #" << i;
      }
    }
  });
}

// Any-source receives, one per other rank, for `tag`.
struct AnySourceReceives {
  AnySourceReceives(P2P& p2p, int size, uint64_t tag)
      : tag(tag), got(size - 1, std::vector<int32_t>(50)) {
    for (auto& g : got) recvs.push_back(p2p.recv(g.data(), g.size() * 4, -1, tag));
  }

  // Each completes with a distinct source, whose payload it holds.
  void check(int size) {
    std::vector<int> seen(size, 0);
    for (size_t i = 0; i < recvs.size(); ++i) {
      expect_ok(recvs[i],
                "any-source recv #" + std::to_string(i) + " of tag " + std::to_string(tag));
      const int src = recvs[i]->source_rank();
      ASSERT_TRUE(src > 0 && src < size) << "source " << src;
      ++seen[src];
      EXPECT_EQ(got[i], message(src, tag, 50)) << "payload of the message from rank " << src;
    }
    for (int src = 1; src < size; ++src) EXPECT_EQ(seen[src], 1) << "messages from rank " << src;
  }

  uint64_t tag;
  std::vector<std::vector<int32_t>> got;
  std::vector<std::shared_ptr<Request>> recvs;
};

TEST(P2PMatching, AnySourceReceivesFromEveryPeerAndReportsWhich) {
  for (auto [ranks, tcp] : {std::pair{3, false}, {7, false}, {3, true}}) {
    run_p2p(ranks, tcp, [](P2P& p2p, Communicator&, Rank& r) {
      // Tag 9: the receives are posted before the messages are sent; tag 10:
      // every message has arrived before the receives are posted.
      if (r.rank != 0) {
        r.store.get("posted", kP2PWaitMs);
        auto m9 = message(r.rank, 9, 50), m10 = message(r.rank, 10, 50);
        expect_ok(p2p.send(m9.data(), m9.size() * 4, 0, 9), "send tag 9");
        expect_ok(p2p.send(m10.data(), m10.size() * 4, 0, 10), "send tag 10");
        store_barrier(r.store, "sent", r.rank, r.size);
        return;
      }
      AnySourceReceives posted_first(p2p, r.size, 9);
      r.store.set("posted", "1");
      posted_first.check(r.size);
      store_barrier(r.store, "sent", r.rank, r.size);
      AnySourceReceives posted_after(p2p, r.size, 10);
      posted_after.check(r.size);
    });
  }
}

TEST(P2PMatching, AnySourceTakesOnlyItsTag) {
  run_p2p(2, false, [](P2P& p2p, Communicator&, Rank& r) {
    if (r.rank == 1) {
      auto one = message(1, 1, 4), two = message(1, 2, 4);
      expect_ok(p2p.send(one.data(), 16, 0, 1), "send tag 1");
      expect_ok(p2p.send(two.data(), 16, 0, 2), "send tag 2");
      return;
    }
    std::vector<int32_t> got2(4), got1(4);
    auto r2 = p2p.recv(got2.data(), 16, -1, 2);
    expect_ok(r2, "any-source recv tag 2");
    EXPECT_EQ(got2, message(1, 2, 4));
    auto r1 = p2p.recv(got1.data(), 16, -1, 1);
    expect_ok(r1, "any-source recv tag 1");
    EXPECT_EQ(got1, message(1, 1, 4));
  });
}

TEST(P2PMatching, ReceiveFromOneSourceSkipsAnotherSourcesMessageWithTheSameTag) {
  run_p2p(3, false, [](P2P& p2p, Communicator&, Rank& r) {
    if (r.rank == 1) {  // sends first, and its message has arrived before rank 2 sends
      auto m = message(1, 4, 8);
      expect_ok(p2p.send(m.data(), 32, 0, 4), "send from rank 1");
      r.store.set("rank 1 sent", "1");
    } else if (r.rank == 2) {
      r.store.get("rank 1 sent", kP2PWaitMs);
      auto m = message(2, 4, 8);
      expect_ok(p2p.send(m.data(), 32, 0, 4), "send from rank 2");
    } else {
      std::vector<int32_t> from2(8), from1(8);
      auto r2 = p2p.recv(from2.data(), 32, 2, 4);
      expect_ok(r2, "recv from rank 2");
      EXPECT_EQ(from2, message(2, 4, 8));
      auto r1 = p2p.recv(from1.data(), 32, 1, 4);
      expect_ok(r1, "recv from rank 1");
      EXPECT_EQ(from1, message(1, 4, 8));
    }
  });
}

TEST(P2PMatching, ARankCanSendToItself) {
  run_p2p(2, false, [](P2P& p2p, Communicator&, Rank& r) {
    auto m = message(r.rank, 6, 300);  // several chunks
    std::vector<int32_t> got(300);
    auto recv = p2p.recv(got.data(), got.size() * 4, r.rank, 6);
    expect_ok(p2p.send(m.data(), m.size() * 4, r.rank, 6), "send to self");
    expect_ok(recv, "recv from self");
    EXPECT_EQ(got, m);
  });
}

}  // namespace
}  // namespace mctest
