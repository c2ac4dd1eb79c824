// CommConfig is validated once, when the Communicator is built: a chunk size
// that is not a positive multiple of 64 is refused whether it comes from the
// config or from MOONCAKE_CHUNK_BYTES; zero fields come from the environment;
// ranks that disagree on the chunk size cannot connect. (Reading the
// environment itself: tests/cpp/core/comm_config_test.cc.)
#include <gtest/gtest.h>

#include "collectives/communicator.h"
#include "errors.h"
#include "harness.h"
#include "scoped_env.h"

namespace mctest {
namespace {

using mooncake::CommConfig;
using mooncake::Communicator;
using mooncake::ErrorKind;

// A one-rank group in this process.
std::unique_ptr<Communicator> single_rank(const CommConfig& config, int rank = 0, int size = 1) {
  static mooncake::TransferEngine engine(mooncake::EngineOptions{});
  static TempDir dir;
  static mooncake::FileStore store(dir.path());
  static int groups = 0;
  return std::make_unique<Communicator>(engine, store, "g" + std::to_string(++groups) + "/", rank,
                                        size, config);
}

CommConfig with_chunk(size_t chunk_bytes) {
  CommConfig c;
  c.timeout_ms = 2000;
  c.chunk_bytes = chunk_bytes;
  c.small_bytes = 1024;
  return c;
}

TEST(CommConfig, ChunkThatIsAMultipleOf64IsAccepted) {
  for (size_t chunk : {64, 128, 4096})
    EXPECT_EQ(single_rank(with_chunk(chunk))->config().chunk_bytes, chunk);
}

TEST(CommConfig, ChunkThatIsNotAMultipleOf64IsRejectedAtConstruction) {
  for (size_t chunk : {1, 32, 100, 4097})
    EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, [&] { single_rank(with_chunk(chunk)); }))
        << "chunk_bytes " << chunk;
}

TEST(CommConfig, ChunkFromTheEnvironmentThatIsNotAMultipleOf64IsRejected) {
  ScopedEnv env("MOONCAKE_CHUNK_BYTES", "100");
  EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, [] { single_rank(with_chunk(0)); }));
}

TEST(CommConfig, ZeroFieldsComeFromTheEnvironment) {
  ScopedEnv chunk("MOONCAKE_CHUNK_BYTES", "1024");
  ScopedEnv small("MOONCAKE_SMALL_MSG_BYTES", "777");
  CommConfig c;
  c.timeout_ms = 1234;
  auto comm = single_rank(c);
  EXPECT_EQ(comm->config().chunk_bytes, 1024u);
  EXPECT_EQ(comm->config().small_bytes, 777u);
  EXPECT_EQ(comm->config().timeout_ms, 1234);
}

TEST(CommConfig, RankAndSizeAreChecked) {
  EXPECT_TRUE(
      throws_error(ErrorKind::kInvalidArgument, [] { single_rank(with_chunk(256), 0, 0); }));
  EXPECT_TRUE(
      throws_error(ErrorKind::kInvalidArgument, [] { single_rank(with_chunk(256), 1, 1); }));
  EXPECT_TRUE(
      throws_error(ErrorKind::kInvalidArgument, [] { single_rank(with_chunk(256), -1, 1); }));
}

TEST(CommConfig, RanksWithDifferentChunkSizesFailToConnect) {
  run_ranks(2, [](Rank& r) {
    mooncake::TransferEngine engine(mooncake::EngineOptions{});
    EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, [&] {
      Communicator comm(engine, r.store, "g/", r.rank, r.size, with_chunk(r.rank == 0 ? 256 : 512));
    }));
  });
}

}  // namespace
}  // namespace mctest
