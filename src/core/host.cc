#include "core/host.h"

#include <unistd.h>

#include <fstream>

namespace mooncake {

namespace {

std::string ns_id(const char* path) {
  char buf[128];
  const ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?");
}

}  // namespace

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string line;
  std::getline(in, line);
  return line;
}

std::string net_namespace() {
  return ns_id("/proc/self/ns/net");
}

std::string pid_namespace() {
  return ns_id("/proc/self/ns/pid");
}

}  // namespace mooncake
