"""Point-to-point: send/recv, isend/irecv, tags, any-source, batch_isend_irecv.

Every message is a deterministic tensor seeded from (case, sender, tag), so
the receiver knows exactly what must arrive. Sizes cover 0, 1, odd, and
larger than the 4 KiB message slot of the chunked launches (and than the
default 256 KiB slot in the default launch).
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from launcher import SMALL_CHUNKS, Case, Launch, check, parametrize, ucx_built
from reference import COMPLEX_DTYPES, DTYPES, dtype_name, make_tensor, seed_of

SIZES = (0, 1, 7, 1001, 5000)
BIG = 70_000  # float32: 273 KiB, more than one default 256 KiB slot


def message(ctx, src: int, dst: int, n, dtype, tag: int = 0) -> torch.Tensor:
    """The tensor ``src`` sends to ``dst`` (shape ``n`` or ``(n,)``) with ``tag``."""
    shape = n if isinstance(n, tuple) else (n,)
    return make_tensor(shape, dtype, seed_of(ctx.case, src, dst, tag))


def empty_like_msg(n, dtype) -> torch.Tensor:
    shape = n if isinstance(n, tuple) else (n,)
    return make_tensor(shape, dtype, seed_of("garbage", shape))


# --- cases (rank side) ---------------------------------------------------------------------


def ring_blocking(ctx, dtype, n):
    """Every rank sends to the next, then receives from the previous: send must not block."""
    world, me = ctx.world_size, ctx.rank
    nxt, prv = (me + 1) % world, (me - 1) % world
    dist.send(message(ctx, me, nxt, n, dtype), dst=nxt)
    got = empty_like_msg(n, dtype)
    dist.recv(got, src=prv)
    ctx.expect_equal(got, message(ctx, prv, me, n, dtype))


def all_pairs_async(ctx, dtype, n):
    """isend to and irecv from every peer at once; all complete with the right data."""
    world, me = ctx.world_size, ctx.rank
    sends = [dist.isend(message(ctx, me, p, n, dtype), dst=p) for p in range(world) if p != me]
    bufs = {p: empty_like_msg(n, dtype) for p in range(world) if p != me}
    recvs = {p: dist.irecv(bufs[p], src=p) for p in bufs}
    for p, work in recvs.items():
        work.wait()
        ctx.expect_equal(bufs[p], message(ctx, p, me, n, dtype), f"from rank {p}")
    for work in sends:
        work.wait()
        ctx.expect(work.is_completed(), "a waited-for isend is not completed")


def noncontiguous(ctx, n):
    """Send from a strided view and receive into a transposed view."""
    world, me = ctx.world_size, ctx.rank
    if world < 2:
        return
    if me == 0:
        full = message(ctx, 0, 1, (n, 6), torch.float32)
        dist.send(full[:, ::2], dst=1)  # (n, 3), strides (6, 2)
    elif me == 1:
        base = empty_like_msg((3, n), torch.float32)
        view = base.t()  # (n, 3), non-contiguous
        dist.recv(view, src=0)
        ctx.expect_equal(view, message(ctx, 0, 1, (n, 6), torch.float32)[:, ::2].contiguous())


def tags_out_of_order(ctx, n):
    """Messages with tags 1, 2, 3 sent in that order are received as 3, 1, 2 by tag."""
    world, me = ctx.world_size, ctx.rank
    if world < 2:
        return
    src, dst = world - 1, 0
    if me == src:
        works = [
            dist.isend(message(ctx, src, dst, n + t, torch.int32, t), dst, tag=t) for t in (1, 2, 3)
        ]
        for w in works:
            w.wait()
    elif me == dst:
        for t in (3, 1, 2):
            got = empty_like_msg(n + t, torch.int32)
            dist.recv(got, src=src, tag=t)
            ctx.expect_equal(got, message(ctx, src, dst, n + t, torch.int32, t), f"tag {t}")


def same_tag_in_order(ctx, n):
    """Several messages with one (source, tag) arrive in the order they were sent."""
    world, me = ctx.world_size, ctx.rank
    if world < 2:
        return
    if me == 1:
        for k in range(5):
            dist.send(message(ctx, 1, 0, n, torch.float64, 100 + k), dst=0, tag=7)
    elif me == 0:
        for k in range(5):
            got = empty_like_msg(n, torch.float64)
            dist.recv(got, src=1, tag=7)
            ctx.expect_equal(got, message(ctx, 1, 0, n, torch.float64, 100 + k), f"message {k}")


def any_source(ctx, n):
    """recv(src=None) returns the sender, and the data is that sender's."""
    world, me = ctx.world_size, ctx.rank
    root = world - 1
    if me != root:
        time.sleep(0.01 * ((3 * me) % world))  # shuffle arrival order
        dist.send(message(ctx, me, root, n, torch.int64), dst=root)
        return
    seen = []
    for _ in range(world - 1):
        got = empty_like_msg(n, torch.int64)
        sender = dist.recv(got, src=None)
        seen.append(sender)
        if 0 <= sender < world:
            ctx.expect_equal(got, message(ctx, sender, root, n, torch.int64), f"from {sender}")
    ctx.expect(sorted(seen) == [r for r in range(world) if r != root], f"senders were {seen}")


