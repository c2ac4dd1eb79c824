// libFuzzer target: the text records that ranks read from the store (peer
// addresses, group views, agreement reports and decisions), as a truncated,
// stale or hostile member could leave them.
//
// Input: one byte choosing the record, then its text. Checks, beyond
// ASan/UBSan's:
//  * a decoder either returns a record or throws mooncake::Error of kind
//    kInternal (never another exception, never a crash);
//  * what it returns is well-formed (fields in range, sizes consistent) and
//    survives encode -> decode unchanged.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/limits.h"
#include "core/record.h"
#include "membership/agreement.h"
#include "membership/view.h"
#include "transport/link.h"
#include "transport/segment.h"

namespace {

using namespace mooncake;

void check(bool ok) {
  if (!ok) abort();
}

void view(const std::string& text) {
  const View v = View::decode(text);
  check(v.capacity() >= 1 && v.capacity() <= kMaxCapacity);
  check(v.incarnation.size() == v.active.size() && v.since.size() == v.active.size());
  for (uint8_t a : v.active) check(a <= 1);
  check(View::decode(v.encode()) == v);
}

void report(const std::string& text) {
  const Report r = Report::decode(text);
  check(r.rank >= 0 && r.rank < kMaxCapacity && r.attempts >= 0);
  check(Report::decode(r.encode()) == r);
}

void decision(const std::string& text) {
  const Decision d = Decision::decode(text);
  const std::vector<int> members = d.view.members();
  check(d.reports.size() == members.size());
  for (size_t i = 0; i < members.size(); ++i) check(d.reports[i].rank == members[i]);
  check(Decision::decode(d.encode()) == d);
}

void address(const std::string& text) {
  const PeerAddress a = PeerAddress::decode(text);
  check(a.rank >= 0 && a.pid > 0 && a.segment_fd >= -1);
  check(a.segment_bytes >= kSegmentHeaderBytes && a.tcp_port >= 1 && a.tcp_port <= 65535);
  check(!a.host_key.empty() && !a.tcp_host.empty());
  check(PeerAddress::decode(a.encode()) == a);
}

// The ad-hoc records (elastic EP metadata and links, joiner records): a
// mix of fields as their readers use them.
void fields(const std::string& text) {
  RecordReader in(text, "record");
  const int64_t a = in.number<int64_t>("a");
  const uint32_t b = in.number<uint32_t>("b");
  const int c = in.number<int>("c", -1, 1000);
  check(c >= -1 && c <= 1000);
  const std::string w = in.word("w", 16);
  check(!w.empty() && w.size() <= 16 && w.find_first_of(" \n") == std::string::npos);
  in.end();
  check(RecordReader(std::to_string(a) + " " + std::to_string(b), "again").number<int64_t>("a") ==
        a);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 5) {
      case 0: view(text); break;
      case 1: report(text); break;
      case 2: decision(text); break;
      case 3: address(text); break;
      case 4: fields(text); break;
    }
  } catch (const Error& e) {
    check(e.kind() == ErrorKind::kInternal);
  }
  return 0;
}
