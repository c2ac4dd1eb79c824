// Survivors agree on the next view through the store, with deadlines and no
// leader: the death of any rank, rank 0 included, blocks no one.
//
// A member whose op failed posts a Report under <prefix>epoch/<e>/report/<rank>
// and waits. Whoever first sees every member of the current view either
// reported, gone (process exited, connection closed) or silent (heartbeat
// standing still for `silence_ms`: a stopped process) proposes the reporters
// as the next view with one compare_set on <prefix>epoch/<e>/decision. The
// first proposal wins and everyone adopts it. Members that have not reported
// when the deadline passes are left out. (Silence is judged by the transport's
// heartbeats: see Endpoint::silent_ms.)
//
// In views of more than 64 members not everyone reads every report (that is
// members² store calls a round): the lowest responsive member gathers, the
// next ones in line take over one after another if it stalls, and the rest
// wait for the decision (agreement.cc says how; tests/cpp/membership/
// agreement_scale_test.cc runs 1024 ranks).
//
// A record that cannot be read (a bug, or a store written by something else)
// is a kInternal error naming its key for everyone who reads it, unless a
// decision exists by then: that decision stands, and everyone adopts it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/clock.h"
#include "membership/view.h"
#include "store/store.h"

namespace mooncake {

// What a member says about itself when one of its ops failed.
struct Report {
  int rank = -1;
  uint64_t pending = 0;     // the op it could not complete
  uint64_t done = 0;        // the last op it completed
  bool has_result = false;  // it kept the result of op `done`, to hand on
  bool failed = false;      // op `done` ended in an error
  int attempts = 0;         // re-runs of op `pending` so far
  friend bool operator==(const Report&, const Report&) = default;
  std::string encode() const;
  // Throws an Error (kInternal) naming the field when `text` is malformed;
  // `where` (e.g. " under 'key'") goes into the message.
  static Report decode(const std::string& text, const std::string& where = "");
};

// The outcome of one round: the next view (epoch + 1) and the report of each
// of its members, in slot order.
struct Decision {
  View view;
  std::vector<Report> reports;
  friend bool operator==(const Decision&, const Decision&) = default;
  std::string encode() const;
  // Also checks that the reports are the view's members, in slot order.
  static Decision decode(const std::string& text, const std::string& where = "");
};

// Whether a member may still report: false once its process is gone or has
// been silent (heartbeat standing still) past the hang limit.
using Probe = std::function<bool(int)>;

// Runs one round of agreement for `current.epoch`. Throws a kLeftOut Error
// (peer: this rank) when the decision leaves this rank out (it was taken for
// dead, or dropped).
//
// `drop` (deactivate_ranks): members to leave out whether or not they report.
// The first non-empty set proposed for the epoch wins (<prefix>epoch/<e>/drop,
// written before the report); nobody waits for its members, and the decision
// leaves them out.
Decision agree_on_view(Store& store, const std::string& prefix, const View& current,
                       const Report& mine, const Probe& responsive, const Deadline& deadline,
                       const std::vector<int>& drop = {});

}  // namespace mooncake
