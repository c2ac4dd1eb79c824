"""Rank side of test_upstream_pg.py: upstream's ``mooncake.pg`` helpers at work in
``mooncake-cpu`` groups whose ranks die, are removed, or join.

Each entry point is ``fn(rank, world_size, port, plan)`` for ``ft_parent.launch`` and
returns plain data (what this rank saw); the parent asserts. Rank ``r`` contributes
``1 << r`` to every all_reduce, so a result spells the set of ranks it covered.
Exceptions are recorded as ``ft_ranks.describe`` strings (``"Type ranks=[..]: msg"``).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from ft_ranks import describe, start_rank, stay_until_done
from mooncake import pg


def attempt(fn):
    """``("ok", value)`` or ``("err", describe(e))``."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - recorded for the parent
        return ("err", describe(e))


def mask(group=None) -> int:
    """An all_reduce of ``1 << rank``: the set of ranks it covered."""
    t = torch.tensor([float(1 << dist.get_rank())], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return int(t.item())


def proposal(r) -> tuple:
    return (r.status.name, r.new_epoch, list(r.dropped_ranks), r.reject_reason)


def work_report(work) -> tuple:
    """(hint as a list, its dtype, get_local_success) of a Work."""
    hint = pg.get_failed_ranks_hint(work)
    return (hint.tolist(), str(hint.dtype), pg.get_local_success(work))


def view(group) -> tuple:
    return (pg.get_active_ranks(group).tolist(), pg.get_current_epoch(group))


def store_barrier(store, tag: str, ranks, rank: int, timeout_s: float = 60.0) -> None:
    store.set(f"{tag}/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    while not store.check([f"{tag}/{r}" for r in ranks]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"store barrier {tag} not reached by {ranks}")
        time.sleep(0.005)


def _bad_arguments(W, rank: int) -> dict:
    """Bad calls on a healthy group of 4, each followed by an all_reduce."""
    calls = {
        "deactivate_range": lambda: pg.deactivate_ranks(W, [9]),
        "deactivate_negative": lambda: pg.deactivate_ranks(W, [-1]),
        "deactivate_twice": lambda: pg.deactivate_ranks(W, [1, 1] if rank != 1 else [0, 0]),
        "deactivate_self": lambda: pg.deactivate_ranks(W, [rank]),
        "deactivate_empty": lambda: pg.deactivate_ranks(W, []),
        "deactivate_not_a_list": lambda: pg.deactivate_ranks(W, "1"),
        "activate_active": lambda: pg.activate_ranks(W, [0]),
        "hint_not_a_work": lambda: pg.get_failed_ranks_hint("work"),
        "success_not_a_work": lambda: pg.get_local_success(None),
        "sync_nothing": lambda: proposal_of_sync(pg.sync_after_failure(W)),
    }
    return {name: (attempt(call), attempt(lambda: mask(W))) for name, call in calls.items()}


def proposal_of_sync(r) -> tuple:
    return (r.status.name, r.reject_reason)


def modes_rank(rank, world_size, port, plan):
    """World 4. The default group leaves failures to the application
    (``MooncakeBackendOptions(4, False, False, False)``); subgroups of all four ranks
    show the other modes: D (defaults) loses live rank 3 to ``deactivate_ranks``, then
    rank 2 dies and the survivors 0, 1, 3 handle it in W (``sync_after_failure``), S
    (``auto_sync_on_failure=False``: the next op settles), A (defaults: re-run) and K
    (manual, ``deactivate_ranks`` of the dead rank)."""
    Opts = pg.MooncakeBackendOptions
    _, store = start_rank(
        rank, world_size, port, timeout_s=plan["timeout_s"], pg_options=Opts(4, False, False, False)
    )
    W = dist.group.WORLD
    everyone = list(range(world_size))
    D = dist.new_group(everyone)
    S = dist.new_group(everyone, pg_options=Opts(4, False, True, False))
    A = dist.new_group(everyone)
    K = dist.new_group(everyone, pg_options=Opts(4, False, False, False))
    opts = pg._backend_of(W).options
    out = {
        "options": (
            opts.max_group_size,
            opts.is_extension,
            opts.auto_deactivate_on_failure,
            opts.auto_sync_on_failure,
            opts.active_ranks is None,
        ),
        "view0": view(W),
        "mask_dtype": str(pg.get_active_ranks(W).dtype),
    }
    t = torch.tensor([float(1 << rank)])
    w = dist.all_reduce(t, group=W, async_op=True)
    out["healthy"] = (work_report(w), int(t.item()))
    if rank in (0, 1):  # a p2p op's Work
        other = 1 - rank
        w = dist.isend(torch.ones(3), other) if rank == 0 else dist.irecv(torch.zeros(3), other)
        w.wait()
        out["p2p_healthy"] = work_report(w)
    out["bad"] = _bad_arguments(W, rank)
    out["view_after_bad"] = view(W)

    # Process-wide defaults: they reach only groups created afterwards.
    pg.set_collective_timeout_us(2_500_000)
    pg.set_p2p_timeout_us(300_000)
    pg.set_fault_reconciliation_window_us(100_001)
    P = dist.new_group(everyone)
    out["timeouts"] = (pg._backend_of(P)._timeouts_ms(), pg._backend_of(W)._timeouts_ms())
    if rank == 0:  # nobody sends: the recv times out after the p2p timeout
        start = time.monotonic()
        w = dist.irecv(torch.zeros(2), 1, group=P)
        err = attempt(lambda: w.wait())
        out["p2p_timeout"] = (err, time.monotonic() - start, work_report(w))
    store_barrier(store, "timeouts", everyone, rank)

    # A live rank removed from D by the others.
    if rank < 3:
        out["deactivate_live"] = proposal(pg.deactivate_ranks(D, [3]))
        out["D_after"] = (mask(D), *view(D))
        out["deactivate_again"] = proposal(pg.deactivate_ranks(D, [3]))
        store.set(f"deactivated/{rank}", "1")
    else:
        while not store.check([f"deactivated/{r}" for r in range(3)]):
            time.sleep(0.005)
        out["left_out"] = [attempt(lambda: mask(D)) for _ in range(2)]

    # Rank 2 dies.
    store_barrier(store, "before-kill", everyone, rank)
    if rank == 2:
        store.set("dying", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    while not store.check(["dead"]):
        time.sleep(0.005)
    survivors = [0, 1, 3]

    # W: failures are the application's.
    t = torch.tensor([float(1 << rank)])
    w = dist.all_reduce(t, group=W, async_op=True)
    out["W_failed"] = (attempt(w.wait), work_report(w), view(W))
    start = time.monotonic()
    out["W_again"] = (attempt(lambda: mask(W)), time.monotonic() - start, view(W))
    # Every survivor has met the failure before any settles it (see docs/api.md).
    store_barrier(store, "W-failed", survivors, rank)
    out["W_sync"] = (proposal_of_sync(pg.sync_after_failure(W)), view(W))
    out["W_after"] = attempt(lambda: mask(W))
    out["W_sync_again"] = proposal_of_sync(pg.sync_after_failure(W))

    # S: the op fails, the next one settles the view first.
    out["S_failed"] = (attempt(lambda: mask(S)), view(S))
    t = torch.tensor([float(1 << rank)])
    w = dist.all_reduce(t, group=S, async_op=True)
    out["S_next"] = (attempt(w.wait), int(t.item()), work_report(w), view(S))

    # A: the op is re-run among the survivors; its Work says who failed.
    t = torch.tensor([float(1 << rank)])
    w = dist.all_reduce(t, group=A, async_op=True)
    out["A_op"] = (attempt(w.wait), int(t.item()), work_report(w), view(A))
    if rank == 0:  # a recv from the dead rank
        w = dist.irecv(torch.zeros(2), 2, group=A)
        out["A_p2p"] = (attempt(w.wait), work_report(w))

    # K: the dead rank removed by the application, before any op met it.
    out["K_deactivate"] = proposal(pg.deactivate_ranks(K, [2]))
    out["K_after"] = (attempt(lambda: mask(K)), view(K))
    stay_until_done(store, rank, survivors)
    return out


def elastic_rank(rank, world_size, port, plan):
    """World 3 with a slot for a fourth rank (``plan["role"]``: ``member`` for ranks 0-2,
    ``joiner`` for rank 3, ``doomed``/``replacement`` for rank 1 later). The joiner is
    admitted with ``activate_ranks``; then rank 1 dies, a replacement that dies before
    joining is admitted and dropped, and the next replacement is admitted with
    ``recover_ranks``."""
    role = plan["role"]
    W = dist.group.WORLD
    out = {"role": role}
    if role == "member":
        active = torch.ones(4, dtype=torch.int32)
        _, store = start_rank(
            rank,
            world_size,
            port,
            timeout_s=plan["timeout_s"],
            pg_options=pg.MooncakeBackendOptions(active, False, 4),
        )
        out["mask_is_the_given_one"] = pg.get_active_ranks(W).data_ptr() == active.data_ptr()
        out["view0"] = view(W)
        pg.extend_group_size_to(W, 4)
        store.set(f"ready/{rank}", "1")
        out["activate"] = _admit(W, store, 3, pg.activate_ranks)
    else:
        _, store = start_rank(
            rank,
            world_size,
            port,
            barrier=False,  # the members are in the group already
            timeout_s=plan["timeout_s"],
            max_world_size=4,
            is_extension=True,
        )
        if role == "doomed":  # it said it waits to join; it dies before it does
            os.kill(os.getpid(), signal.SIGKILL)
        pg.join_group(W)
        pg.extend_group_size_to(W, 4)
        out["joined"] = view(W)
        out["sync_after_join"] = proposal_of_sync(pg.sync_after_failure(W))
        if role == "replacement":
            out["after"] = (attempt(lambda: mask(W)), view(W))
            return out
    # Ranks 0-2 and the joiner. The view version as the backend says it and as its
    # word reads in place (pg._view_version_reader), at each view.
    backend = pg._backend_of(W)
    reader = pg._view_version_reader(backend)
    out["versions"] = [(reader(), backend.view_version())]
    out["mask4"] = (attempt(lambda: mask(W)), view(W))
    if rank == 1:
        store.set("dying", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    while not store.check(["dead"]):
        time.sleep(0.005)
    out["mask3"] = (attempt(lambda: mask(W)), view(W))
    out["versions"].append((reader(), backend.view_version()))
    if rank == 0:
        store.set("spawn-doomed", "1")
    out["recover_doomed"] = _admit(W, store, 1, pg.recover_ranks, key="doomed-gone")
    out["after_doomed"] = (attempt(lambda: mask(W)), view(W))
    if rank == 0:
        store.set("spawn-replacement", "1")
    out["recover"] = _admit(W, store, 1, pg.recover_ranks)
    out["after"] = (attempt(lambda: mask(W)), view(W))
    out["versions"].append((reader(), backend.view_version()))
    return out


def _admit(W, store, slot: int, call, key: str | None = None):
    """Polls get_peer_state until a process waits as ``slot`` (and, with ``key``, until
    that store key is set), then admits it with ``call``; the response as data."""
    deadline = time.monotonic() + 60
    while True:
        ready = pg.get_peer_state(W, [slot])[0]
        # The same answer on every member (get_peer_state is collective), so all
        # leave the loop together; the key check is made identical through the mask.
        flag = torch.tensor([1 if ready and (key is None or store.check([key])) else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"no process waits to join as rank {slot}")
        time.sleep(0.05)
    return proposal(call(W, [slot]))
