// Names for the library's threads: a process's threads can then be told apart
// in /proc/<pid>/task/*/comm, top and gdb (and a test that counts them can say
// which kind grew).
#pragma once

#include <pthread.h>

namespace mooncake {

// Names the calling thread; Linux keeps the first 15 characters.
inline void name_this_thread(const char* name) {
  pthread_setname_np(pthread_self(), name);
}

}  // namespace mooncake
