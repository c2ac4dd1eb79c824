// The elastic EP buffer's store records (ep/elastic.h): cur/<slot> names
// the process holding a slot, meta/<slot>/<inc> its buffer's shape, and
// link/<from>/<to> the channel generation of a pair. A malformed record
// makes the call that reads it (connect for cur and meta, set_masked for
// link) fail at once with a kInternal Error naming the key, changes no
// slot's state, and once the record is right the same call works.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/clock.h"
#include "ep/elastic.h"
#include "errors.h"
#include "harness.h"

namespace mctest {
namespace {

using mooncake::ElasticConfig;
using mooncake::ElasticPeers;
using mooncake::ErrorKind;
using mooncake::SlotState;

ElasticConfig config(int slot) {
  ElasticConfig c;
  c.rank = slot;
  c.capacity = 2;
  c.local_experts = 2;
  c.timeout_ms = 5000;
  c.metadata_timeout_ms = 3000;
  c.chunk_bytes = 256;
  c.hang_ms = 0;
  return c;
}

std::unique_ptr<ElasticPeers> make_peers(Rank& r, bool tcp) {
  mooncake::EngineOptions options;
  options.force_tcp = tcp;
  return std::make_unique<ElasticPeers>(mooncake::TransferEngine(options), r.store, config(r.rank));
}

// `fn` throws kInternal naming `key`, long before the metadata timeout.
testing::AssertionResult fails_at_once(const std::function<void()>& fn, const std::string& key) {
  const int64_t start = mooncake::now_us();
  auto r = throws_error(ErrorKind::kInternal, fn, "under '" + key + "' in the store");
  const int64_t took_ms = (mooncake::now_us() - start) / 1000;
  if (r && took_ms > 1000)
    return testing::AssertionFailure() << "it failed, but only after " << took_ms << " ms";
  return r;
}

class ElasticRecords : public testing::TestWithParam<bool> {};

TEST_P(ElasticRecords, AMalformedRecordFailsTheCallThatReadsItAndChangesNothing) {
  const bool tcp = GetParam();
  run_ranks(2, [&](Rank& r) {
    auto peers = make_peers(r, tcp);
    const int other = 1 - r.rank;
    store_barrier(r.store, "created", r.rank, r.size);
    if (r.rank == 0) {
      auto refused = [&](const std::string& key, const std::string& value) {
        r.store.set(key, value);
        EXPECT_TRUE(fails_at_once([&] { peers->connect({1}, false); }, key))
            << key << " = '" << value << "'";
        EXPECT_EQ(peers->slots().state(1), SlotState::kDisconnected);
        EXPECT_STREQ(peers->transport_of(1), "none");
      };
      const std::string cur = "mooncake-ep/cur/1", meta = "mooncake-ep/meta/1/0";
      const std::string good_cur = r.store.get(cur, 0), good_meta = r.store.get(meta, 0);
      ASSERT_EQ(good_cur, "0");
      for (const char* bad : {"", "x", "-1", "+0", " 0", "0x0", "4294967296"}) refused(cur, bad);
      r.store.set(cur, good_cur);
      for (const char* bad : {"", "2", "2 2", "0 2 -", "2 0 -", "x 2 -", "2 -1 -", "1048577 2 -",
                              "2  2 -", "2 2 - x", "2 2 -\n\n"})
        refused(meta, bad);
      r.store.set(meta, good_meta);
      peers->connect({1}, false);
      EXPECT_EQ(peers->slots().state(1), SlotState::kStaged);
    }
    store_barrier(r.store, "0 connected", r.rank, r.size);
    if (r.rank == 1) peers->connect({0}, false);  // publishes link/1/0
    store_barrier(r.store, "both connected", r.rank, r.size);
    if (r.rank == 0) {
      const std::string link = "mooncake-ep/link/1/0";
      const std::string good = r.store.get(link, 0);
      for (const char* bad : {"", "0 0", "0 0 0", "0 0 1 9", "-1 0 1", "0 0 x", "0 0 -1",
                              "0 0 99999999999999999999", "0  0 1"}) {
        r.store.set(link, bad);
        EXPECT_TRUE(fails_at_once([&] { peers->set_masked(1, false); }, link))
            << link << " = '" << bad << "'";
        EXPECT_EQ(peers->slots().state(1), SlotState::kStaged);
      }
      r.store.set(link, good);
    }
    store_barrier(r.store, "links checked", r.rank, r.size);
    peers->set_masked(other, false);
    EXPECT_EQ(peers->slots().state(other), SlotState::kActive);
    EXPECT_EQ(peers->barrier(5000), (std::vector<uint8_t>{1, 1}));
    store_barrier(r.store, "done", r.rank, r.size);
  });
}

// cur/<slot> holds one number: bytes after it are not ignored.
TEST_P(ElasticRecords, BytesAfterTheCurrentIncarnationAreAnError) {
  const bool tcp = GetParam();
  run_ranks(2, [&](Rank& r) {
    auto peers = make_peers(r, tcp);
    store_barrier(r.store, "created", r.rank, r.size);
    if (r.rank == 0) {
      const std::string cur = "mooncake-ep/cur/1";
      for (const char* bad : {"0 0", "0 x", "0\n\n", "0  "}) {
        r.store.set(cur, bad);
        EXPECT_TRUE(fails_at_once([&] { peers->connect({1}, false); }, cur))
            << cur << " = '" << bad << "'";
        if (peers->slots().state(1) != SlotState::kDisconnected) peers->disconnect({1});
      }
    }
    store_barrier(r.store, "done", r.rank, r.size);
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, ElasticRecords, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "tcp" : "shm");
                         });

}  // namespace
}  // namespace mctest
