// Segment: a zero-filled memfd region with its doorbells in front, which
// another process maps through RemoteMapping and writes into.
#include "transport/segment.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "core/clock.h"
#include "errors.h"
#include "harness.h"

namespace mctest {
namespace {

using mooncake::RemoteMapping;
using mooncake::Segment;

TEST(Segment, ANewSegmentIsZeroFilledAndBackedByItsFd) {
  Segment s(1 << 16);
  EXPECT_EQ(s.size(), 1u << 16);
  for (size_t i = 0; i < s.size(); ++i) ASSERT_EQ(s.base()[i], 0) << "byte " << i;
  struct stat st;
  ASSERT_EQ(::fstat(s.fd(), &st), 0);
  EXPECT_EQ(static_cast<size_t>(st.st_size), s.size());
}

TEST(Segment, OnlyItsOwnerMayOpenIt) {
  Segment s(4096);
  struct stat st;
  ASSERT_EQ(::fstat(s.fd(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::getuid());
}

TEST(Segment, TheDoorbellsAreInTheHeader) {
  Segment s(4096);
  for (int i = 0; i < mooncake::kNumBells; ++i) {
    auto* bell = reinterpret_cast<uint8_t*>(s.bell(i));
    EXPECT_GE(bell, s.base());
    EXPECT_LE(bell + sizeof(mooncake::Doorbell), s.base() + mooncake::kSegmentHeaderBytes);
  }
}

TEST(Segment, ASegmentSmallerThanItsHeaderIsRefused) {
  EXPECT_TRUE(throws_error(mooncake::ErrorKind::kInternal, [] { Segment s(16); }));
}

TEST(Segment, FlagsRoundTrip) {
  Segment s(4096);
  mooncake::store_flag(s.base(), 64, 0x0123456789abcdefull);
  EXPECT_EQ(mooncake::load_flag(s.base(), 64), 0x0123456789abcdefull);
}

TEST(Segment, AnotherProcessMapsItAndWritesIntoIt) {
  run_ranks(2, [](Rank& r) {
    constexpr size_t kBytes = 1 << 20;
    if (r.rank == 0) {
      Segment s(kBytes);
      r.store.set("where", std::to_string(::getpid()) + " " + std::to_string(s.fd()));
      ASSERT_TRUE(mooncake::wait_on(
          s.bell(1), [&] { return mooncake::load_flag(s.base(), 64) == 1; },
          mooncake::Deadline::after_ms(5000)));
      for (size_t i = 128; i < kBytes; ++i)
        ASSERT_EQ(s.base()[i], static_cast<uint8_t>(i * 13)) << "byte " << i;
      store_barrier(r.store, "checked", r.rank, r.size);
    } else {
      int pid = 0, fd = 0;
      std::sscanf(r.store.get("where", 5000).c_str(), "%d %d", &pid, &fd);
      RemoteMapping m(pid, fd, kBytes);
      for (size_t i = 128; i < kBytes; ++i) m.base()[i] = static_cast<uint8_t>(i * 13);
      mooncake::store_flag(m.base(), 64, 1);
      mooncake::ring(&reinterpret_cast<mooncake::SegmentHeader*>(m.base())->bells[1]);
      store_barrier(r.store, "checked", r.rank, r.size);
    }
  });
}

TEST(Segment, MappingTheSegmentOfAProcessThatIsGoneFails) {
  Segment s(4096);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ::waitpid(child, nullptr, 0);  // reaped: its pid names no process now
  EXPECT_TRUE(throws_error(mooncake::ErrorKind::kPeerFailed,
                           [&] { RemoteMapping m(child, s.fd(), s.size()); }));
}

}  // namespace
}  // namespace mctest
