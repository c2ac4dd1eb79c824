// The check shared by the mismatch tests: an op is rejected with an
// invalid-argument error on this rank, and the group still works afterwards.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "collectives/communicator.h"
#include "errors.h"
#include "harness.h"

namespace mctest {

// Runs `op`, which must fail with kInvalidArgument on this rank; then, once
// every rank has returned from it (so the next op cannot be confused with
// it), proves the group usable with an all_reduce on both algorithms.
inline void expect_rejected_then_usable(mooncake::Communicator& comm, Rank& r,
                                        const std::function<void()>& op, const std::string& what) {
  EXPECT_TRUE(throws_error(mooncake::ErrorKind::kInvalidArgument, op))
      << what << ", on rank " << r.rank;
  static int calls = 0;  // the same sequence on every rank: a fresh barrier per call
  store_barrier(r.store, "rejected#" + std::to_string(++calls), r.rank, r.size);
  for (size_t count : {size_t{3}, size_t{1000}}) {
    std::vector<int64_t> data(count, r.rank + 1);
    try {
      comm.all_reduce(data.data(), count, mooncake::DType::kInt64, mooncake::RedOp::kSum);
    } catch (const mooncake::Error& e) {
      ADD_FAILURE() << "the group is unusable after " << what << ": rank " << r.rank << ": "
                    << e.what();
      return;
    }
    const int64_t want = static_cast<int64_t>(r.size) * (r.size + 1) / 2;
    EXPECT_EQ(data.front(), want) << "after " << what;
    EXPECT_EQ(data.back(), want) << "after " << what;
  }
}

}  // namespace mctest
