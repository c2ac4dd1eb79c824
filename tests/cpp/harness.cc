#include "harness.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>

#include "core/clock.h"
#include "core/error.h"

namespace mctest {

TempDir::TempDir() {
  char name[] = "/tmp/mooncake-test-XXXXXX";
  if (::mkdtemp(name) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = name;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

namespace {

// In a rank's process: the run's directory and the rank.
std::string current_run_dir;
int current_rank = -1;

std::string message_path(const std::string& dir, int rank) {
  return dir + "/rank" + std::to_string(rank) + ".failure";
}

// Runs the body in a child; returns its exit status. Every gtest failure of
// the body (on any of its threads) is captured here and passed to the parent.
int run_child(Rank& r, const std::function<void(Rank&)>& body) {
  testing::TestPartResultArray parts;
  std::ostringstream failure;
  {
    // Both: the body's other threads report to the global reporter, its own
    // thread to a per-thread one (which an enclosing EXPECT_*_FAILURE replaces).
    testing::ScopedFakeTestPartResultReporter other_threads(
        testing::ScopedFakeTestPartResultReporter::INTERCEPT_ALL_THREADS, &parts);
    testing::ScopedFakeTestPartResultReporter this_thread(
        testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &parts);
    try {
      body(r);
    } catch (const mooncake::Error& e) {
      failure << "uncaught mooncake::Error (" << mooncake::error_kind_name(e.kind())
              << "): " << e.what() << "\n";
    } catch (const std::exception& e) {
      failure << "uncaught exception: " << e.what() << "\n";
    } catch (...) {
      failure << "uncaught non-std exception\n";
    }
  }
  for (int i = 0; i < parts.size(); ++i) {
    const testing::TestPartResult& part = parts.GetTestPartResult(i);
    if (part.failed())
      failure << (part.file_name() ? part.file_name() : "?") << ":" << part.line_number() << ": "
              << part.message() << "\n";
  }
  if (failure.str().empty()) return 0;
  std::ofstream(message_path(r.dir, r.rank)) << failure.str();
  return 1;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct Child {
  pid_t pid = -1;
  int pidfd = -1;
  bool finished = false;
  bool killed = false;  // by us, at the time limit
  int status = 0;
};

void reap(Child& c) {
  ::waitpid(c.pid, &c.status, 0);
  ::close(c.pidfd);
  c.finished = true;
}

bool failed(const Child& c) {
  return c.killed || !WIFEXITED(c.status) || WEXITSTATUS(c.status) != 0;
}

}  // namespace

void run_ranks(int size, const std::function<void(Rank&)>& body, RunLimits limits) {
  TempDir dir;
  mooncake::FileStore store(dir.path() + "/store");
  std::vector<Child> children(static_cast<size_t>(size));
  const pid_t parent = ::getpid();
  std::fflush(nullptr);  // the children must not repeat buffered output
  for (int rank = 0; rank < size; ++rank) {
    pid_t pid = ::fork();
    if (pid < 0) {
      for (int started = 0; started < rank; ++started) {
        ::kill(children[started].pid, SIGKILL);
        reap(children[started]);
      }
      FAIL() << "fork of rank " << rank << " failed: " << std::strerror(errno);
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(3);
      Rank r{rank, size, store, dir.path()};
      current_run_dir = dir.path();
      current_rank = rank;
      int code = run_child(r, body);
      std::fflush(nullptr);
      ::_exit(code);
    }
    children[rank].pid = pid;
    children[rank].pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));  // >= 0: Linux 5.3+
  }

  mooncake::Deadline deadline = mooncake::Deadline::after_ms(limits.timeout_ms);
  bool grace_started = false;
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Child*> waiting;
    for (auto& c : children)
      if (!c.finished) {
        fds.push_back({c.pidfd, POLLIN, 0});
        waiting.push_back(&c);
      }
    if (fds.empty()) break;
    if (deadline.expired()) {
      for (Child* c : waiting) {
        ::kill(c->pid, SIGKILL);
        c->killed = true;
        reap(*c);
      }
      break;
    }
    ::poll(fds.data(), fds.size(), static_cast<int>(deadline.remaining_ms(1000)) + 1);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      reap(*waiting[i]);
      if (failed(*waiting[i]) && !grace_started) {
        grace_started = true;
        deadline = deadline.earliest(mooncake::Deadline::after_ms(limits.grace_ms));
      }
    }
  }

  std::ostringstream report;
  int failures = 0;
  for (int rank = 0; rank < size; ++rank) {
    const Child& c = children[rank];
    if (!failed(c)) continue;
    ++failures;
    report << "rank " << rank << " of " << size;
    if (c.killed && grace_started)
      report << " was killed: still running " << limits.grace_ms
             << " ms after another rank failed\n";
    else if (c.killed)
      report << " was killed: still running at the time limit of " << limits.timeout_ms << " ms\n";
    else if (WIFSIGNALED(c.status))
      report << " died of signal " << WTERMSIG(c.status) << "\n";
    else
      report << " failed (exit " << WEXITSTATUS(c.status) << "):\n"
             << read_file(message_path(dir.path(), rank));
  }
  if (failures != 0)
    ADD_FAILURE() << failures << " of " << size << " ranks failed\n" << report.str();
}

void fail_rank_now(const std::string& message) {
  std::ofstream(message_path(current_run_dir, current_rank), std::ios::app) << message << "\n";
  std::fflush(nullptr);
  ::_exit(1);
}

void exit_rank_abruptly() {
  std::fflush(nullptr);
  ::_exit(0);
}

void store_barrier(mooncake::Store& store, const std::string& name, int rank, int size,
                   int64_t timeout_ms) {
  mooncake::Deadline deadline = mooncake::Deadline::after_ms(timeout_ms);
  store.set("barrier/" + name + "/" + std::to_string(rank), "1");
  for (int peer = 0; peer < size; ++peer)
    store.get("barrier/" + name + "/" + std::to_string(peer), deadline.remaining_ms(timeout_ms));
}

}  // namespace mctest
