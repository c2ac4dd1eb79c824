"""Subgroups (``new_group``, overlapping ones too) and the group lifecycle.

* Collectives and P2P inside subgroups cover exactly the members, with
  global ranks as roots; overlapping groups may have ops in flight at once.
* ``pg.get_active_ranks``/``get_num_synced_ranks`` describe each group.
* ``destroy_process_group`` (of the world or of one subgroup) leaves no
  threads (``/proc/self/task``), file descriptors (``/proc/self/fd``) or
  ``/dev/shm`` entries behind, and the next ``init_process_group`` over the
  same store works.
"""

from __future__ import annotations

import functools
import gc
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from launcher import SMALL_CHUNKS, Case, Launch, check, parametrize, ucx_built
from reference import reduce_ref


def snapshot() -> dict:
    """Threads, open file descriptors (with targets) and /dev/shm entries of this process."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the directory listing's own fd, closed by now
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": fds,
        "shm": set(os.listdir("/dev/shm")),
    }


def expect_no_leaks(ctx, before: dict, when: str) -> None:
    """Compares a fresh snapshot with ``before``; threads may take a moment to exit."""
    gc.collect()
    deadline = time.monotonic() + 3
    after = snapshot()
    while after["threads"] > before["threads"] and time.monotonic() < deadline:
        time.sleep(0.05)
        after = snapshot()
    ctx.expect(
        after["threads"] <= before["threads"],
        f"{when}: {after['threads'] - before['threads']} more threads than before "
        f"({before['threads']} -> {after['threads']})",
    )
    extra = {fd: t for fd, t in after["fds"].items() if before["fds"].get(fd) != t}
    ctx.expect(
        not extra,
        f"{when}: {len(extra)} file descriptors left open: {sorted(set(extra.values()))[:8]}",
    )
    ctx.expect(
        not (after["shm"] - before["shm"]),
        f"{when}: new /dev/shm entries {sorted(after['shm'] - before['shm'])}",
    )


def exercise(ctx, group=None) -> None:
    """Touches every moving part: direct and chunked collectives, async ops, and P2P."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    for n in (5, 5000):
        x = ctx.input((n,), torch.float32, tag=f"ex{n}")
        dist.all_reduce(x, group=group)
        want = reduce_ref([ctx.input((n,), torch.float32, r, f"ex{n}") for r in ranks], "SUM")
        ctx.expect_equal(x, want, f"all_reduce of {n}")
    works = [dist.all_reduce(torch.ones(100), group=group, async_op=True) for _ in range(4)]
    for w in works:
        w.wait()
    if world > 1:
        nxt, prv = ranks[(me + 1) % world], ranks[(me - 1) % world]
        send = dist.isend(torch.full((3000,), float(ctx.rank)), dst=nxt, group=group)
        got = torch.empty(3000)
        dist.recv(got, src=prv, group=group)
        send.wait()
        ctx.expect_equal(got, torch.full((3000,), float(prv)), "p2p")
    dist.barrier(group=group)


# --- lifecycle --------------------------------------------------------------------------------


def no_leaks(ctx, cycles: int = 2):
    """init -> use (world and a subgroup) -> destroy, twice over the same store namespace:
    back to the threads, fds and /dev/shm of before the first init each time."""
    import mooncake.pg  # noqa: F401 - registers the backend

    torch.ones(1000).sum()  # torch's own lazy threads, if any, before the baseline
    if torch.cuda.is_available():
        # With a CUDA torch, init_process_group brings up the CUDA driver (its
        # device fds, pipes and thread live for the process): torch's, not ours.
        torch.cuda.init()
    # /dev/shm is the host's, not this process's: every rank takes its snapshots while
    # no rank holds a group (UCX's shared memory, for one, is named per context).
    ctx.store_barrier("baseline")
    before = snapshot()
    ctx.store_barrier("baselined")
    for cycle in range(cycles):
        ctx.init_pg(store_prefix="lifecycle")
        exercise(ctx)
        sub = dist.new_group(list(range(0, ctx.world_size, 2)))
        if ctx.rank % 2 == 0:
            exercise(ctx, sub)
        during = snapshot()  # the measurement must see the backend's resources
        ctx.expect(
            during["threads"] > before["threads"] and len(during["fds"]) > len(before["fds"]),
            f"while in use: {during['threads']} threads, {len(during['fds'])} fds; "
            f"before: {before['threads']}, {len(before['fds'])}",
        )
        dist.destroy_process_group()
        ctx.expect(not dist.is_initialized(), "still initialized after destroy_process_group")
        ctx.store_barrier(f"destroyed/{cycle}")
        expect_no_leaks(ctx, before, f"after destroy #{cycle + 1}")
        ctx.store_barrier(f"checked/{cycle}")


