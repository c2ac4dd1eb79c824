"""CPU-burning processes, for tests that must hold on a host whose cores are busy."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time


def _burn(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


@contextlib.contextmanager
def cpu_burners(count: int, limit_s: float = 600.0):
    """Runs ``count`` busy-looping processes while the block runs (each stops by
    itself after ``limit_s``, should the block's exit never come)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_burn, args=(time.monotonic() + limit_s,)) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()