def any_source_by_tag(ctx, n):
    """recv(src=None, tag=t) takes only a message with tag t, whoever sent the others first."""
    world, me = ctx.world_size, ctx.rank
    if world < 3:
        return
    if me == 1:
        dist.send(message(ctx, 1, 0, n, torch.int16, 6), dst=0, tag=6)
        ctx.store.set("tag6-sent", "1")
    elif me == 2:
        ctx.store.wait(["tag6-sent"], timedelta(seconds=20))
        dist.send(message(ctx, 2, 0, n, torch.int16, 5), dst=0, tag=5)
    elif me == 0:
        ctx.store.wait(["tag6-sent"], timedelta(seconds=20))
        for tag, sender in ((5, 2), (6, 1)):
            got = empty_like_msg(n, torch.int16)
            src = dist.recv(got, src=None, tag=tag)
            ctx.expect(src == sender, f"tag {tag} came from rank {src}, expected {sender}")
            ctx.expect_equal(got, message(ctx, sender, 0, n, torch.int16, tag), f"tag {tag}")


def any_source_async(ctx, n):
    """irecv(src=None): the work's source_rank() names the sender."""
    world, me = ctx.world_size, ctx.rank
    if world < 2:
        return
    if me != 0:
        dist.send(message(ctx, me, 0, n, torch.float16, 5), dst=0, tag=5)
        return
    bufs = [empty_like_msg(n, torch.float16) for _ in range(world - 1)]
    works = [dist.irecv(b, src=None, tag=5) for b in bufs]
    seen = []
    for b, w in zip(bufs, works, strict=True):
        w.wait()
        sender = w.source_rank()
        seen.append(sender)
        if 0 < sender < world:
            ctx.expect_equal(b, message(ctx, sender, 0, n, torch.float16, 5), f"from {sender}")
    ctx.expect(sorted(seen) == list(range(1, world)), f"source ranks were {seen}")


