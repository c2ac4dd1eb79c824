#include "transport/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "core/error.h"

namespace mooncake {

Segment::Segment(size_t bytes) : size_(bytes) {
  MC_ASSERT(bytes >= kSegmentHeaderBytes);
  fd_ = MC_SYSCHECK(::memfd_create("mooncake-segment", MFD_CLOEXEC));
  // Owner-only, as a file in /dev/shm would be: a process of another user
  // that could follow /proc/<pid>/fd/ still cannot open it.
  if (::fchmod(fd_, 0600) != 0) {
    int e = errno;
    ::close(fd_);
    throw_error(ErrorKind::kSystem, -1, "fchmod of a segment failed: ", std::strerror(e));
  }
  if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
    int e = errno;
    ::close(fd_);
    throw_error(ErrorKind::kSystem, -1, "ftruncate of a ", bytes,
                "-byte segment failed: ", std::strerror(e));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::close(fd_);
    throw_error(ErrorKind::kSystem, -1, "mmap of a ", bytes,
                "-byte segment failed: ", std::strerror(e));
  }
  base_ = static_cast<uint8_t*>(p);
}

Segment::~Segment() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
}

void* map_peer_file(int pid, int fd, size_t bytes, const char* what) {
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int local = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) {
    // Gone (the process or its fd), or something else under that number
    // (a directory, a socket): not the file the peer published. A refused
    // permission, or no memory, is this process's problem.
    const int e = errno;
    const bool gone = e == ENOENT || e == ESRCH || e == EISDIR || e == ENXIO || e == ELOOP;
    throw_error(gone ? ErrorKind::kPeerFailed : ErrorKind::kSystem, -1, "cannot open peer ", what,
                " ", path, ": ", std::strerror(e));
  }
  // Mapping past the end of a shorter file would fault on the first access.
  struct stat st {};
  if (::fstat(local, &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<uint64_t>(st.st_size) != bytes) {
    ::close(local);
    throw_error(ErrorKind::kPeerFailed, -1, path, " is not a ", bytes, "-byte ", what,
                " (its process is gone, and the pid was reused?)");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
  const int e = errno;
  ::close(local);
  if (p == MAP_FAILED)
    throw_error(ErrorKind::kSystem, -1, "cannot map the ", what, " of process ", pid, ": ",
                std::strerror(e));
  return p;
}

RemoteMapping::RemoteMapping(int pid, int fd, size_t bytes)
    : base_(static_cast<uint8_t*>(map_peer_file(pid, fd, bytes, "segment"))), size_(bytes) {}

RemoteMapping::~RemoteMapping() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

}  // namespace mooncake
