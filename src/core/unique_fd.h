// A file descriptor closed when its owner goes, unless released.
#pragma once

#include <unistd.h>

#include <utility>

namespace mooncake {

class UniqueFd {
 public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  // Hands the descriptor over; this owner closes nothing.
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace mooncake
