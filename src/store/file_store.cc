#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/clock.h"
#include "core/error.h"
#include "core/record.h"
#include "store/store.h"

namespace mooncake {

// Keys live in <dir>/keys, lock files in <dir>/locks and files being
// written in <dir>/tmp, so that no file of one kind is mistaken for another.
FileStore::FileStore(std::string dir) : dir_(std::move(dir)) {
  for (const char* sub : {"", "/keys", "/locks", "/tmp"}) ::mkdir((dir_ + sub).c_str(), 0700);
}

namespace {

// A key as a file name: '%' and '/' percent-encoded, all else as is.
std::string encode_key(const std::string& key) {
  std::string out;
  for (char c : key) {
    if (c == '%')
      out += "%25";
    else if (c == '/')
      out += "%2F";
    else
      out += c;
  }
  return out;
}

}  // namespace

std::string FileStore::path(const std::string& key) const {
  return dir_ + "/keys/" + encode_key(key);
}

void FileStore::set(const std::string& key, const std::string& value) {
  static std::atomic<uint64_t> counter{0};
  std::string tmp = dir_ + "/tmp/" + std::to_string(getpid()) + "." +
                    std::to_string(counter.fetch_add(1)) + "." + encode_key(key);
  {
    std::ofstream out(tmp, std::ios::binary);
    out << value;
  }
  MC_SYSCHECK(::rename(tmp.c_str(), path(key).c_str()));
}

std::string FileStore::get(const std::string& key, int64_t timeout_ms) {
  Deadline deadline = Deadline::after_ms(timeout_ms);
  for (;;) {
    std::ifstream in(path(key), std::ios::binary);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      return ss.str();
    }
    if (deadline.expired())
      throw_error(ErrorKind::kTimeout, -1, "store: key '", key, "' did not appear within ",
                  timeout_ms, " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  std::string lock_path = dir_ + "/locks/" + encode_key(key);
  int fd = MC_SYSCHECK(::open(lock_path.c_str(), O_CREAT | O_RDWR, 0600));
  MC_SYSCHECK(::flock(fd, LOCK_EX));
  int64_t value = 0;
  try {
    if (check(key)) {
      RecordReader in(get(key, 0), "counter under '" + key + "'");
      value = in.number<int64_t>("value");
      in.end();
    }
    if (__builtin_add_overflow(value, delta, &value))
      throw_error(ErrorKind::kInvalidArgument, -1, "store: adding ", delta, " to the counter '",
                  key, "' overflows 64 bits");
    set(key, std::to_string(value));
  } catch (...) {
    ::close(fd);  // releases the lock
    throw;
  }
  ::flock(fd, LOCK_UN);
  ::close(fd);
  return value;
}

std::string FileStore::compare_set(const std::string& key, const std::string& desired) {
  std::string lock_path = dir_ + "/locks/" + encode_key(key);
  int fd = MC_SYSCHECK(::open(lock_path.c_str(), O_CREAT | O_RDWR, 0600));
  MC_SYSCHECK(::flock(fd, LOCK_EX));
  if (!check(key)) set(key, desired);
  std::string value = get(key, 0);
  ::flock(fd, LOCK_UN);
  ::close(fd);
  return value;
}

bool FileStore::check(const std::string& key) {
  return ::access(path(key).c_str(), F_OK) == 0;
}

}  // namespace mooncake
