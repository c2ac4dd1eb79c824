// The library's threads: each one names itself (a process's threads can then
// be told apart in /proc/<pid>/task/*/comm, top and gdb, and a test that
// counts them can say which kind grew) and runs the hook a part of the library
// set for them (the CUDA half relaxes their graph capture mode: device/cuda.h).
#pragma once

#include <pthread.h>

#include <atomic>

namespace mooncake {

using ThreadStartHook = void (*)();

inline std::atomic<ThreadStartHook>& thread_start_hook() {
  static std::atomic<ThreadStartHook> hook{nullptr};
  return hook;
}

// What a library thread does first: takes `name` (Linux keeps 15 characters)
// and runs the hook, if one is set.
inline void begin_library_thread(const char* name) {
  pthread_setname_np(pthread_self(), name);
  if (const ThreadStartHook hook = thread_start_hook().load(std::memory_order_acquire)) hook();
}

}  // namespace mooncake
