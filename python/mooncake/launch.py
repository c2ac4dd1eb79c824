"""A local launcher: hosts the rendezvous store in this process (as torchrun
does, so no rank is special) and runs ``fn(rank, world_size, store_port,
*args)`` in ``world_size`` spawned processes.

Used by ``python -m mooncake demo``; handy for experiments::

    from mooncake.launch import run_local
    results = run_local(my_fn, world_size=4)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def init_rank(rank: int, world_size: int, port: int, backend: str = "mooncake-cpu", **kwargs):
    """Joins the group hosted by ``run_local`` (call inside a rank)."""
    import torch.distributed as dist

    if backend.startswith("mooncake"):
        from mooncake import pg  # noqa: F401  (registers the backends)
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)


def _entry(fn, rank, world_size, port, args, env, queue):
    os.environ.update(env)
    try:
        queue.put((rank, True, fn(rank, world_size, port, *args)))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        queue.put((rank, False, traceback.format_exc()))


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Runs ``fn`` on ``world_size`` local ranks and returns their results by rank.

    Args:
        fn: a picklable function ``fn(rank, world_size, port, *args)``; call
            ``init_rank(rank, world_size, port)`` in it to join the group.
        world_size: number of processes.
        args: extra arguments for ``fn``.
        env: environment variables set in every rank before ``fn`` runs.
        timeout_s: a bound on the whole run; ranks still running then are killed.

    Raises:
        RuntimeError: a rank raised (its traceback is included), or exited
            without a result, or the run took longer than ``timeout_s``.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, store.port, args, env or {}, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        import queue as queue_mod
        import time

        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"run_local: ranks did not finish within {timeout_s} s")
            try:
                rank, ok, value = queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and all(r not in results for r in dead):
                    raise RuntimeError(
                        f"run_local: rank(s) {dead} exited with codes "
                        f"{[procs[r].exitcode for r in dead]} without a result"
                    ) from None
                continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("run_local: " + "\n".join(errors))
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        del store
