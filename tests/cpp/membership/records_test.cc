// The membership and address records that ranks leave in the store: View,
// Report, Decision and PeerAddress round-trip through their text, and any
// text that is not a whole, well-formed record (truncated at any byte, a
// field out of range, bytes left over, a decision whose reports are not the
// view's members in slot order) is a kInternal Error naming the record.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "core/limits.h"
#include "errors.h"
#include "membership/agreement.h"
#include "membership/view.h"
#include "transport/engine.h"
#include "transport/link.h"
#include "transport/segment.h"

namespace mctest {
namespace {

using mooncake::Decision;
using mooncake::ErrorKind;
using mooncake::kMaxCapacity;
using mooncake::PeerAddress;
using mooncake::Report;
using mooncake::View;

// A view of `capacity` slots with a mix of members, incarnations and epochs,
// extreme values included.
View sample_view(int capacity) {
  View v;
  v.epoch = 0xfedcba9876543210ull + static_cast<uint64_t>(capacity);
  v.seq = std::numeric_limits<uint64_t>::max() - 1;
  for (int r = 0; r < capacity; ++r) {
    v.active.push_back(static_cast<uint8_t>(r % 3 != 1));
    v.incarnation.push_back(r == capacity - 1 ? std::numeric_limits<uint32_t>::max()
                                              : static_cast<uint32_t>(r * 7 % 5));
    v.since.push_back(r == 0 ? std::numeric_limits<uint64_t>::max()
                             : static_cast<uint64_t>(r) * 1000003);
  }
  // The last field is long, so that truncations inside it are many.
  v.since.back() = 9876543210123ull;
  return v;
}

Report sample_report(int rank) {
  Report r;
  r.rank = rank;
  r.pending = 1000 + static_cast<uint64_t>(rank);
  r.done = 999 + static_cast<uint64_t>(rank);
  r.has_result = rank % 2 == 0;
  r.failed = rank % 3 == 0;
  r.attempts = 123456 + rank;
  return r;
}

Decision sample_decision(int capacity) {
  Decision d;
  d.view = sample_view(capacity);
  for (int m : d.view.members()) d.reports.push_back(sample_report(m));
  return d;
}

// Equal records, or both encodings in the failure message.
template <typename Record>
void expect_same(const Record& a, const Record& b) {
  EXPECT_TRUE(a == b) << "\n  " << a.encode() << "\nvs\n  " << b.encode();
}

// The fields of a record, split at single spaces and newlines.
std::vector<std::string> fields_of(const std::string& text) {
  std::vector<std::string> out(1);
  for (char c : text) {
    if (c == ' ' || c == '\n')
      out.emplace_back();
    else
      out.back() += c;
  }
  return out;
}

// `text` with field `i` replaced by `value` (spaces between fields).
std::string with_field(const std::string& text, size_t i, const std::string& value) {
  std::vector<std::string> f = fields_of(text);
  f.at(i) = value;
  std::string out;
  for (size_t k = 0; k < f.size(); ++k) out += (k ? " " : "") + f[k];
  return out;
}

const std::vector<int>& capacities() {
  static const std::vector<int> c = {1, 2, 3, 8, 1000};
  return c;
}

// ---------------------------------------------------------------- View

TEST(ViewRecord, RoundTrips) {
  for (int capacity : capacities()) {
    const View v = sample_view(capacity);
    SCOPED_TRACE("capacity " + std::to_string(capacity));
    expect_same(View::decode(v.encode()), v);
    expect_same(View::decode(v.encode() + "\n"), v);  // one trailing separator
    expect_same(View::decode(View::decode(v.encode()).encode()), v);
  }
  const View initial = View::initial(3, 5);
  expect_same(View::decode(initial.encode()), initial);
}

TEST(ViewRecord, TheLargestCapacityRoundTrips) {
  const View v = View::initial(2, kMaxCapacity);
  const View back = View::decode(v.encode());
  EXPECT_EQ(back.capacity(), kMaxCapacity);
  EXPECT_EQ(back.members(), (std::vector<int>{0, 1}));
}

// Every prefix of a view's text is an error, except those that end inside
// the last field (the last slot's `since`): cut digits there still make a
// whole record, of a smaller number. No other cut can: the record needs
// 3 + 3 * capacity fields and the capacity comes before any cut slot.
TEST(ViewRecord, EveryTruncationIsAnErrorOrAShorterLastNumber) {
  for (int capacity : capacities()) {
    const View v = sample_view(capacity);
    const std::string text = v.encode();
    const size_t last = text.rfind(' ') + 1;  // where the last field starts
    for (size_t n = 0; n < text.size(); ++n) {
      const std::string prefix = text.substr(0, n);
      if (n > last) {
        View cut = v;
        cut.since.back() = std::stoull(text.substr(last, n - last));
        View got;
        ASSERT_NO_THROW(got = View::decode(prefix)) << "capacity " << capacity << ", " << n;
        expect_same(got, cut);
      } else {
        ASSERT_TRUE(throws_error(
            ErrorKind::kInternal, [&] { View::decode(prefix, " under 'g/view'"); },
            "malformed group view under 'g/view' in the store: "))
            << "capacity " << capacity << ", prefix of " << n << " bytes: '" << prefix << "'";
      }
    }
  }
}

TEST(ViewRecord, ActiveMustBeZeroOrOne) {
  const std::string text = sample_view(3).encode();
  for (const char* bad : {"2", "-1", "255", "256", "x", "1.0", "+1"})
    EXPECT_TRUE(throws_error(
        ErrorKind::kInternal, [&] { View::decode(with_field(text, 3 + 3 * 1, bad), " under 'v'"); },
        "malformed group view under 'v' in the store: active"))
        << bad;
  for (const char* good : {"0", "1"})
    EXPECT_NO_THROW(View::decode(with_field(text, 3 + 3 * 1, good))) << good;
}

TEST(ViewRecord, TheCapacityMustBeBetweenOneAndTheMaximum) {
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal, [] { View::decode("0 0 0", " under 'v'"); },
      "malformed group view under 'v' in the store: capacity is 0, outside [1, 1048576]"));
  EXPECT_TRUE(throws_error(ErrorKind::kInternal, [] { View::decode("0 0 -1 1 0 0"); }, "capacity"));
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal,
      [] { View::decode("0 0 " + std::to_string(kMaxCapacity + 1) + " 1 0 0"); },
      "capacity is " + std::to_string(kMaxCapacity + 1) + ", outside"));
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal, [] { View::decode("0 0 99999999999999999999 1 0 0"); }, "capacity"));
  // A capacity that promises more slots than the text holds.
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal, [] { View::decode("0 0 1048576 1 0 0"); }, "active is missing"));
  EXPECT_NO_THROW(View::decode("0 0 1 1 0 0"));
}