def destroy_in_flight(ctx):
    """destroy_process_group with ops in flight returns promptly: an op only rank 0 issued
    fails, or (when the others' departure reached rank 0 first: their destroy closes their
    connections, which reads as their failure) completes among the survivors, rank 0
    alone; ops every rank issued either complete or fail; nothing is left behind."""
    before = snapshot()
    ctx.init_pg(timeout=timedelta(seconds=60))
    exercise(ctx)
    everyone = [dist.all_reduce(torch.ones(5000), async_op=True) for _ in range(3)]
    lonely_t = torch.ones(7)
    lonely = dist.all_reduce(lonely_t, async_op=True) if ctx.rank == 0 else None
    for w in everyone:
        w.wait()
    ctx.store_barrier("issued")
    start = time.monotonic()
    dist.destroy_process_group()
    took = time.monotonic() - start
    ctx.expect(took < 10, f"destroy_process_group took {took:.1f} s with an op in flight")
    if lonely is not None:
        try:
            lonely.wait(timeout=timedelta(seconds=10))
        except RuntimeError:
            pass  # shut down under it
        else:  # a reduction over the survivors: rank 0's own ones
            ctx.expect(torch.equal(lonely_t, torch.ones(7)), f"the lone all_reduce: {lonely_t}")
    ctx.store_barrier("destroyed")
    expect_no_leaks(ctx, before, "after destroying a group with an op in flight")


def init(ctx):
    """The default group for the subgroup cases."""
    ctx.init_pg()
    exercise(ctx)


def subgroup_destroy(ctx, count: int = 8):
    """Creating, using and destroying subgroups one by one leaves nothing behind, and the
    world group keeps working."""
    before = snapshot()
    for _ in range(count):
        g = dist.new_group(list(range(ctx.world_size)))
        exercise(ctx, g)
        dist.destroy_process_group(g)
    expect_no_leaks(ctx, before, f"after {count} subgroups were destroyed")
    exercise(ctx)


# --- subgroups ----------------------------------------------------------------------------------


def _members_sum(ctx, members, n, tag):
    return reduce_ref([ctx.input((n,), torch.int64, r, tag) for r in members], "SUM")


def disjoint(ctx):
    """Even and odd ranks each reduce, broadcast and gather among themselves only."""
    world, me = ctx.world_size, ctx.rank
    evens, odds = list(range(0, world, 2)), list(range(1, world, 2))
    groups = {0: dist.new_group(evens), 1: dist.new_group(odds)}
    members = evens if me % 2 == 0 else odds
    g = groups[me % 2]
    x = ctx.input((1001,), torch.int64, tag="x")
    dist.all_reduce(x, group=g)
    ctx.expect_equal(x, _members_sum(ctx, members, 1001, "x"), "all_reduce")
    root = members[-1]
    y = ctx.input((7,), torch.bfloat16, tag="y")
    dist.broadcast(y, src=root, group=g)
    ctx.expect_equal(y, ctx.input((7,), torch.bfloat16, root, "y"), f"broadcast from {root}")
    out = torch.empty(len(members) * 5, dtype=torch.float64)
    dist.all_gather_into_tensor(out, ctx.input((5,), torch.float64, tag="z"), group=g)
    want = torch.cat([ctx.input((5,), torch.float64, r, "z") for r in members])
    ctx.expect_equal(out, want, "all_gather_into_tensor")


def overlapping(ctx, asynchronous: bool):
    """Groups that share ranks: each rank runs an all_reduce in every group it belongs to,
    in one global order (blocking), or all at once (async)."""
    world, me = ctx.world_size, ctx.rank
    specs = [list(range(world - 1)), list(range(1, world)), [0, world - 1], list(range(world))]
    specs = [s for s in specs if s]
    groups = [dist.new_group(s) for s in specs]
    pending = []
    for i, (members, g) in enumerate(zip(specs, groups, strict=True)):
        if me not in members:
            continue
        x = ctx.input((5000,), torch.int64, tag=f"g{i}")
        work = dist.all_reduce(x, group=g, async_op=asynchronous)
        pending.append((i, members, x, work))
    for i, members, x, work in pending:
        if work is not None:
            work.wait()
        ctx.expect_equal(x, _members_sum(ctx, members, 5000, f"g{i}"), f"group {members}")


def rooted_global_ranks(ctx):
    """In a group given as [last, 1], roots are global ranks: broadcast/reduce/gather/scatter
    reach the right members."""
    world, me = ctx.world_size, ctx.rank
    if world < 3:
        return
    members = sorted({world - 1, 1})
    g = dist.new_group([world - 1, 1])
    if me not in members:
        return
    hi, lo = members[-1], members[0]
    x = ctx.input((9,), torch.float32, tag="b")
    dist.broadcast(x, src=hi, group=g)
    ctx.expect_equal(x, ctx.input((9,), torch.float32, hi, "b"), "broadcast")
    y = ctx.input((9,), torch.int32, tag="r")
    dist.reduce(y, dst=hi, group=g, op=dist.ReduceOp.MAX)
    if me == hi:
        want = reduce_ref([ctx.input((9,), torch.int32, r, "r") for r in members], "MAX")
        ctx.expect_equal(y, want, "reduce")
    outs = [torch.empty(4) for _ in members]
    dist.gather(
        ctx.input((4,), torch.float32, tag="g"), outs if me == lo else None, dst=lo, group=g
    )
    if me == lo:
        for r, o in zip(members, outs, strict=True):
            ctx.expect_equal(o, ctx.input((4,), torch.float32, r, "g"), f"gather from {r}")
    got = torch.empty(4)
    sources = [ctx.input((4,), torch.float32, tag=f"s{r}") for r in members]
    dist.scatter(got, sources if me == hi else None, src=hi, group=g)
    ctx.expect_equal(got, ctx.input((4,), torch.float32, hi, f"s{me}"), "scatter")


