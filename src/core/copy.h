// Copies for bytes that will not be read again soon.
#pragma once

#include <cstddef>

namespace mooncake {

// memcpy whose stores bypass the cache (on x86-64; elsewhere a memcpy): for
// large destinations that nobody reads right away, so that their lines are
// neither read for ownership first nor take the place of the caller's data.
// Ends with a store fence: the bytes are visible to other threads and
// processes once it returns, as after a memcpy.
void copy_past_cache(void* to, const void* from, size_t len);

}  // namespace mooncake