TEST(ViewRecord, OtherFieldsOutsideTheirTypeAreErrors) {
  const std::string text = sample_view(2).encode();
  // epoch, seq, then slot 0's incarnation and since.
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal, [&] { View::decode(with_field(text, 0, "-1")); }, "epoch"));
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal, [&] { View::decode(with_field(text, 1, "18446744073709551616")); },
      "seq"));
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal, [&] { View::decode(with_field(text, 4, "4294967296")); },
      "incarnation"));
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal, [&] { View::decode(with_field(text, 5, "-3")); }, "since"));
}

TEST(ViewRecord, TrailingBytesAreAnError) {
  const std::string text = sample_view(3).encode();
  for (const char* tail : {" ", "\n"}) EXPECT_NO_THROW(View::decode(text + tail)) << tail;
  for (const char* tail : {"  ", "\n\n", " 0", " 1 0 0", "\nx", " \n"})
    EXPECT_TRUE(throws_error(
        ErrorKind::kInternal, [&] { View::decode(text + tail, " under 'v'"); },
        "malformed group view under 'v' in the store: the record has"))
        << '\'' << tail << '\'';
  // Digits glued to the last field make it another number, or not one at all.
  EXPECT_TRUE(
      throws_error(ErrorKind::kInternal, [&] { View::decode(text + "x"); }, "since is not a"));
}

// ---------------------------------------------------------------- Report

TEST(ReportRecord, RoundTrips) {
  for (int rank : {0, 1, 2, 3, 6, kMaxCapacity - 1}) {
    const Report r = sample_report(rank);
    expect_same(Report::decode(r.encode()), r);
  }
  Report extreme;
  extreme.rank = 0;
  extreme.pending = std::numeric_limits<uint64_t>::max();
  extreme.done = 0;
  extreme.attempts = std::numeric_limits<int>::max();
  expect_same(Report::decode(extreme.encode()), extreme);
}

