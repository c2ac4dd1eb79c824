#include "membership/agreement.h"

#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace mooncake {

std::string Report::encode() const {
  std::ostringstream os;
  os << rank << ' ' << pending << ' ' << done << ' ' << (has_result ? 1 : 0) << ' '
     << (failed ? 1 : 0) << ' ' << attempts;
  return os.str();
}

Report Report::decode(const std::string& text) {
  std::istringstream is(text);
  Report r;
  int has = 0, failed = 0;
  is >> r.rank >> r.pending >> r.done >> has >> failed >> r.attempts;
  if (!is) throw_error(ErrorKind::kInternal, -1, "malformed agreement report: '", text, "'");
  r.has_result = has != 0;
  r.failed = failed != 0;
  return r;
}

std::string Decision::encode() const {
  std::string s = view.encode() + "\n";
  for (const Report& r : reports) s += r.encode() + "\n";
  return s;
}

Decision Decision::decode(const std::string& text) {
  std::istringstream is(text);
  std::string line;
  Decision d;
  if (!std::getline(is, line))
    throw_error(ErrorKind::kInternal, -1, "malformed agreement decision: '", text, "'");
  d.view = View::decode(line);
  while (std::getline(is, line))
    if (!line.empty()) d.reports.push_back(Report::decode(line));
  if (static_cast<int>(d.reports.size()) != d.view.num_members())
    throw_error(ErrorKind::kInternal, -1, "agreement decision lists ", d.reports.size(),
                " reports for ", d.view.num_members(), " members");
  return d;
}

Decision agree_on_view(Store& store, const std::string& prefix, const View& current,
                       const Report& mine, const Probe& responsive, const Deadline& deadline) {
  const std::string base = prefix + "epoch/" + std::to_string(current.epoch) + "/";
  const std::string decision_key = base + "decision";
  store.set(base + "report/" + std::to_string(mine.rank), mine.encode());
  const std::vector<int> members = current.members();
  std::vector<std::string> reports(static_cast<size_t>(current.capacity()));
  int64_t sleep_us = 500;
  std::string decided;
  for (;;) {
    if (store.check(decision_key)) {
      decided = store.get(decision_key, 1000);
      break;
    }
    bool settled = true;  // every member reported or is out
    for (int q : members) {
      if (!reports[q].empty()) continue;
      const std::string key = base + "report/" + std::to_string(q);
      if (store.check(key)) {
        reports[q] = store.get(key, 1000);
        continue;
      }
      if (q != mine.rank && !responsive(q)) continue;
      settled = false;
    }
    if (settled || deadline.expired()) {
      Decision d;
      d.view = current;
      d.view.epoch = current.epoch + 1;
      for (int q : members) {
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
  Decision d = Decision::decode(decided);
  if (!d.view.is_member(mine.rank))
    throw_error(ErrorKind::kPeerFailed, mine.rank, "rank ", mine.rank,
                " was left out of the group by the other ranks at epoch ", current.epoch,
                " (they took it for failed: it was silent past their deadline); it can rejoin "
                "as a new process with is_extension=True");
  MC_LOG(kInfo, "membership: epoch ", d.view.epoch, " members ", d.view.describe());
  return d;
}

}  // namespace mooncake
