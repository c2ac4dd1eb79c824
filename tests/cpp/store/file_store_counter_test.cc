// FileStore::add on a counter that is not a whole decimal integer: the add
// fails with a kInternal Error naming the key, leaves the value as it was,
// and releases the key's lock, so that adds on other keys, and on the same
// key once it is right again, go on (a lock left held would block them: the
// run's time limit turns that into a failure).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "errors.h"
#include "harness.h"
#include "store/store.h"

namespace mctest {
namespace {

using mooncake::ErrorKind;

TEST(FileStoreCounter, AMalformedCounterIsAnErrorAndReleasesTheLock) {
  run_ranks(
      2,
      [](Rank& r) {
        const std::vector<std::string> bad = {"",
                                              "x",
                                              "1.5",
                                              "+1",
                                              " 1",
                                              "1x",
                                              "0x10",
                                              "--1",
                                              "99999999999999999999",
                                              "-9223372036854775809"};
        if (r.rank == 0) {
          int64_t others = 0;
          for (const std::string& value : bad) {
            r.store.set("c", value);
            EXPECT_TRUE(throws_error(
                ErrorKind::kInternal, [&] { r.store.add("c", 1); },
                "malformed counter under 'c' in the store: value"))
                << "'" << value << "'";
            EXPECT_EQ(r.store.get("c", 0), value) << "the failed add changed the value";
            EXPECT_EQ(r.store.add("other", 1), ++others);
          }
          r.store.set("c", "41");
          EXPECT_EQ(r.store.add("c", 1), 42);
          r.store.set("c", "-7\n");  // one trailing newline is allowed
          EXPECT_EQ(r.store.add("c", 7), 0);
          r.store.set("c", "x");
          EXPECT_TRUE(throws_error(ErrorKind::kInternal, [&] { r.store.add("c", 1); }));
        }
        // The other process takes the same key's lock after rank 0's failures.
        store_barrier(r.store, "spoilt", r.rank, r.size);
        if (r.rank == 1) {
          r.store.set("c", "100");
          EXPECT_EQ(r.store.add("c", 5), 105);
        }
      },
      RunLimits{10000, 2000});
}

// A counter is one number: bytes after it are not ignored.
TEST(FileStoreCounter, BytesAfterTheNumberAreAnError) {
  TempDir dir;
  mooncake::FileStore store(dir.path() + "/store");
  for (const std::string value : {"1 2", "5 junk", "7\n\n", "3  ", "8\nx"}) {
    store.set("c", value);
    EXPECT_TRUE(throws_error(
        ErrorKind::kInternal, [&] { store.add("c", 1); }, "malformed counter under 'c'"))
        << "'" << value << "'";
    EXPECT_EQ(store.get("c", 0), value);
  }
}

}  // namespace
}  // namespace mctest