TEST(ReportRecord, EveryTruncationIsAnErrorOrAShorterLastNumber) {
  const Report r = sample_report(5);
  const std::string text = r.encode();
  const size_t last = text.rfind(' ') + 1;  // `attempts`
  for (size_t n = 0; n < text.size(); ++n) {
    const std::string prefix = text.substr(0, n);
    if (n > last) {
      Report cut = r;
      cut.attempts = std::stoi(text.substr(last, n - last));
      Report got;
      ASSERT_NO_THROW(got = Report::decode(prefix)) << n;
      expect_same(got, cut);
    } else {
      ASSERT_TRUE(throws_error(
          ErrorKind::kInternal, [&] { Report::decode(prefix, " under 'r'"); },
          "malformed agreement report under 'r' in the store: "))
          << "prefix of " << n << " bytes: '" << prefix << "'";
    }
  }
}

TEST(ReportRecord, FieldsOutsideTheirRangeAreErrors) {
  const std::string text = sample_report(2).encode();
  struct Case {
    size_t field;
    const char* value;
    const char* name;
  };
  for (const Case& c : std::vector<Case>{{0, "-1", "rank"},
                                         {0, "1048576", "rank"},
                                         {1, "-1", "pending"},
                                         {2, "x", "done"},
                                         {3, "2", "has_result"},
                                         {4, "-1", "failed"},
                                         {5, "-1", "attempts"},
                                         {5, "2147483648", "attempts"}})
    EXPECT_TRUE(throws_error(
        ErrorKind::kInternal, [&] { Report::decode(with_field(text, c.field, c.value)); },
        std::string("malformed agreement report in the store: ") + c.name))
        << c.name << " = " << c.value;
  EXPECT_TRUE(
      throws_error(ErrorKind::kInternal, [&] { Report::decode(text + " 7"); }, "the record has"));
}

// ---------------------------------------------------------------- Decision

TEST(DecisionRecord, RoundTrips) {
  for (int capacity : capacities()) {
    const Decision d = sample_decision(capacity);
    SCOPED_TRACE("capacity " + std::to_string(capacity));
    const Decision back = Decision::decode(d.encode());
    expect_same(back.view, d.view);
    ASSERT_EQ(back.reports.size(), d.reports.size());
    for (size_t i = 0; i < d.reports.size(); ++i) expect_same(back.reports[i], d.reports[i]);
  }
}

TEST(DecisionRecord, AViewWithoutMembersHasNoReports) {
  Decision d;
  d.view = View::initial(1, 4);
  d.view.active[0] = 0;
  const Decision back = Decision::decode(d.encode());
  EXPECT_TRUE(back.view.members().empty());
  EXPECT_TRUE(back.reports.empty());
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal,
      [&] { Decision::decode(d.encode() + sample_report(0).encode() + "\n"); },
      "lists more reports than the view's 0 members"));
}

// A decision's text ends with the newline after its last report (or after
// the view, without members): every proper prefix lacks that newline, so
// none is a whole decision.
TEST(DecisionRecord, EveryTruncationIsAnError) {
  for (int capacity : {1, 3, 8}) {
    const std::string text = sample_decision(capacity).encode();
    ASSERT_EQ(text.back(), '\n');
    for (size_t n = 0; n < text.size(); ++n)
      ASSERT_TRUE(throws_error(
          ErrorKind::kInternal, [&] { Decision::decode(text.substr(0, n), " under 'd'"); },
          "under 'd'"))
          << "capacity " << capacity << ", prefix of " << n << " bytes";
  }
}

// The text of a decision on `view` with reports for `ranks`, in that order.
std::string decision_text(const View& view, const std::vector<int>& ranks) {
  std::string s = view.encode() + "\n";
  for (int r : ranks) s += sample_report(r).encode() + "\n";
  return s;
}

