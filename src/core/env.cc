#include "core/env.h"

#include <cerrno>
#include <cstdlib>

#include "core/error.h"

namespace mooncake {

const std::vector<EnvVar>& env_registry() {
  static const std::vector<EnvVar> vars = {
      {"MOONCAKE_LOG_LEVEL", "warn", "Log level: error, warn, info, debug."},
      {"MOONCAKE_TRANSPORT", "auto",
       "auto: shared memory for peers on this host; for other hosts ucx where the build has it "
       "and the machine has an RDMA device, else tcp. tcp / ucx: that transport for every peer "
       "(tests the cross-host path on one machine); shm: as auto."},
      {"MOONCAKE_PG_TIMEOUT_MS", "0",
       "Default op timeout in ms when > 0; otherwise the timeout given to "
       "init_process_group (torch's default is 30 minutes)."},
      {"MOONCAKE_CHUNK_BYTES", "262144",
       "Bytes of one message slot per peer channel; larger tensors are pipelined through it."},
      {"MOONCAKE_P2P_UNCLAIMED_BYTES", "268435456",
       "Per source rank: the most bytes of p2p messages that arrived before any recv took "
       "them that this rank keeps. At the cap it stops taking that source's messages, so the "
       "source's sends wait and fail at their timeout unless a recv comes; other sources are "
       "unaffected."},
      {"MOONCAKE_SMALL_MSG_BYTES", "65536",
       "all_reduce/broadcast at or below this size use the direct algorithm; above it, "
       "reduce-scatter + all-gather (each rank moves O(size))."},
      {"MOONCAKE_ASYNC_DELAY_US", "100",
       "An op nobody waits on yet (async_op=True) starts after this many us; a caller that "
       "waits sooner runs it on its own thread, saving two thread hand-offs."},
      {"MOONCAKE_SPIN_US", "20",
       "How long a wait spins before it blocks on a futex (unset: 0 while a group runs more "
       "ranks on this host than CPUs)."},
      {"MOONCAKE_HANG_MS", "2000",
       "A peer whose heartbeat stands still this long (a stopped or hung process) counts as "
       "failed, whatever the op's timeout."},
      {"MOONCAKE_STORE_TIMEOUT_MS", "10000",
       "Bound on one store request beyond what it waits for (a torch store behind a cut "
       "link never answers): past it the store counts as out of reach for this rank, which "
       "then cannot take part in agreements; the ranks that reach it go on without it."},
      {"MOONCAKE_RECOVER", "1",
       "1: when a rank fails, the survivors agree on the new group and re-run the op; 0: the "
       "op fails with an error instead, and so do later ops until pg.sync_after_failure."},
      {"MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE", "1",
       "For groups created without pg_options: 1: a failed rank leaves the group "
       "automatically; 0: the op that meets it fails and the rank stays in the view until "
       "the application calls pg.sync_after_failure or pg.deactivate_ranks."},
      {"MOONCAKE_PG_AUTO_SYNC_ON_FAILURE", "",
       "For groups created without pg_options: 1: the op that meets a failure waits for the "
       "survivors' new view and re-runs among them; 0: it fails, and the next op (or "
       "pg.sync_after_failure) settles the new view first; unset: as "
       "MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE. 1 needs MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE=1."},
      {"MOONCAKE_EP_WAIT_CAP_MS", "60000",
       "EP device path: how long a kernel waits for a silent peer when timeout_us is -1; "
       "past it the peer is masked, so no kernel spins forever."},
      {"MOONCAKE_EP_HT_ONE_COPY", "0",
       "ElasticBuffer device path: 1: a dispatch's receivers read a same-host source's x "
       "(and FP8 scales) where it lies, through a CUDA IPC mapping of its allocation, so "
       "each row's bytes move once instead of twice (through the source's ring); 0: "
       "through the ring. Read when the buffer is made; every rank must use the same value "
       "(a dispatch between ranks that differ raises)"},
      {"MOONCAKE_DEVICE_LIFE_PAGES", "1",
       "Device kernels (EP buffers, the mooncake CUDA backend's device-driven ops): 1: a "
       "wait on a same-host peer also reads that process's life page, which the kernel marks "
       "the moment it dies, so the wait ends within microseconds even when this host's own "
       "notice comes late; 0: only the host's word (set by this process's heartbeat thread), "
       "for comparison."},
      {"MOONCAKE_EP_FORCE_FALLBACK", "0",
       "1: EP dispatch/combine always take the portable path (torch ops over the process "
       "group), even where the device path could run."},
      {"MOONCAKE_CUDA_SEGMENT_BYTES", "67108864",
       "Backend mooncake: bytes of each rank's device segment (allocated by the first op that "
       "uses it), which same-host peers map. "
       "Every collective goes GPU to GPU through it (inputs larger than the segment in "
       "pieces); point-to-point ops and groups that span hosts stage through host memory. "
       "0: no segment (every op is staged)."},
      {"MOONCAKE_CUDA_PLANE_MIN_BYTES", "65536",
       "Backend mooncake: ops with smaller inputs are staged through host memory even where "
       "the device segment could take them (for small messages the staged path's two copies "
       "cost less than the device plane's waits for the GPU)."},
      {"MOONCAKE_CUDA_DIRECT", "auto",
       "Backend mooncake: the device-driven kernels (one launch per op, no host round, CUDA "
       "graph capturable), which serve same-host CUDA collectives whose input is at most "
       "MOONCAKE_CUDA_DIRECT_BYTES. auto: on; all_reduce one-shot at world <= 2 or up to "
       "256 KiB, else two-shot; oneshot / twoshot: all_reduce takes that algorithm at every "
       "size; off: every op takes the host-driven device plane (or the staged path) as before, "
       "and a collective under CUDA graph capture raises."},
      {"MOONCAKE_CUDA_DIRECT_BYTES", "8388608",
       "Backend mooncake: the largest input the device-driven kernels serve (a rank's whole "
       "input: every part of a reduce_scatter's or all_to_all's; at most "
       "MOONCAKE_CUDA_SEGMENT_BYTES); each rank's device segment grows by about 3x this. "
       "Larger ones take the host-driven device plane. 0: none (as MOONCAKE_CUDA_DIRECT=off)."},
      {"MOONCAKE_CUDA_MAPPED", "0",
       "Backend mooncake: 1: an all_reduce past MOONCAKE_CUDA_DIRECT_BYTES reads each rank's "
       "tensor where it lies (mapped through CUDA IPC) instead of copying it into the segments: "
       "one launch per piece, 3N + N/R bytes moved per rank where the plane moves (3 + R) N; "
       "a tensor's first such op maps it and runs on the plane. Every rank alike. 0: off."},
      {"MOONCAKE_CUDA_P2P_BYTES", "0",
       "Backend mooncake: send and recv of CUDA tensors of at least this many bytes go device to "
       "device between ranks on one host (the sender copies into a buffer of its own that the "
       "receiver maps through CUDA IPC) instead of through host memory. Every rank alike. 0: off "
       "(its test passed on an H100; the whole CUDA suite has not yet run with it on)."},
      {"MOONCAKE_HOST_IP", "",
       "Address the tcp transport listens on and publishes (default: the host's name)."},
  };
  return vars;
}

static const EnvVar& find_var(const char* name) {
  for (const auto& v : env_registry())
    if (std::string(v.name) == name) return v;
  MC_ASSERT(false, "undeclared environment variable ", name);
}

std::string env_string(const char* name) {
  const EnvVar& var = find_var(name);
  const char* value = std::getenv(var.name);
  return value != nullptr && *value != '\0' ? std::string(value) : std::string(var.default_value);
}

int64_t env_int(const char* name) {
  std::string value = env_string(name);
  char* end = nullptr;
  errno = 0;
  long long parsed = std::strtoll(value.c_str(), &end, 10);
  MC_CHECK_ARG(end != value.c_str() && *end == '\0' && errno != ERANGE, "environment variable ",
               name, " must be a 64-bit integer, got '", value, "'");
  return parsed;
}

}  // namespace mooncake
