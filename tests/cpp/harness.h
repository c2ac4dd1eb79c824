// Runs a test body as N ranks, each in its own forked process, the way the
// library's ranks are deployed. The ranks share a FileStore in a fresh
// temporary directory. A rank fails when its body throws or records a gtest
// failure; the parent reports each failed rank's message, and kills every rank
// still running once the time limit passes (or shortly after a rank failed,
// since its peers may then wait for it until their own timeouts).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "store/store.h"

namespace mctest {

// A directory under /tmp, removed with everything in it when this goes away.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// What one rank's body gets.
struct Rank {
  int rank;
  int size;
  mooncake::Store& store;  // shared by every rank of the run
  std::string dir;         // the run's scratch directory
};

struct RunLimits {
  int64_t timeout_ms = 20000;  // the whole run
  int64_t grace_ms = 3000;     // how long the others may go on after a rank failed
};

// Forks `size` ranks that each run `body`, waits for all of them (bounded by
// `limits`) and records a gtest failure for every rank that failed.
void run_ranks(int size, const std::function<void(Rank&)>& body, RunLimits limits = {});

// Leaves the current rank at once, successfully, without running destructors:
// the process is gone, as after a crash, while the run still counts it as passed.
[[noreturn]] void exit_rank_abruptly();

// Fails the current rank at once with `message`, without running destructors:
// for a rank stuck in a way its destructors would not survive (a deadlock).
[[noreturn]] void fail_rank_now(const std::string& message);

// Blocks until every rank of the run has reached the barrier called `name`.
void store_barrier(mooncake::Store& store, const std::string& name, int rank, int size,
                   int64_t timeout_ms = 10000);

}  // namespace mctest