def subgroup_p2p(ctx):
    """send/recv inside a subgroup address peers by global rank."""
    world, me = ctx.world_size, ctx.rank
    members = list(range(1, world))
    g = dist.new_group(members)
    if me not in members or len(members) < 2:
        return
    i = members.index(me)
    nxt, prv = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
    send = dist.isend(ctx.input((6000,), torch.float16, tag=f"to{nxt}"), dst=nxt, group=g)
    got = torch.empty(6000, dtype=torch.float16)
    dist.recv(got, src=prv, group=g)
    send.wait()
    ctx.expect_equal(got, ctx.input((6000,), torch.float16, prv, f"to{me}"))


def helpers(ctx):
    """get_active_ranks/get_num_synced_ranks describe each group, sized to the group."""
    from mooncake import pg

    world = ctx.world_size
    members = list(range(0, world, 2))
    g = dist.new_group(members)
    checks = [(dist.group.WORLD, world)]
    if ctx.rank in members:
        checks.append((g, len(members)))
    for group, size in checks:
        active = pg.get_active_ranks(group)
        ctx.expect(
            active.dtype == torch.int32 and active.tolist() == [1] * size,
            f"active ranks of a {size}-rank group: {active}",
        )
        synced = pg.get_num_synced_ranks(group)
        ctx.expect(synced == size, f"num_synced_ranks of a {size}-rank group is {synced}")


def many_alive(ctx, count: int = 16):
    """``count`` groups alive at once, each with an op in flight, then all destroyed: every
    result is right and nothing is left behind."""
    world = ctx.world_size
    before = snapshot()
    groups = [dist.new_group(list(range(world))) for _ in range(count)]
    xs = [ctx.input((3000,), torch.int32, tag=f"g{i}") for i in range(count)]
    works = [dist.all_reduce(x, group=g, async_op=True) for x, g in zip(xs, groups, strict=True)]
    for i, (x, w) in enumerate(zip(xs, works, strict=True)):
        w.wait()
        want = reduce_ref(ctx.inputs((3000,), torch.int32, f"g{i}"), "SUM")
        ctx.expect_equal(x, want, f"group {i}")
    for g in groups:
        dist.destroy_process_group(g)
    expect_no_leaks(ctx, before, f"after destroying {count} live groups")


def single_member(ctx):
    """Groups of one rank: collectives are the identity."""
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    g = groups[ctx.rank]
    x = ctx.input((100,), torch.float64)
    dist.all_reduce(x, group=g)
    ctx.expect_equal(x, ctx.input((100,), torch.float64), "all_reduce")
    out = torch.empty(100, dtype=torch.float64)
    dist.all_gather_into_tensor(out, x, group=g)
    ctx.expect_equal(out, x, "all_gather_into_tensor")


def group_cases(world: int) -> list[Case]:
    return [
        Case("lifecycle/no_leaks", no_leaks),
        Case("lifecycle/destroy_in_flight", destroy_in_flight),
        Case("init", init),
        Case("new_group/disjoint", disjoint),
        Case("new_group/overlapping_blocking", functools.partial(overlapping, asynchronous=False)),
        Case("new_group/overlapping_async", functools.partial(overlapping, asynchronous=True)),
        Case("new_group/rooted_global_ranks", rooted_global_ranks),
        Case("new_group/p2p", subgroup_p2p),
        Case("new_group/helpers", helpers),
        Case("new_group/single_member", single_member),
        Case("new_group/destroy", subgroup_destroy),
        Case("new_group/many_alive", many_alive),
    ]


TCP = (("MOONCAKE_TRANSPORT", "tcp"), *SMALL_CHUNKS)
LAUNCHES = [
    Launch(group_cases, 4, "w4-chunk4k", env=SMALL_CHUNKS, init_pg=False),
    Launch(group_cases, 3, "w3-tcp", env=TCP, init_pg=False),
    *(
        [
            Launch(
                group_cases,
                3,
                "w3-ucx",
                env=(("MOONCAKE_TRANSPORT", "ucx"), *SMALL_CHUNKS),
                init_pg=False,
            )
        ]
        if ucx_built()
        else []
    ),
    Launch(group_cases, 8, "w8-chunk4k", env=SMALL_CHUNKS, init_pg=False, stress=True),
]


@pytest.mark.parametrize(("launch", "case"), parametrize(LAUNCHES))
def test_group(launch, case):
    """Subgroups compute over exactly their members; teardown leaves nothing behind."""
    check(launch, case)
