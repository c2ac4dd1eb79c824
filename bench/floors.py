"""What this host can do at best, measured in the benchmark's own run.

Two micro-benchmarks, in Python with ctypes and numpy only (no compiled helper):

* hand-off latency: a token passed around a ring of ``n`` processes through a
  shared-memory word per process; the holder stores the next round number into
  its successor's word and wakes it with ``futex(FUTEX_WAKE)``; a waiter sleeps
  in ``futex(FUTEX_WAIT)``. Exactly one process is runnable at a time, so the
  time per hop is the cost of one cross-process wake-up on this host (a ring
  of 2 is a ping-pong). The same loop's cost with no peer to wait for (Python
  and ctypes, about a microsecond) is measured too and taken off.
* copy bandwidth: ``numpy.copyto`` of a float32 array, in one process and in
  ``cores`` processes at once (the aggregate of the whole host), at sizes from
  cache-sized to DRAM-sized.

torch's own layer (``dist.all_reduce``'s Python wrapper and dispatcher) is not
measured here: bench_pg.py takes it from the ranks themselves (see
``FloorModel.torch_layer``).

Both fork plain worker processes (``os.fork``): call them before the caller
starts threads (a torch ``TCPStore`` server, for one).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import struct
import time
from dataclasses import dataclass, field

import numpy as np

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0  # shared (not FUTEX_PRIVATE_FLAG): the word is in a MAP_SHARED mapping
_FUTEX_WAKE = 1
_LINE = 64  # one cache line per word
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_TICK = ctypes.byref(_Timespec(0, 100_000_000))  # a waiter re-checks every 100 ms

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def host_cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


class _SharedWords:
    """``count`` uint32 words, one per cache line, in an anonymous shared mapping.

    Forked children see the same memory.
    """

    def __init__(self, count: int) -> None:
        self._map = mmap.mmap(-1, _LINE * count, flags=mmap.MAP_SHARED)
        self.words = [ctypes.c_uint32.from_buffer(self._map, _LINE * i) for i in range(count)]
        self.addrs = [ctypes.c_void_p(ctypes.addressof(w)) for w in self.words]

    def wait_at_least(self, i: int, want: int, timeout_s: float = 60.0) -> None:
        word, addr = self.words[i], self.addrs[i]
        deadline = None
        while True:
            seen = word.value
            if seen >= want:
                return
            _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_uint32(seen), _TICK, None, 0)
            if word.value < want:  # woken early, or a tick passed: is a peer stuck?
                deadline = deadline or time.monotonic() + timeout_s
                if time.monotonic() > deadline:
                    raise TimeoutError(f"floor micro-benchmark: word {i} stuck below {want}")

    def post(self, i: int, value: int) -> None:
        self.words[i].value = value
        _syscall(_SYS_FUTEX, self.addrs[i], _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:  # child: run, then leave without unwinding the parent's state
        code = 1
        try:
            fn(*args)
            code = 0
        finally:
            os._exit(code)
    return pid


def _join(pids: list[int]) -> None:
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"floor micro-benchmark worker {pid} failed ({status})")


def _ring_member(words: _SharedWords, i: int, n: int, rounds: int) -> None:
    # Word i holds the last round in which member i received the token; word n + i
    # says member i is ready.
    words.post(n + i, 1)
    for r in range(1, rounds + 1):
        words.wait_at_least(i, r)
        words.post((i + 1) % n, r)


def _drive_ring(words: _SharedWords, n: int, rounds: int, warm: int) -> float:
    """Member 0 of a ring: once the others are ready, sends the token round ``rounds``
    times; returns the seconds of the last ``rounds - warm``."""
    for i in range(1, n):
        words.wait_at_least(n + i, 1)
    t0 = 0.0
    for r in range(1, rounds + 1):
        if r == warm + 1:
            t0 = time.perf_counter()
        words.post(1, r)
        words.wait_at_least(0, r)
    return time.perf_counter() - t0


def _ring_seconds(n: int, rounds: int, warm: int) -> float:
    """Seconds for ``rounds - warm`` trips of the token around a ring of ``n``."""
    words = _SharedWords(2 * n)
    pids = [_fork(_ring_member, words, i, n, rounds) for i in range(1, n)]
    try:
        return _drive_ring(words, n, rounds, warm)
    finally:
        _join(pids)


def loop_overhead_us(iterations: int = 2000, trials: int = 20) -> float:
    """Microseconds of one hop's loop body when nothing has to wait (Python, ctypes, syscall).

    The fastest of many short trials: on a shared host a short trial is more
    likely to run undisturbed.
    """
    words = _SharedWords(2)
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for r in range(1, iterations + 1):
            words.wait_at_least(0, 0)
            words.post(1, r)
        best = min(best, time.perf_counter() - t0)
    return best / iterations * 1e6


@dataclass
class HandOff:
    """Per-hop wake-up latency in a ring of ``ranks`` processes."""

    ranks: int
    hop_us: float  # floor per hop: raw minus the loop overhead
    raw_hop_us: float  # measured time per hop (fastest trial)
    loop_us: float  # the Python/ctypes loop body alone
    trials_us: list[float]  # raw per-hop time of each trial


def measure_handoff(
    ranks: int, trial_seconds: float = 0.02, trials: int = 15, loop_us: float | None = None
) -> HandOff:
    """Measures the wake-up hand-off in a ring of ``ranks`` processes.

    Many short trials of about ``trial_seconds``; the fastest is kept: a floor
    is what the host can do, and a slower trial only met other work.
    """
    if ranks < 2:
        raise ValueError(f"a ring needs at least 2 processes, got {ranks}")
    if loop_us is None:
        loop_us = loop_overhead_us()
    probe_rounds = 200
    per_round = _ring_seconds(ranks, probe_rounds, 20) / (probe_rounds - 20)
    rounds = max(50, int(trial_seconds / max(per_round, 1e-7)))
    warm = max(5, rounds // 10)
    raw = []
    for _ in range(trials):
        raw.append(_ring_seconds(ranks, rounds + warm, warm) / (rounds * ranks) * 1e6)
    best = min(raw)
    return HandOff(ranks, max(best - loop_us, 0.0), best, loop_us, raw)


def _copy_worker(flags: _SharedWords, out: mmap.mmap, index: int, nbytes: int, reps: int) -> None:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # touch both
    flags.post(1 + index, 1)
    flags.wait_at_least(0, 1)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    struct.pack_into("d", out, 8 * index, time.perf_counter() - t0)


def _copy_gbps(nbytes: int, reps: int, processes: int) -> float:
    """Bytes copied per second by ``processes`` processes copying at once, summed."""
    flags = _SharedWords(1 + processes)
    out = mmap.mmap(-1, 8 * processes, flags=mmap.MAP_SHARED)
    pids = [_fork(_copy_worker, flags, out, i, nbytes, reps) for i in range(processes)]
    try:
        for i in range(processes):
            flags.wait_at_least(1 + i, 1)
        flags.post(0, 1)
    finally:
        _join(pids)
    slowest = max(struct.unpack_from("d", out, 8 * i)[0] for i in range(processes))
    return processes * nbytes * reps / slowest / 1e9


@dataclass
class CopyBandwidth:
    """Bytes copied per second by ``numpy.copyto`` of ``nbytes``-byte arrays."""

    nbytes: int
    single_gbps: float  # one process
    aggregate_gbps: float  # ``processes`` processes at once, summed
    processes: int


def measure_copy(
    sizes: list[int], processes: int | None = None, seconds: float = 0.05, trials: int = 5
) -> list[CopyBandwidth]:
    """Copy bandwidth at each size, alone and with ``processes`` (default: all cores) at once.

    Small copies stay in cache and run faster than large ones, so the floor of
    an op uses the bandwidth measured at its own size. The best of ``trials``
    is kept.
    """
    processes = processes or host_cores()
    table = []
    for nbytes in sorted(set(sizes)):
        reps = max(4, int(seconds * 10e9 / nbytes))  # about ``seconds`` at 10 GB/s
        single = max(_copy_gbps(nbytes, reps, 1) for _ in range(trials))
        aggregate = single
        if processes > 1:
            aggregate = max(_copy_gbps(nbytes, reps, processes) for _ in range(trials))
        table.append(CopyBandwidth(nbytes, single, aggregate, processes))
    return table


# --- floor models ---------------------------------------------------------------------
#
# Sizes follow nccl-tests: S is all_reduce's and broadcast's buffer, all_gather's
# output, reduce_scatter's input, all_to_all's per-rank buffer; s = S / N is one
# rank's shard. Memory traffic counts bytes read plus bytes written: a memcpy of
# b bytes is 2b, a reduction of k inputs of b bytes into one output is (k + 1) b.


@dataclass
class FloorModel:
    """Floors for mooncake's algorithms on this host, from the measured hand-off and copy rates.

    * hand-off floor = rounds x max(1, N / cores) x hop(N): every rank must be
      woken once per round of messages, and N ranks share ``cores`` cores.
    * copy floor = max(all ranks' traffic / (2 x copy bandwidth of min(N, cores)
      processes), the busiest rank's traffic / (2 x one process's bandwidth)),
      with the copy bandwidth measured at N x the op's size (the ranks share
      the caches). The traffic is the least the algorithm needs: every byte
      that crosses ranks is copied once (the reader copies straight from the
      writer's memory), and a reduction reads each of its inputs once.
    * floor = max(hand-off floor, copy floor).
    * torch floor = floor + torch's layer(N): through ``dist``, every op also
      pays torch's Python wrapper and dispatcher, which no backend can save.
      ``torch_layer`` is measured in the benchmark's own ranks: an 8-byte
      ``dist.all_reduce`` minus the same op through the backend object. (A ring
      of ranks each calling torch's do-nothing "fake" backend after a wake-up,
      used until 2026-12-04, read 2-4x more than that difference: a ring has
      one runnable process at a time, and its members moved between cores.)

    ``staged_copy_us`` is the same copy floor for the traffic mooncake's data
    path makes as built: the sender copies into a slot in the receiver's
    segment, and the receiver copies (or reduces) out of it: two copies.
    """

    cores: int
    copy: list[CopyBandwidth]  # ascending sizes
    handoff: dict[int, HandOff]
    small_bytes: int  # mooncake's MOONCAKE_SMALL_MSG_BYTES: direct all_reduce/broadcast up to it
    torch_layer: dict[int, float] = field(default_factory=dict)  # world -> us per op

    def direct(self, op: str, nbytes: int, n: int) -> bool:
        """Whether mooncake runs an all_reduce or broadcast of this size in one round."""
        return nbytes <= self.small_bytes or n > nbytes // 4

    def rounds(self, op: str, nbytes: int, n: int) -> int:
        """Dependent rounds of messages: 2 for reduce-scatter + all-gather (all_reduce) and
        scatter + all-gather (broadcast) above the small-message threshold, else 1."""
        if op in ("all_reduce", "broadcast") and not self.direct(op, nbytes, n):
            return 2
        return 1

    def traffic(self, op: str, nbytes: int, n: int, staged: bool = False) -> list[float]:
        """Bytes each rank reads plus writes (rank 0, broadcast's root, first)."""
        S, s = float(nbytes), nbytes / n
        if staged:
            return [2 * b for b in self._staged_copies(op, S, s, n)]
        if op == "all_reduce":
            if self.direct(op, nbytes, n):  # every rank reduces all n buffers
                return [(n + 1) * S] * n
            # reduce n shards into one, then copy in the n - 1 other reduced shards
            return [(n + 1) * s + 2 * (n - 1) * s] * n
        if op == "reduce_scatter_tensor":
            return [(n + 1) * s] * n
        if op in ("all_gather_into_tensor", "all_to_all_single"):
            return [2 * S] * n  # every output byte read once and written once
        if op == "broadcast":
            return [0.0] + [2 * S] * (n - 1)
        raise ValueError(f"no floor model for {op}")

    def _staged_copies(self, op: str, S: float, s: float, n: int) -> list[float]:
        """Copy-equivalents (traffic / 2) of mooncake's two-copy path, per rank."""
        reduce_n = (n + 1) / 2  # a reduction of n inputs, per byte of output
        if op == "all_reduce":
            if self.direct(op, int(S), n):  # send S to every peer; reduce n copies of S
                return [(n - 1) * S + reduce_n * S] * n
            # reduce-scatter: n-1 shards out, reduce n; all-gather: own shard out, n-1 in
            return [(n - 1) * s + reduce_n * s + 2 * (n - 1) * s] * n
        if op == "reduce_scatter_tensor":
            return [(n - 1) * s + reduce_n * s] * n
        if op in ("all_gather_into_tensor", "all_to_all_single"):
            return [s + 2 * (n - 1) * s] * n  # own shard locally; n-1 out, n-1 in
        if op == "broadcast":
            if self.direct(op, int(S), n):
                return [(n - 1) * S] + [S] * (n - 1)
            # scatter from the root, then an all-gather among all ranks
            return [3 * (n - 1) * s] + [s + 2 * (n - 1) * s] * (n - 1)
        raise ValueError(f"no floor model for {op}")

    def bandwidth_gbps(self, nbytes: int, processes: int) -> float:
        """Copy bandwidth of ``processes`` processes at once, measured nearest ``nbytes``
        (the largest size measured stands for everything above it)."""
        nbytes = min(nbytes, self.copy[-1].nbytes)
        entry = min(self.copy, key=lambda c: abs(math.log2(c.nbytes) - math.log2(max(nbytes, 1))))
        if processes <= 1:
            return entry.single_gbps
        return min(processes * entry.single_gbps, entry.aggregate_gbps)

    def handoff_us(self, op: str, nbytes: int, n: int, hop: float | None = None) -> float:
        """``hop``: a hop measured elsewhere (bench_pg's paired rounds), else the run's."""
        hop = self.handoff[n].hop_us if hop is None else hop
        return self.rounds(op, nbytes, n) * max(1.0, n / self.cores) * hop

    def torch_layer_us(self, n: int) -> float | None:
        """torch's own part of one op through ``dist`` at world ``n``, where measured."""
        return self.torch_layer.get(n)

    def copy_us(self, op: str, nbytes: int, n: int, staged: bool = False) -> float:
        per_rank = self.traffic(op, nbytes, n, staged)
        # The ranks share the caches: copies run at the rate measured for all their buffers.
        working_set = n * nbytes
        together = sum(per_rank) / (2 * self.bandwidth_gbps(working_set, min(n, self.cores)))
        busiest = max(per_rank) / (2 * self.bandwidth_gbps(working_set, 1))
        return max(together, busiest) / 1e3  # bytes / (GB/s) = ns

    def floor(self, op: str, nbytes: int, n: int) -> dict:
        hand, copy = self.handoff_us(op, nbytes, n), self.copy_us(op, nbytes, n)
        calls = self.torch_layer_us(n)
        return {
            # What a backend that moved nothing would take through dist (see torch_layer).
            "torch_floor_us": None if calls is None else max(hand, copy) + calls,
            "handoff_us": hand,
            "copy_us": copy,
            "floor_us": max(hand, copy),
            "bound": "hand-off" if hand >= copy else "copy",
            "rounds": self.rounds(op, nbytes, n),
            "traffic_bytes_per_rank": self.traffic(op, nbytes, n),
            "staged_copy_us": self.copy_us(op, nbytes, n, staged=True),
        }