TEST(DecisionRecord, TheReportsMustBeTheMembersInSlotOrder) {
  View v = View::initial(4, 6);
  v.active[1] = 0;  // members 0, 2, 3
  ASSERT_NO_THROW(Decision::decode(decision_text(v, {0, 2, 3})));
  const std::string in = "malformed agreement decision under 'g/epoch/4/decision' in the store: ";
  struct Case {
    std::vector<int> ranks;
    std::string error;
  };
  const std::vector<Case> cases = {
      {{}, "the report of rank 0 is missing"},
      {{0, 2}, "the report of rank 3 is missing"},
      {{0, 2, 3, 3}, "the record lists more reports than the view's 3 members"},
      {{0, 2, 3, 1}, "the record lists more reports"},
      {{0, 3, 2}, "the report for rank 2 names rank 3"},
      {{2, 0, 3}, "the report for rank 0 names rank 2"},
      {{0, 1, 3}, "the report for rank 2 names rank 1"},  // not a member
      {{0, 0, 2}, "the report for rank 2 names rank 0"},
      {{0, 2, 4}, "the report for rank 3 names rank 4"},
  };
  for (const Case& c : cases)
    EXPECT_TRUE(throws_error(
        ErrorKind::kInternal,
        [&] { Decision::decode(decision_text(v, c.ranks), " under 'g/epoch/4/decision'"); },
        in + c.error))
        << testing::PrintToString(c.ranks);
}

TEST(DecisionRecord, MalformedLinesAreErrors) {
  View v = View::initial(2, 2);
  const std::string good = decision_text(v, {0, 1});
  ASSERT_NO_THROW(Decision::decode(good));
  const std::vector<std::string> bad = {
      "",           // nothing
      v.encode(),   // no end of line
      good + "\n",  // an empty line more
      good + "x",   // bytes after the last line
      "\n" + good,  // an empty view line
      v.encode() + "\n" + "0 1 2 1 0 0 9\n" + sample_report(1).encode() + "\n",  // long report
      v.encode() + "\n" + "0 1 2 1 0\n" + sample_report(1).encode() + "\n",      // short report
      v.encode() + "\n\n" + sample_report(0).encode() + "\n" + sample_report(1).encode() + "\n",
      "0 0 2 1 0 0 1 0 0 7\n" + sample_report(0).encode() + "\n",  // a view with a field more
  };
  for (const std::string& text : bad)
    EXPECT_TRUE(throws_error(
        ErrorKind::kInternal, [&] { Decision::decode(text, " under 'd'"); }, "under 'd'"))
        << '\'' << text << '\'';
}

// ---------------------------------------------------------------- PeerAddress

PeerAddress sample_address() {
  PeerAddress a;
  a.rank = 5;
  a.incarnation = 7;
  a.host_key = mooncake::local_host_key();
  a.pid = 4242;
  a.segment_fd = 17;
  a.segment_bytes = uint64_t{1} << 30;
  a.tcp_host = "10.0.0.7";
  a.ucx_address = "0a1b2c";
  a.tcp_port = 65000;
  return a;
}

