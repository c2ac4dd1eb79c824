"""A process that returns from its main without destroy_process_group() exits promptly.

Nothing the backend runs (the op queue's thread, the heartbeat thread, the tcp
receiver, an op or a recovery in flight) may hold up interpreter shutdown: the
process ends within a few seconds of its last line, also while a recovery is
under way and on a host whose cores are busy.

Each case is one LocalGroup of 4 processes; every rank returns the monotonic
time of its last line (CLOCK_MONOTONIC is one clock for the whole host), and
the parent notes when each process has exited.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from burners import cpu_burners
from mooncake.launch import LocalGroup

WORLD = 4
# Interpreter shutdown of a process that imported torch takes ~0.1-0.5 s on a
# quiet host and several times that with 8 busy processes per core; a thread
# that blocks shutdown holds it for an op's timeout (60 s here).
BOUND_S = 10.0


def _rank(rank: int, world: int, port: int, mode: str) -> float:
    import torch.distributed as dist

    from mooncake.launch import init_rank

    init_rank(rank, world, port, timeout_s=60)
    x = torch.ones(1 << 16)
    for _ in range(5):
        dist.all_reduce(x)
    dist.barrier()
    if mode == "recovering":
        if rank == world - 1:
            os._exit(0)  # dies before the op the others are about to start
        # An op that must recover (its peer is gone), left running: main returns
        # while the survivors agree on the next view.
        dist.all_reduce(torch.ones(1 << 20), async_op=True)
        time.sleep(0.05)
    elif mode == "in_flight":
        # Ops queued behind one that waits for a rank that never calls it.
        if rank != 0:
            for _ in range(3):
                dist.all_reduce(torch.ones(1 << 18), async_op=True)
    return time.monotonic()


def _run(mode: str, burners: int = 0) -> dict[str, float]:
    """Per process that returned: seconds from its last line to its exit."""
    with cpu_burners(burners, limit_s=120), LocalGroup(WORLD) as group:
        keys = group.start(_rank, args=(mode,))
        if mode == "recovering":
            group.expect_exit(WORLD - 1)
        done = group.results(timeout_s=120)
        exited: dict[str, float] = {}
        limit = time.monotonic() + 60
        while len(exited) < len(done) and time.monotonic() < limit:
            for k in done:
                if k not in exited and group.exited(k):
                    exited[k] = time.monotonic()
            time.sleep(0.01)
        late = [k for k in keys if k in done and k not in exited]
        assert not late, f"processes {late} still run 60 s after returning from main"
        return {k: exited[k] - done[k] for k in done}


@pytest.mark.parametrize(
    "mode, burners",
    [("plain", 0), ("recovering", 0), ("in_flight", 0), ("plain", 4)],
    ids=["plain", "mid-recovery", "ops-in-flight", "under-load"],
)
def test_returning_from_main_exits_promptly(mode, burners):
    delays = _run(mode, burners)
    assert len(delays) == (WORLD - 1 if mode == "recovering" else WORLD)
    slow = {k: round(v, 2) for k, v in delays.items() if v > BOUND_S}
    assert not slow, f"{mode}: seconds from main's return to exit: {delays}"