def batch_ring(ctx, dtype, n):
    """batch_isend_irecv: each rank sends to both neighbours and receives from both."""
    world, me = ctx.world_size, ctx.rank
    if world < 2:
        return
    nxt, prv = (me + 1) % world, (me - 1) % world
    from_prv, from_nxt = empty_like_msg(n, dtype), empty_like_msg(n, dtype)
    ops = [
        dist.P2POp(dist.isend, message(ctx, me, nxt, n, dtype, 1), nxt, tag=1),
        dist.P2POp(dist.isend, message(ctx, me, prv, n, dtype, 2), prv, tag=2),
        dist.P2POp(dist.irecv, from_prv, prv, tag=1),
        dist.P2POp(dist.irecv, from_nxt, nxt, tag=2),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    ctx.expect_equal(from_prv, message(ctx, prv, me, n, dtype, 1), "from the previous rank")
    ctx.expect_equal(from_nxt, message(ctx, nxt, me, n, dtype, 2), "from the next rank")


def batch_with_a_bad_op(ctx, n):
    """A batch with one bad op raises ValueError naming it and posts none of its ops: its
    recv does not linger to take the next message, and the next batch gets exactly what
    the peers send in it."""
    world, me = ctx.world_size, ctx.rank
    nxt, prv = (me + 1) % world, (me - 1) % world
    lingering = empty_like_msg(n, torch.float32)
    before = lingering.clone()
    bad = [
        dist.P2POp(dist.irecv, lingering, prv, tag=3),
        dist.P2POp(dist.isend, message(ctx, me, nxt, n, torch.float32, 9), world, tag=3),
    ]
    try:
        dist.batch_isend_irecv(bad)
    except ValueError as e:
        if "dst" not in str(e):
            ctx.fail(f"the error does not name dst: {e}")
    else:
        ctx.fail("a batch with a send to rank world_size raised nothing")
    got = empty_like_msg(n, torch.float32)
    ops = [
        dist.P2POp(dist.isend, message(ctx, me, nxt, n, torch.float32, 3), nxt, tag=3),
        dist.P2POp(dist.irecv, got, prv, tag=3),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    ctx.expect_equal(got, message(ctx, prv, me, n, torch.float32, 3), "the next batch")
    ctx.expect_equal(lingering, before, "the failed batch's recv buffer")


def p2p_between_collectives(ctx, n):
    """An isend posted before a collective is received after it; both planes stay correct."""
    world, me = ctx.world_size, ctx.rank
    nxt, prv = (me + 1) % world, (me - 1) % world
    send = dist.isend(message(ctx, me, nxt, n, torch.float32), dst=nxt)
    x = ctx.input((n,), torch.float32)
    dist.all_reduce(x)
    want = ctx.inputs((n,), torch.float32)
    acc = want[0].clone()
    for t in want[1:]:
        acc += t
    ctx.expect_equal(x, acc, "all_reduce")
    got = empty_like_msg(n, torch.float32)
    dist.recv(got, src=prv)
    send.wait()
    ctx.expect_equal(got, message(ctx, prv, me, n, torch.float32), "message")


def send_before_recv(ctx, n):
    """Blocking sends return before the receiver has posted anything (messages larger than
    the slot included); the receives posted afterwards get them in order."""
    world, me = ctx.world_size, ctx.rank
    if world < 2:
        return
    if me == 1:
        for k in range(3):
            dist.send(message(ctx, 1, 0, n, torch.float64, k), dst=0, tag=11)
        ctx.store.set("sent", "1")
    elif me == 0:
        ctx.store.wait(["sent"], timedelta(seconds=20))
        for k in range(3):
            got = empty_like_msg(n, torch.float64)
            dist.recv(got, src=1, tag=11)
            ctx.expect_equal(got, message(ctx, 1, 0, n, torch.float64, k), f"message {k}")


def wrong_recv_size(ctx, have: int):
    """Receiving a 10-element message into a ``have``-element buffer raises ValueError on the
    receiver; p2p between the same ranks works afterwards."""
    world, me = ctx.world_size, ctx.rank
    if world < 2:
        return
    if me == 1:
        work = dist.isend(message(ctx, 1, 0, 10, torch.float32), dst=0)
        try:
            work.wait()
        except (ValueError, RuntimeError):
            pass  # the sender may or may not learn of the receiver's error
    elif me == 0:
        with ctx.expect_raises(ValueError, "bytes"):
            dist.recv(empty_like_msg(have, torch.float32), src=1)
    ctx.store_barrier("after-mismatch")
    if me == 1:
        dist.send(message(ctx, 1, 0, 9, torch.float32, 1), dst=0, tag=1)
    elif me == 0:
        got = empty_like_msg(9, torch.float32)
        dist.recv(got, src=1, tag=1)
        ctx.expect_equal(got, message(ctx, 1, 0, 9, torch.float32, 1), "next message")


def recv_timeout(ctx):
    """A recv that no one answers raises TimeoutError at the group's deadline."""
    if ctx.world_size < 2 or ctx.rank != 0:
        return
    start = time.monotonic()
    with ctx.expect_raises(TimeoutError):
        dist.recv(torch.empty(3), src=1, tag=999)
    took = time.monotonic() - start
    ctx.expect(0.5 <= took < 20, f"timed out after {took:.1f} s, the deadline is 1.5 s")


def many_small(ctx):
    """1000 tiny messages to the next rank, all isend'd at once, arrive in order."""
    world, me = ctx.world_size, ctx.rank
    if world < 2:
        return
    nxt, prv = (me + 1) % world, (me - 1) % world
    sends = [dist.isend(torch.tensor([me * 10_000 + k]), dst=nxt) for k in range(1000)]
    got = [torch.tensor([-1]) for _ in range(1000)]
    recvs = [dist.irecv(g, src=prv) for g in got]
    for w in recvs + sends:
        w.wait()
    values = [int(g.item()) for g in got]
    ctx.expect(values == [prv * 10_000 + k for k in range(1000)], f"got {values[:5]}...")


# --- case lists ---------------------------------------------------------------------------


def p2p_cases(world: int, sizes=SIZES, dtypes=DTYPES + COMPLEX_DTYPES) -> list[Case]:
    cases: list[Case] = []

    def add(name, fn, **kw):
        cases.append(Case(name, functools.partial(fn, **kw)))

    if world == 1:
        return cases
    for dtype in dtypes:
        d = dtype_name(dtype)
        for n in sizes:
            add(f"ring_blocking/{d}/n{n}", ring_blocking, dtype=dtype, n=n)
            add(f"all_pairs_async/{d}/n{n}", all_pairs_async, dtype=dtype, n=n)
            add(f"batch_ring/{d}/n{n}", batch_ring, dtype=dtype, n=n)
    for n in sizes:
        add(f"noncontiguous/n{n}", noncontiguous, n=n)
        add(f"tags_out_of_order/n{n}", tags_out_of_order, n=n)
        add(f"same_tag_in_order/n{n}", same_tag_in_order, n=n)
        add(f"any_source/n{n}", any_source, n=n)
        add(f"any_source_async/n{n}", any_source_async, n=n)
        add(f"any_source_by_tag/n{n}", any_source_by_tag, n=n)
        add(f"p2p_between_collectives/n{n}", p2p_between_collectives, n=n)
        add(f"send_before_recv/n{n}", send_before_recv, n=n)
    add("many_small", many_small)
    add("batch_with_a_bad_op", batch_with_a_bad_op, n=1001)
    add("wrong_recv_size/smaller", wrong_recv_size, have=7)
    add("wrong_recv_size/larger", wrong_recv_size, have=13)
    return cases


def big_cases(world: int) -> list[Case]:
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        d = dtype_name(dtype)
        cases += [
            Case(f"ring_blocking/{d}/n{BIG}", functools.partial(ring_blocking, dtype=dtype, n=BIG)),
            Case(f"batch_ring/{d}/n{BIG}", functools.partial(batch_ring, dtype=dtype, n=BIG)),
            Case(
                f"all_pairs_async/{d}/n{BIG}",
                functools.partial(all_pairs_async, dtype=dtype, n=BIG),
            ),
        ]
    cases.append(Case(f"tags_out_of_order/n{BIG}", functools.partial(tags_out_of_order, n=BIG)))
    cases.append(Case(f"any_source/n{BIG}", functools.partial(any_source, n=BIG)))
    cases.append(Case(f"send_before_recv/n{BIG}", functools.partial(send_before_recv, n=BIG)))
    return cases


def timeout_cases(world: int) -> list[Case]:
    return [Case("recv_timeout", recv_timeout)]


TCP = (("MOONCAKE_TRANSPORT", "tcp"), *SMALL_CHUNKS)
LAUNCHES = [
    *(Launch(p2p_cases, w, f"w{w}-chunk4k", env=SMALL_CHUNKS) for w in (2, 3, 4)),
    Launch(big_cases, 3, "w3-default"),
    Launch(
        p2p_cases,
        3,
        "w3-tcp-sample",
        env=TCP,
        params=(("sizes", (0, 7, 5000)), ("dtypes", (torch.float32, torch.int8))),
    ),
    *(
        [
            Launch(
                p2p_cases,
                3,
                "w3-ucx-sample",
                env=(("MOONCAKE_TRANSPORT", "ucx"), *SMALL_CHUNKS),
                params=(("sizes", (0, 7, 5000)), ("dtypes", (torch.float32, torch.int8))),
            )
        ]
        if ucx_built()
        else []
    ),
    Launch(timeout_cases, 2, "w2-timeout", op_timeout_s=1.5),
    Launch(p2p_cases, 8, "w8-chunk4k", env=SMALL_CHUNKS, stress=True, timeout_s=590),
    Launch(big_cases, 8, "w8-default", stress=True),
]


@pytest.mark.parametrize(("launch", "case"), parametrize(LAUNCHES))
def test_p2p(launch, case):
    """Every message arrives intact at the intended receiver, on every rank."""
    check(launch, case)