// The address's text with line `i` (0-based: rank, incarnation, host_key,
// pid, segment_fd, segment_bytes, tcp_host, ucx_address, tcp_port) replaced.
std::string with_line(const PeerAddress& a, size_t i, const std::string& value) {
  std::vector<std::string> lines;
  std::istringstream in(a.encode());
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  lines.at(i) = value;
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

TEST(PeerAddressRecord, RoundTrips) {
  const PeerAddress a = sample_address();
  expect_same(PeerAddress::decode(a.encode()), a);
  PeerAddress tcp_only = a;
  tcp_only.segment_fd = -1;
  tcp_only.incarnation = std::numeric_limits<uint32_t>::max();
  tcp_only.rank = kMaxCapacity - 1;
  tcp_only.segment_bytes = mooncake::kSegmentHeaderBytes;
  tcp_only.tcp_port = 1;
  tcp_only.host_key = std::string(512, 'h');
  tcp_only.tcp_host = std::string(255, 't');
  tcp_only.ucx_address = "-";
  expect_same(PeerAddress::decode(tcp_only.encode()), tcp_only);
  // Fields may be separated by spaces too, and the final newline is optional.
  std::string spaced = a.encode();
  spaced.pop_back();
  for (char& c : spaced)
    if (c == '\n') c = ' ';
  expect_same(PeerAddress::decode(spaced), a);
}

// The text ends with a newline after the port: prefixes that end inside the
// port (or lack just that newline) are whole records with a shorter port;
// every other prefix misses a field.
TEST(PeerAddressRecord, EveryTruncationIsAnErrorOrAShorterPort) {
  const PeerAddress a = sample_address();
  const std::string text = a.encode();
  const size_t last = text.rfind('\n', text.size() - 2) + 1;  // where the port starts
  for (size_t n = 0; n < text.size(); ++n) {
    const std::string prefix = text.substr(0, n);
    if (n > last) {
      PeerAddress cut = a;
      cut.tcp_port = std::stoi(text.substr(last, n - last));
      ASSERT_GE(cut.tcp_port, 1);
      PeerAddress got;
      ASSERT_NO_THROW(got = PeerAddress::decode(prefix)) << n;
      expect_same(got, cut);
    } else {
      ASSERT_TRUE(throws_error(
          ErrorKind::kInternal, [&] { PeerAddress::decode(prefix, " under 'ep/addr/5/7'"); },
          "malformed peer address under 'ep/addr/5/7' in the store: "))
          << "prefix of " << n << " bytes: '" << prefix << "'";
    }
  }
}

TEST(PeerAddressRecord, FieldsOutsideTheirRangeAreErrors) {
  const PeerAddress a = sample_address();
  struct Case {
    size_t line;
    std::string value;
    std::string error;
  };
  const std::vector<Case> cases = {
      {0, "-1", "rank is not a non-negative integer"},
      {0, "1048576", "rank is 1048576, outside [0, 1048575]"},
      {1, "-1", "incarnation is not a non-negative integer"},
      {1, "4294967296", "incarnation is not a"},
      {2, std::string(513, 'h'), "host_key is longer than 512 bytes"},
      {2, "", "host_key is missing"},
      {2, "two words", "pid is not a"},  // the host key ends at the space
      {3, "0", "pid is 0, outside [1, "},
      {3, "-5", "pid is not a non-negative integer"},
      {4, "-2", "segment_fd is -2, outside [-1, "},
      {5, "127", "segment_bytes is 127, outside [128, "},
      {5, "0", "segment_bytes is 0, outside [128, "},
      {5, "-128", "segment_bytes is not a non-negative integer"},
      {6, std::string(256, 't'), "tcp_host is longer than 255 bytes"},
      {6, "", "tcp_host is missing"},
      {7, std::string(65537, 'a'), "ucx_address is longer than 65536 bytes"},
      {8, "0", "tcp_port is 0, outside [1, 65535]"},
      {8, "65536", "tcp_port is 65536, outside [1, 65535]"},
      {8, "-1", "tcp_port is not a non-negative integer"},
      {8, "80x", "tcp_port is not a"},
  };
  for (const Case& c : cases)
    EXPECT_TRUE(throws_error(
        ErrorKind::kInternal,
        [&] { PeerAddress::decode(with_line(a, c.line, c.value), " under 'ep/addr/5/7'"); },
        "malformed peer address under 'ep/addr/5/7' in the store: " + c.error))
        << "line " << c.line << " = '" << c.value << "'";
}

TEST(PeerAddressRecord, TheLimitsOfEachRangeAreAccepted) {
  const PeerAddress a = sample_address();
  EXPECT_EQ(PeerAddress::decode(with_line(a, 3, "1")).pid, 1);
  EXPECT_EQ(PeerAddress::decode(with_line(a, 4, "-1")).segment_fd, -1);
  EXPECT_EQ(PeerAddress::decode(with_line(a, 5, "128")).segment_bytes, 128u);
  EXPECT_EQ(PeerAddress::decode(with_line(a, 8, "65535")).tcp_port, 65535);
  EXPECT_EQ(PeerAddress::decode(with_line(a, 8, "1")).tcp_port, 1);
  EXPECT_EQ(PeerAddress::decode(with_line(a, 0, "1048575")).rank, kMaxCapacity - 1);
}

TEST(PeerAddressRecord, TrailingBytesAreAnError) {
  const std::string text = sample_address().encode();
  for (const char* tail : {"\n", " ", "1\n", "x", "\n\n"})
    EXPECT_TRUE(throws_error(
        ErrorKind::kInternal, [&] { PeerAddress::decode(text + tail, " under 'a'"); },
        "malformed peer address under 'a' in the store: "))
        << '\'' << tail << '\'';
}

}  // namespace
}  // namespace mctest
