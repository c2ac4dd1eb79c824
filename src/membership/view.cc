#include "membership/view.h"

#include <sstream>
#include <stdexcept>

#include "core/error.h"

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

View View::decode(const std::string& text) {
  std::istringstream is(text);
  View v;
  int capacity = -1;
  is >> v.epoch >> v.seq >> capacity;
  if (!is || capacity < 1 || capacity > (1 << 20))
    throw_error(ErrorKind::kInternal, -1, "malformed group view in the store: '", text, "'");
  v.active.resize(static_cast<size_t>(capacity));
  v.incarnation.resize(static_cast<size_t>(capacity));
  v.since.resize(static_cast<size_t>(capacity));
  for (int r = 0; r < capacity; ++r) {
    int a = 0;
    is >> a >> v.incarnation[static_cast<size_t>(r)] >> v.since[static_cast<size_t>(r)];
    v.active[static_cast<size_t>(r)] = a != 0;
  }
  if (!is) throw_error(ErrorKind::kInternal, -1, "malformed group view in the store: '", text, "'");
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
