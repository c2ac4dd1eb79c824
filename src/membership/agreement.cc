#include "membership/agreement.h"

#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "core/record.h"

namespace mooncake {

std::string Report::encode() const {
  std::ostringstream os;
  os << rank << ' ' << pending << ' ' << done << ' ' << (has_result ? 1 : 0) << ' '
     << (failed ? 1 : 0) << ' ' << attempts;
  return os.str();
}

Report Report::decode(const std::string& text, const std::string& where) {
  RecordReader in(text, "agreement report" + where);
  Report r;
  r.rank = in.number<int>("rank", 0, kMaxCapacity - 1);
  r.pending = in.number<uint64_t>("pending");
  r.done = in.number<uint64_t>("done");
  r.has_result = in.number<int>("has_result", 0, 1) != 0;
  r.failed = in.number<int>("failed", 0, 1) != 0;
  r.attempts = in.number<int>("attempts", 0);
  in.end();
  return r;
}

std::string Decision::encode() const {
  std::string s = view.encode() + "\n";
  for (const Report& r : reports) s += r.encode() + "\n";
  return s;
}

Decision Decision::decode(const std::string& text, const std::string& where) {
  // One line for the view, then one per member in slot order.
  RecordReader whole(text, "agreement decision" + where);
  size_t eol = text.find('\n');
  if (eol == std::string::npos) whole.fail("the view", " has no end of line");
  Decision d;
  d.view = View::decode(text.substr(0, eol), " in the agreement decision" + where);
  for (int member : d.view.members()) {
    const size_t start = eol + 1;
    eol = text.find('\n', start);
    if (eol == std::string::npos) whole.fail("the report of rank ", member, " is missing");
    d.reports.push_back(
        Report::decode(text.substr(start, eol - start), " in the agreement decision" + where));
    if (d.reports.back().rank != member)
      whole.fail("the report", " for rank ", member, " names rank ", d.reports.back().rank);
  }
  if (eol + 1 != text.size())
    whole.fail("the record", " lists more reports than the view's ", d.view.num_members(),
               " members");
  return d;
}

namespace {

// Up to this many members, every member gathers the reports (the first to see
// them all proposes). Past it, that would cost the store members² calls per
// round (about 2.5 million at 1024 ranks: tens of seconds on one TCPStore
// server), so only the lowest member a rank takes for responsive gathers at
// once, and the others look for the decision (up to every kWaitMs) and
// count the reports.
// Once every member they take for responsive has reported (the gatherer
// could decide), the next in line starts gathering kTakeoverMs later, the
// one after it 2 * kTakeoverMs later, the next 4 * kTakeoverMs later, and
// so on: a gatherer that stalls delays the round by kTakeoverMs, and a slow
// round (a loaded host) adds gatherers one doubling at a time, not one per
// kTakeoverMs.
constexpr size_t kEveryoneGathers = 64;
constexpr int64_t kTakeoverMs = 10;
constexpr int64_t kWaitMs = 20;  // the longest a rank not in line sleeps between looks

std::string encode_drop(const std::vector<int>& drop) {
  std::string s = std::to_string(drop.size());
  for (int q : drop) {
    s += ' ';
    s += std::to_string(q);
  }
  return s;
}

// The drop set proposed for the round, as a mask over the view's slots.
std::vector<uint8_t> decode_drop(const std::string& text, const std::string& key, int capacity) {
  RecordReader in(text, "drop set under '" + key + "'");
  const int n = in.number<int>("count", 0, capacity);
  std::vector<uint8_t> mask(static_cast<size_t>(capacity), 0);
  for (int i = 0; i < n; ++i) mask[in.number<int>("rank", 0, capacity - 1)] = 1;
  in.end();
  return mask;
}

}  // namespace

Decision agree_on_view(Store& store, const std::string& prefix, const View& current,
                       const Report& mine, const Probe& responsive, const Deadline& deadline,
                       const std::vector<int>& drop) {
  const std::string base = prefix + "epoch/" + std::to_string(current.epoch) + "/";
  const std::string decision_key = base + "decision";
  const std::string drop_key = base + "drop";
  const std::vector<int> members = current.members();
  const bool in_line = members.size() > kEveryoneGathers;
  // Proposed before the report, so whoever reads the report can read it.
  if (!drop.empty()) store.compare_set(drop_key, encode_drop(drop));
  std::vector<uint8_t> dropped;  // read once proposed; empty: none (yet)
  auto read_drop = [&] {
    if (dropped.empty() && store.check(drop_key))
      dropped = decode_drop(store.get(drop_key, 1000), drop_key, current.capacity());
  };
  auto is_dropped = [&](int q) { return !dropped.empty() && dropped[q] != 0; };
  // Counted before it is posted: a count ahead of the reports only starts
  // the takeover clocks early, while one behind them would stop them.
  if (in_line) store.add(base + "reported", 1);
  store.set(base + "report/" + std::to_string(mine.rank), mine.encode());
  std::vector<std::string> reports(static_cast<size_t>(current.capacity()));
  int64_t settled_us = -1;  // when this rank saw every responsive member's report counted
  int64_t sleep_us = 500;
  int64_t poll_ms = 1;  // a rank not in line to gather: how long it sleeps between looks
  std::string decided;
  for (;;) {
    if (store.check(decision_key)) {
      decided = store.get(decision_key, 1000);
      break;
    }
    if (in_line && !deadline.expired()) {
      int64_t ahead = 0, responsive_members = 0;  // as far as this rank can tell
      read_drop();
      for (int q : members) {
        const bool live = q == mine.rank || (responsive(q) && !is_dropped(q));
        responsive_members += live;
        if (q < mine.rank && live) ++ahead;
      }
      if (ahead > 0 && settled_us < 0 && store.add(base + "reported", 0) >= responsive_members)
        settled_us = now_us();
      const int64_t my_turn_ms =
          ahead == 0 ? 0 : kTakeoverMs << std::min<int64_t>(ahead - 1, 40);  // after settling
      const int64_t wait_ms =
          ahead == 0       ? 0
          : settled_us < 0 ? kWaitMs
                           : std::min(kWaitMs, settled_us / 1000 + my_turn_ms - now_us() / 1000);
      if (wait_ms > 0) {
        // Not in line yet: look for the decision now and then, up to every
        // kWaitMs (each look is a store call; a TCPStore wait that times out
        // would cost as much, and torch logs each such timeout).
        std::this_thread::sleep_for(std::chrono::milliseconds(std::min(wait_ms, poll_ms)));
        poll_ms = std::min(poll_ms * 2, kWaitMs);
        continue;
      }
    }
    bool settled = true;  // every member reported or is out
    read_drop();
    for (int q : members) {
      if (!reports[q].empty() || is_dropped(q)) continue;
      // Probed before the store is read: a member that reports and then dies
      // between the two reads would otherwise count as out, with its report in.
      const bool alive = q == mine.rank || responsive(q);
      const std::string key = base + "report/" + std::to_string(q);
      if (store.check(key)) {
        reports[q] = store.get(key, 1000);
        try {
          const Report r = Report::decode(reports[q], " under '" + key + "'");
          if (r.rank != q)
            throw_error(ErrorKind::kInternal, -1, "malformed agreement report under '", key,
                        "' in the store: it names rank ", r.rank);
        } catch (const Error&) {
          // A decision made while this rank read the record stands for
          // everyone (one who decided never read it): adopt it, so that a bad
          // record that arrived late cannot split the survivors.
          if (!store.check(decision_key)) throw;
          decided = store.get(decision_key, 1000);
          break;
        }
        continue;
      }
      if (!alive) continue;
      settled = false;
    }
    if (!decided.empty()) break;
    if (settled || deadline.expired()) {
      // Again: a proposal made after the last look came before the reports read since.
      read_drop();
      Decision d;
      d.view = current;
      d.view.epoch = current.epoch + 1;
      for (int q : members) {
        if (is_dropped(q)) reports[q].clear();
        d.view.active[q] = !reports[q].empty();
        d.view.since[q] = d.view.epoch;  // abandoned ops: every channel restarts
        if (!reports[q].empty()) d.reports.push_back(Report::decode(reports[q]));
      }
      decided = store.compare_set(decision_key, d.encode());
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min<int64_t>(sleep_us * 2, 5000);
  }
  Decision d = Decision::decode(decided, " under '" + decision_key + "'");
  if (d.view.capacity() != current.capacity() || d.view.epoch != current.epoch + 1)
    throw_error(ErrorKind::kInternal, -1, "malformed agreement decision under '", decision_key,
                "' in the store: epoch ", d.view.epoch, " with ", d.view.capacity(),
                " slots, expected epoch ", current.epoch + 1, " with ", current.capacity());
  if (!d.view.is_member(mine.rank)) read_drop();
  if (!d.view.is_member(mine.rank) && is_dropped(mine.rank))
    throw_error(ErrorKind::kLeftOut, mine.rank, "rank ", mine.rank,
                " was left out of the group by the other ranks at epoch ", current.epoch,
                ": they removed it with deactivate_ranks; it can rejoin as a new process with "
                "is_extension=True");
  if (!d.view.is_member(mine.rank))
    throw_error(ErrorKind::kLeftOut, mine.rank, "rank ", mine.rank,
                " was left out of the group by the other ranks at epoch ", current.epoch,
                " (they took it for failed: it was silent past their deadline); it can rejoin "
                "as a new process with is_extension=True");
  MC_LOG(kInfo, "membership: epoch ", d.view.epoch, " members ", d.view.describe());
  return d;
}

}  // namespace mooncake
