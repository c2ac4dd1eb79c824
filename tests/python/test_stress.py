"""Randomized sequences: many collectives and P2P messages of random op, dtype, size and root,
up to 8 in flight at once, checked exactly.

Every rank draws the same schedule from a seeded generator (the seed is in
the case name, so a failure can be replayed with ``-k``); each op is issued
with ``async_op=True`` and checked when its window is drained. This is the
interleaving test: back-to-back ops of different sizes and algorithms
(direct, chunked, reduce-scatter + all-gather) with P2P traffic between them.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.distributed as dist

from launcher import SMALL_CHUNKS, Case, Launch, check, parametrize
from reference import DTYPES, dtype_name, reduce_ops_for, reduce_ref, seed_of

KINDS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "ring_p2p",
)


def _size(rng: random.Random) -> int:
    """Mostly small, sometimes beyond the 4 KiB slot, rarely beyond 64 KiB."""
    return rng.choice((0, 1, 2, 3, 7, 31, 100, 1001, 3000, 5000, 17_000, 40_000))


def issue(ctx, rng: random.Random, step: int):
    """Issues one random op; returns (works, check) where ``check()`` compares results."""
    world, me = ctx.world_size, ctx.rank
    kind = rng.choice(KINDS)
    dtype = rng.choice(DTYPES)
    n = _size(rng)
    root = rng.randrange(world)
    op = rng.choice(reduce_ops_for(dtype))
    tag = f"s{step}"
    what = f"step {step}: {kind} {dtype_name(dtype)} n={n} root={root} op={op}"
    mine = ctx.input((n,), dtype, tag=tag)

    def everyone(shape=(n,)):
        return ctx.inputs(shape, dtype, tag)

    if kind == "all_reduce":
        work = dist.all_reduce(mine, op=getattr(dist.ReduceOp, op), async_op=True)
        return [work], lambda: ctx.expect_equal(mine, reduce_ref(everyone(), op), what)
    if kind == "broadcast":
        work = dist.broadcast(mine, src=root, async_op=True)
        return [work], lambda: ctx.expect_equal(mine, everyone()[root], what)
    if kind == "reduce":
        work = dist.reduce(mine, dst=root, op=getattr(dist.ReduceOp, op), async_op=True)
        if me != root:
            return [work], lambda: None
        return [work], lambda: ctx.expect_equal(mine, reduce_ref(everyone(), op), what)
    if kind == "all_gather_into_tensor":
        out = torch.empty(world * n, dtype=dtype)
        work = dist.all_gather_into_tensor(out, mine, async_op=True)
        return [work], lambda: ctx.expect_equal(out, torch.cat(everyone()), what)
    if kind == "reduce_scatter_tensor":
        full = ctx.input((world * n,), dtype, tag=tag)
        out = torch.empty(n, dtype=dtype)
        work = dist.reduce_scatter_tensor(out, full, op=getattr(dist.ReduceOp, op), async_op=True)
        parts = [t[me * n : (me + 1) * n] for t in everyone((world * n,))]
        return [work], lambda: ctx.expect_equal(out, reduce_ref(parts, op), what)
    if kind == "all_to_all_single":
        splits = [[rng.choice((0, 1, 5, n)) for _ in range(world)] for _ in range(world)]
        rows = [ctx.input((sum(splits[s]),), dtype, s, tag) for s in range(world)]
        out = torch.empty(sum(splits[s][me] for s in range(world)), dtype=dtype)
        work = dist.all_to_all_single(
            out,
            rows[me],
            output_split_sizes=[splits[s][me] for s in range(world)],
            input_split_sizes=splits[me],
            async_op=True,
        )
        want = torch.cat(
            [rows[s][sum(splits[s][:me]) : sum(splits[s][: me + 1])] for s in range(world)]
        )
        return [work], lambda: ctx.expect_equal(out, want, what)
    if kind == "gather":
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
        work = dist.gather(mine, outs if me == root else None, dst=root, async_op=True)

        def check_gather():
            if me == root:
                for r, (o, w) in enumerate(zip(outs, everyone(), strict=True)):
                    ctx.expect_equal(o, w, f"{what} slot {r}")

        return [work], check_gather
    if kind == "scatter":
        out = torch.empty(n, dtype=dtype)
        chunks = [ctx.input((n,), dtype, tag=f"{tag}to{d}") for d in range(world)]
        work = dist.scatter(out, chunks if me == root else None, src=root, async_op=True)
        want = ctx.input((n,), dtype, root, f"{tag}to{me}")
        return [work], lambda: ctx.expect_equal(out, want, what)
    if kind == "barrier":
        return [dist.barrier(async_op=True)], lambda: None
    # ring_p2p: send to the next rank, receive from the previous, with the step as tag.
    if world == 1:
        return [], lambda: None
    nxt, prv = (me + 1) % world, (me - 1) % world
    got = torch.empty(n, dtype=dtype)
    works = [
        dist.isend(mine, dst=nxt, tag=step),
        dist.irecv(got, src=prv, tag=step),
    ]
    return works, lambda: ctx.expect_equal(got, everyone()[prv], what)


def random_sequence(ctx, seed: int, steps: int, window: int):
    """``steps`` random ops, at most ``window`` in flight, all results exact."""
    rng = random.Random(seed)
    pending = []
    for step in range(steps):
        pending.append(issue(ctx, rng, step))
        if len(pending) >= rng.randint(1, window):
            for works, check_result in pending:
                for w in works:
                    w.wait()
                check_result()
            pending = []
    for works, check_result in pending:
        for w in works:
            w.wait()
        check_result()


def random_cases(world: int, seeds=(1, 2, 3), steps: int = 300, window: int = 8) -> list[Case]:
    return [
        Case(
            f"random/seed{s}/steps{steps}",
            functools.partial(
                random_sequence, seed=seed_of("stress", s), steps=steps, window=window
            ),
        )
        for s in seeds
    ]


TCP = (("MOONCAKE_TRANSPORT", "tcp"), *SMALL_CHUNKS)
MANY = (("seeds", tuple(range(10))), ("steps", 400))
LAUNCHES = [
    Launch(random_cases, 3, "w3-chunk4k", env=SMALL_CHUNKS),
    Launch(random_cases, 5, "w5-chunk4k", env=SMALL_CHUNKS, params=MANY, stress=True),
    Launch(
        random_cases, 8, "w8-chunk4k", env=SMALL_CHUNKS, params=MANY, stress=True, timeout_s=590
    ),
    Launch(random_cases, 6, "w6-default", params=MANY, stress=True, timeout_s=590),
    Launch(random_cases, 4, "w4-tcp", env=TCP, params=MANY, stress=True),
]


@pytest.mark.parametrize(("launch", "case"), parametrize(LAUNCHES))
def test_random(launch, case):
    """A random interleaving of ops gives exact results on every rank."""
    check(launch, case)
