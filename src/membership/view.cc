#include "membership/view.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "core/record.h"

namespace mooncake {

View View::initial(int size, int capacity) {
  MC_CHECK_ARG(size >= 1 && size <= capacity, "world size must be in [1, capacity=", capacity,
               "], got ", size);
  View v;
  v.active.assign(static_cast<size_t>(capacity), 0);
  v.incarnation.assign(static_cast<size_t>(capacity), 0);
  v.since.assign(static_cast<size_t>(capacity), 0);
  for (int r = 0; r < size; ++r) v.active[static_cast<size_t>(r)] = 1;
  return v;
}

std::vector<int> View::members() const {
  std::vector<int> out;
  for (int r = 0; r < capacity(); ++r)
    if (active[static_cast<size_t>(r)]) out.push_back(r);
  return out;
}

int View::num_members() const {
  int n = 0;
  for (uint8_t a : active) n += a != 0;
  return n;
}

std::string View::encode() const {
  std::ostringstream os;
  os << epoch << ' ' << seq << ' ' << capacity();
  for (int r = 0; r < capacity(); ++r)
    os << ' ' << int{active[static_cast<size_t>(r)]} << ' ' << incarnation[static_cast<size_t>(r)]
       << ' ' << since[static_cast<size_t>(r)];
  return os.str();
}

View View::decode(const std::string& text, const std::string& where) {
  RecordReader in(text, "group view" + where);
  View v;
  v.epoch = in.number<uint64_t>("epoch");
  v.seq = in.number<uint64_t>("seq");
  const int capacity = in.number<int>("capacity", 1, kMaxCapacity);
  // Each slot takes at least 6 bytes ("0 0 0 "): a record that claims more
  // slots than its text can hold fails below without a large allocation.
  const size_t fits = std::min(static_cast<size_t>(capacity), text.size() / 6);
  v.active.reserve(fits);
  v.incarnation.reserve(fits);
  v.since.reserve(fits);
  for (int r = 0; r < capacity; ++r) {
    v.active.push_back(static_cast<uint8_t>(in.number<int>("active", 0, 1)));
    v.incarnation.push_back(in.number<uint32_t>("incarnation"));
    v.since.push_back(in.number<uint64_t>("since"));
  }
  in.end();
  return v;
}

std::string View::describe() const {
  std::ostringstream os;
  os << '{';
  const char* sep = "";
  for (int r : members()) {
    os << sep << r;
    sep = ",";
  }
  os << '}';
  return os.str();
}

}  // namespace mooncake
