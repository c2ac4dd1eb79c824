// agree_on_view over a store: members that report make the next view; a member
// that did not report in time is left out, and learns so with a kLeftOut error
// naming itself (not a peer failure: nothing is left to recover with).
#include "membership/agreement.h"

#include <gtest/gtest.h>

#include "core/clock.h"
#include "core/error.h"
#include "harness.h"
#include "store/store.h"

namespace mctest {
namespace {

using mooncake::Deadline;
using mooncake::Decision;
using mooncake::Error;
using mooncake::ErrorKind;
using mooncake::Report;
using mooncake::View;

Report report_of(int rank) {
  Report r;
  r.rank = rank;
  r.pending = 3;
  r.done = 2;
  return r;
}

TEST(Agreement, AMemberThatDidNotReportInTimeIsLeftOutAndLearnsSoAsLeftOut) {
  TempDir dir;
  mooncake::FileStore store(dir.path() + "/store");
  const View current = View::initial(3, 3);
  auto everyone_responsive = [](int) { return true; };
  // Rank 0 reports; ranks 1 and 2 do not before its deadline passes.
  const Decision d = mooncake::agree_on_view(store, "g/", current, report_of(0),
                                             everyone_responsive, Deadline::after_ms(50));
  EXPECT_EQ(d.view.epoch, 1u);
  EXPECT_EQ(d.view.members(), std::vector<int>{0});
  // Rank 2 comes late: the decision is made without it.
  try {
    mooncake::agree_on_view(store, "g/", current, report_of(2), everyone_responsive,
                            Deadline::after_ms(1000));
    ADD_FAILURE() << "a rank the decision leaves out got a view";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kLeftOut) << e.what();
    EXPECT_EQ(e.peer(), 2) << e.what();
    EXPECT_FALSE(e.peer_or_timeout()) << "a left-out rank has nothing to recover from";
    EXPECT_NE(std::string(e.what()).find("left out"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("is_extension=True"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mctest
