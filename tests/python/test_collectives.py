"""Every collective × dtype × reduce op × size × world size, compared exactly.

Each case runs one collective on deterministic per-rank inputs (seeded from
the case name and the rank) and compares the result bit for bit with
``reference.py``, which every rank computes locally from all ranks' inputs.

Sizes: 0, 1, 7 and 1001 elements, and 5000 elements, which is larger than
the 4 KiB message slot the chunked launches use (``launcher.SMALL_CHUNKS``;
those launches also lower the all_reduce/reduce/broadcast threshold so that
mid-size tensors take the reduce-scatter + all-gather path). The
default-slot launches add tensors over 64 KiB and over 256 KiB.

Layouts: contiguous, strided (every other element of a buffer, whose other
elements must be left alone), transposed, offset (a slice in the middle of a
buffer) and 0-dim tensors, for a subset of dtypes. Rooted ops run every root
at world sizes up to 4, and roots {0, 3, N-1} at 8.

Also: the coalesced forms, torch's functional collectives, in-place
all-gather/reduce-scatter (FSDP/ZeRO style), the object helpers
(``all_gather_object``...), barrier semantics, which transport serves each
peer, and a latency bound that catches a backend that crawls when 8 ranks
share 2 cores.
"""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from launcher import SMALL_CHUNKS, Case, Launch, check, needs_cuda, parametrize, ucx_built
from reference import (
    COMPLEX_DTYPES,
    DTYPES,
    dtype_name,
    make_tensor,
    reduce_ops_for,
    reduce_ref,
    seed_of,
)

SIZES = (0, 1, 7, 1001, 5000)
#: Default 256 KiB slots: 20000 float32 = 78 KiB (> the 64 KiB direct
#: threshold); 70000 float32 = 273 KiB (> one slot).
BIG_SIZES = (20_000, 70_000)
LAYOUT_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
LAYOUT_SIZES = (7, 1001, 5000)
#: Non-contiguous views, and a contiguous one that starts inside a larger buffer.
LAYOUTS = ("strided", "transposed", "offset")
BIG_DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int8)


# --- helpers (rank side) --------------------------------------------------------------


def shape_of(n: int, layout: str) -> tuple[int, ...]:
    """Logical shape of an n-row tensor in ``layout`` (transposed ones have 3 columns,
    scalars are 0-dim)."""
    return {"transposed": (n, 3), "scalar": ()}.get(layout, (n,))


def placed(values: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, view): ``view`` holds ``values`` laid out as ``layout`` inside ``base``.

    ``strided`` puts the values in every other element of ``base``, and
    ``offset`` in the middle of a larger ``base``; the other elements hold a
    sentinel pattern that no op may touch.
    """
    if layout in ("contig", "scalar"):
        t = values.clone()
        return t, t
    if layout == "offset":
        k = values.numel()
        base = make_tensor((k + 10,), values.dtype, seed_of("sentinel", k))
        view = base[5 : 5 + k].view(values.shape)
        view.copy_(values)
        return base, view
    if layout == "strided":
        base = make_tensor((*values.shape, 2), values.dtype, seed_of("sentinel", values.numel()))
        view = base[..., 0]
        view.copy_(values)
        return base, view
    if layout == "transposed":
        base = values.t().contiguous()
        return base, base.t()
    raise ValueError(layout)


class Untouched:
    """Remembers the elements of ``base`` outside ``view`` and checks they did not change."""

    def __init__(self, base: torch.Tensor, view: torch.Tensor):
        mask = torch.ones(base.shape, dtype=torch.bool)
        if base.numel():
            mask.as_strided(
                view.shape, view.stride(), view.storage_offset() - base.storage_offset()
            ).fill_(False)
        self.base, self.mask, self.before = base, mask, base[mask].clone()

    def check(self, ctx, what: str = "elements outside the view") -> None:
        ctx.expect_equal(self.base[self.mask], self.before, what)


def garbage(shape, dtype, layout: str = "contig", tag: str = "garbage"):
    """An output buffer pre-filled with a pattern, so stale outputs are noticed."""
    return placed(make_tensor(shape, dtype, seed_of(tag, shape)), layout)


def redop(name: str):
    return getattr(dist.ReduceOp, name)


# --- the ops (rank side) --------------------------------------------------------------


def all_reduce(ctx, dtype, op, n, layout="contig"):
    shape = shape_of(n, layout)
    base, x = placed(ctx.input(shape, dtype), layout)
    guard = Untouched(base, x)
    dist.all_reduce(x, op=redop(op))
    ctx.expect_equal(x, reduce_ref(ctx.inputs(shape, dtype), op))
    guard.check(ctx)


def broadcast(ctx, dtype, n, root, layout="contig"):
    shape = shape_of(n, layout)
    base, x = placed(ctx.input(shape, dtype), layout)
    guard = Untouched(base, x)
    dist.broadcast(x, src=root)
    ctx.expect_equal(x, ctx.input(shape, dtype, root))
    guard.check(ctx)


def reduce(ctx, dtype, op, n, root, layout="contig"):
    shape = shape_of(n, layout)
    base, x = placed(ctx.input(shape, dtype), layout)
    guard = Untouched(base, x)
    dist.reduce(x, dst=root, op=redop(op))
    if ctx.rank == root:
        ctx.expect_equal(x, reduce_ref(ctx.inputs(shape, dtype), op))
    guard.check(ctx)


def all_gather(ctx, dtype, n, layout="contig"):
    shape = shape_of(n, layout)
    _, x = placed(ctx.input(shape, dtype), layout)
    outs = [garbage(shape, dtype, layout, f"out{r}") for r in range(ctx.world_size)]
    guards = [Untouched(b, v) for b, v in outs]
    dist.all_gather([v for _, v in outs], x)
    for r, (_, v) in enumerate(outs):
        ctx.expect_equal(v, ctx.input(shape, dtype, r), f"slot {r}")
        guards[r].check(ctx)
    ctx.expect_equal(x, ctx.input(shape, dtype), "input (must not change)")


def all_gather_into_tensor(ctx, dtype, n, form):
    """``form``: flat [N*n] output, stacked [N, n], or stacked but non-contiguous."""
    world = ctx.world_size
    x = ctx.input((n,), dtype)
    if form == "flat":
        _, out = garbage((world * n,), dtype)
    elif form == "stacked":
        _, out = garbage((world, n), dtype)
    else:
        _, out = garbage((world, n), dtype, "transposed")
    dist.all_gather_into_tensor(out, x)
    want = torch.stack(ctx.inputs((n,), dtype)) if n else torch.empty((world, 0), dtype=dtype)
    ctx.expect_equal(out.reshape(world, n), want)


def reduce_scatter(ctx, dtype, op, n):
    world = ctx.world_size
    full = ctx.input((world, n), dtype)
    _, out = garbage((n,), dtype)
    dist.reduce_scatter(out, list(full.unbind(0)), op=redop(op))
    parts = [t[ctx.rank] for t in ctx.inputs((world, n), dtype)]
    ctx.expect_equal(out, reduce_ref(parts, op))


def reduce_scatter_tensor(ctx, dtype, op, n, form="flat"):
    world = ctx.world_size
    full = ctx.input((world, n), dtype)
    if form == "flat":
        full = full.reshape(-1)
    elif form == "transposed":
        full = full.t().contiguous().t()
    _, out = garbage((n,), dtype)
    dist.reduce_scatter_tensor(out, full, op=redop(op))
    parts = [t[ctx.rank] for t in ctx.inputs((world, n), dtype)]
    ctx.expect_equal(out, reduce_ref(parts, op))


def all_gather_in_place(ctx, dtype, n):
    """FSDP-style: the input is this rank's slice of the output."""
    world, me = ctx.world_size, ctx.rank
    _, out = garbage((world * n,), dtype)
    mine = out[me * n : (me + 1) * n]
    mine.copy_(ctx.input((n,), dtype))
    dist.all_gather_into_tensor(out, mine)
    ctx.expect_equal(out, torch.cat(ctx.inputs((n,), dtype)))


def reduce_scatter_in_place(ctx, dtype, op, n):
    """ZeRO-style: the output is this rank's slice of the input."""
    world, me = ctx.world_size, ctx.rank
    full = ctx.input((world * n,), dtype)
    out = full[me * n : (me + 1) * n]
    dist.reduce_scatter_tensor(out, full, op=redop(op))
    parts = [t[me * n : (me + 1) * n] for t in ctx.inputs((world * n,), dtype)]
    ctx.expect_equal(out, reduce_ref(parts, op))


def objects(ctx):
    """The pickling helpers (which move uint8 tensors of per-rank sizes) round-trip."""
    world, me = ctx.world_size, ctx.rank

    def obj(r):
        return {"rank": r, "payload": list(range(r * 37)), "text": "x" * (r * 1000)}

    gathered = [None] * world
    dist.all_gather_object(gathered, obj(me))
    ctx.expect(gathered == [obj(r) for r in range(world)], "all_gather_object")
    root = world - 1
    items = [obj(root), "two", 3] if me == root else [None, None, None]
    dist.broadcast_object_list(items, src=root)
    ctx.expect(items == [obj(root), "two", 3], f"broadcast_object_list gave {items!r:.200}")
    out = [None] * world if me == 0 else None
    dist.gather_object(obj(me), out, dst=0)
    if me == 0:
        ctx.expect(out == [obj(r) for r in range(world)], "gather_object")
    got = [None]
    dist.scatter_object_list(
        got, [obj(10 + r) for r in range(world)] if me == root else None, src=root
    )
    ctx.expect(got == [obj(10 + me)], "scatter_object_list")


def split_sizes(n: int, world: int, mode: str) -> list[list[int]]:
    """``s[src][dst]``: rows ``src`` sends to ``dst``; uneven modes include zeros."""
    if mode.startswith("even"):
        return [[n] * world for _ in range(world)]
    if mode.startswith("uneven"):
        return [
            [0 if (s + d) % 3 == 0 else (n + 5 * s + 3 * d) % (n + 2) for d in range(world)]
            for s in range(world)
        ]
    if mode == "one_sender":  # only rank 0 sends, to everyone
        return [[n if s == 0 else 0 for _ in range(world)] for s in range(world)]
    raise ValueError(mode)


def all_to_all(ctx, dtype, n, mode):
    world, me = ctx.world_size, ctx.rank
    s = split_sizes(n, world, mode)
    ins = [ctx.input((s[me][d],), dtype, tag=f"to{d}") for d in range(world)]
    outs = [garbage((s[src][me],), dtype)[1] for src in range(world)]
    dist.all_to_all(outs, ins)
    for src in range(world):
        want = ctx.input((s[src][me],), dtype, src, tag=f"to{me}")
        ctx.expect_equal(outs[src], want, f"from rank {src}")


def all_to_all_single(ctx, dtype, n, mode):
    """``mode``: even/uneven/one_sender, with ``_2d`` rows of 3 and ``_t`` transposed input."""
    world, me = ctx.world_size, ctx.rank
    s = split_sizes(n, world, mode.split("_")[0] if mode != "one_sender" else mode)
    cols = (3,) if ("_2d" in mode or "_t" in mode) else ()

    def rows_of(src: int) -> torch.Tensor:
        return ctx.input((sum(s[src]), *cols), dtype, src)

    x = rows_of(me)
    if "_t" in mode:
        x = x.t().contiguous().t()
    _, out = garbage((sum(s[src][me] for src in range(world)), *cols), dtype)
    if mode.startswith("even"):
        dist.all_to_all_single(out, x)
    else:
        dist.all_to_all_single(
            out,
            x,
            output_split_sizes=[s[src][me] for src in range(world)],
            input_split_sizes=s[me],
        )
    want = []
    for src in range(world):
        start = sum(s[src][:me])
        want.append(rows_of(src)[start : start + s[src][me]])
    ctx.expect_equal(out, torch.cat(want))


def gather(ctx, dtype, n, root, layout="contig"):
    shape = shape_of(n, layout)
    _, x = placed(ctx.input(shape, dtype), layout)
    outs = [garbage(shape, dtype, layout)[1] for _ in range(ctx.world_size)]
    dist.gather(x, outs if ctx.rank == root else None, dst=root)
    if ctx.rank == root:
        for r, o in enumerate(outs):
            ctx.expect_equal(o, ctx.input(shape, dtype, r), f"slot {r}")


def scatter(ctx, dtype, n, root, layout="contig"):
    shape = shape_of(n, layout)
    base, out = garbage(shape, dtype, layout)
    guard = Untouched(base, out)
    sources = [ctx.input(shape, dtype, tag=f"to{d}") for d in range(ctx.world_size)]
    dist.scatter(out, sources if ctx.rank == root else None, src=root)
    ctx.expect_equal(out, ctx.input(shape, dtype, root, tag=f"to{ctx.rank}"))
    guard.check(ctx)


def barrier(ctx):
    """No rank leaves the barrier before every rank has entered it."""
    time.sleep(0.02 * ((ctx.rank * 7) % ctx.world_size))
    ctx.store.set(f"arrived/{ctx.rank}", "1")
    dist.barrier()
    arrived = [ctx.store.check([f"arrived/{r}"]) for r in range(ctx.world_size)]
    ctx.expect(all(arrived), f"left the barrier before ranks {arrived} had all arrived")


def callback_collective(ctx):
    """A Work's future callback that makes a blocking collective on the same group (a
    pipeline that reduces a second buffer once the first is done): it completes, with both
    results right, rather than wait for the op whose callback it is (which hung for ever)."""
    a = ctx.input((16,), torch.float32, tag="cb_a")
    b = ctx.input((16,), torch.float32, tag="cb_b")

    def then(_):
        dist.all_reduce(b)
        return b

    fut = dist.all_reduce(a, async_op=True).get_future().then(then)
    waiter = threading.Thread(target=fut.wait, daemon=True)
    waiter.start()
    waiter.join(30)
    ctx.expect(not waiter.is_alive(), "the callback's all_reduce did not finish within 30 s")
    if waiter.is_alive():
        return
    ctx.expect_equal(a, reduce_ref(ctx.inputs((16,), torch.float32, "cb_a"), "SUM"), "first")
    ctx.expect_equal(b, reduce_ref(ctx.inputs((16,), torch.float32, "cb_b"), "SUM"), "second")


def coalesced_all_reduce(ctx, n, async_ops=False):
    """Mixed dtypes in one coalesced all_reduce (the backend's allreduce_coalesced)."""
    dtypes = (torch.float32, torch.int64, torch.bfloat16, torch.uint8)
    xs = [ctx.input((n + i,), dt, tag=str(i)) for i, dt in enumerate(dtypes)]
    with dist._coalescing_manager(async_ops=async_ops) as cm:
        for x in xs:
            dist.all_reduce(x)
    if async_ops:
        cm.wait()
    for i, (x, dt) in enumerate(zip(xs, dtypes, strict=True)):
        ctx.expect_equal(x, reduce_ref(ctx.inputs((n + i,), dt, str(i)), "SUM"), dtype_name(dt))


def coalesced_all_reduce_legacy(ctx, n):
    """``dist.all_reduce_coalesced`` (one dtype, several tensors)."""
    xs = [ctx.input((n + i,), torch.float64, tag=str(i)) for i in range(3)]
    dist.all_reduce_coalesced(xs, op=dist.ReduceOp.MAX)
    for i, x in enumerate(xs):
        ctx.expect_equal(x, reduce_ref(ctx.inputs((n + i,), torch.float64, str(i)), "MAX"))


def coalesced_all_gather_into_tensor(ctx, n):
    world = ctx.world_size
    dtypes = (torch.float16, torch.int32)
    xs = [ctx.input((n + i,), dt, tag=str(i)) for i, dt in enumerate(dtypes)]
    outs = [garbage((world * (n + i),), dt)[1] for i, dt in enumerate(dtypes)]
    with dist._coalescing_manager():
        for out, x in zip(outs, xs, strict=True):
            dist.all_gather_into_tensor(out, x)
    for i, (out, dt) in enumerate(zip(outs, dtypes, strict=True)):
        ctx.expect_equal(out, torch.cat(ctx.inputs((n + i,), dt, str(i))), dtype_name(dt))


def coalesced_reduce_scatter_tensor(ctx, n):
    world = ctx.world_size
    dtypes = (torch.float32, torch.int16)
    ins = [ctx.input((world * (n + i),), dt, tag=str(i)) for i, dt in enumerate(dtypes)]
    outs = [garbage((n + i,), dt)[1] for i, dt in enumerate(dtypes)]
    with dist._coalescing_manager():
        for out, x in zip(outs, ins, strict=True):
            dist.reduce_scatter_tensor(out, x)
    for i, (out, dt) in enumerate(zip(outs, dtypes, strict=True)):
        m = n + i
        parts = [t[ctx.rank * m : (ctx.rank + 1) * m] for t in ctx.inputs((world * m,), dt, str(i))]
        ctx.expect_equal(out, reduce_ref(parts, "SUM"), dtype_name(dt))


def coalesced_all_gather_legacy(ctx, n):
    """``dist.all_gather_coalesced`` (the backend's allgather_coalesced)."""
    world = ctx.world_size
    xs = [ctx.input((n + i,), torch.int8, tag=str(i)) for i in range(2)]
    outs = [[garbage((n + i,), torch.int8)[1] for _ in range(world)] for i in range(2)]
    dist.all_gather_coalesced(outs, xs)
    for i in range(2):
        for r in range(world):
            ctx.expect_equal(outs[i][r], ctx.input((n + i,), torch.int8, r, str(i)), f"{i}/{r}")


def functional(ctx, n):
    """torch's functional collectives (what torch.compile'd code calls)."""
    world, me = ctx.world_size, ctx.rank
    group = dist.group.WORLD
    x = ctx.input((world * n,), torch.float32)
    xs = ctx.inputs((world * n,), torch.float32)
    got = funcol.all_reduce(x, "sum", group)
    ctx.expect_equal(funcol.wait_tensor(got), reduce_ref(xs, "SUM"), "all_reduce")
    got = funcol.all_gather_tensor(x, 0, group)
    ctx.expect_equal(funcol.wait_tensor(got), torch.cat(xs), "all_gather_tensor")
    got = funcol.reduce_scatter_tensor(x, "sum", 0, group)
    parts = [t[me * n : (me + 1) * n] for t in xs]
    ctx.expect_equal(funcol.wait_tensor(got), reduce_ref(parts, "SUM"), "reduce_scatter_tensor")
    got = funcol.all_to_all_single(x, [n] * world, [n] * world, group)
    want = torch.cat([t[me * n : (me + 1) * n] for t in xs])
    ctx.expect_equal(funcol.wait_tensor(got), want, "all_to_all_single")
    ctx.expect_equal(x, ctx.input((world * n,), torch.float32), "input (must not change)")


def latency(ctx, iters: int = 200, bound_ms: float = 20.0):
    """Small all_reduces do not crawl, even with 8 ranks on 2 cores (a wait that spins
    starves the peer it waits for). Measured: ~0.02 ms at 2 ranks, ~0.6 ms at 8; gloo
    takes ~1.8 ms at 8. The bound is generous so a busy machine does not fail it."""
    x = torch.ones(1)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    mean_ms = (time.perf_counter() - start) / iters * 1e3
    ctx.expect(mean_ms < bound_ms, f"small all_reduce takes {mean_ms:.2f} ms on average")


def transport(ctx, expected, hosts=()):
    """Which transport the backend chose for every peer (with ``hosts``, the host of each
    rank: shm on the same one, tcp to the others)."""
    from mooncake import pg

    backend = pg._backend_of(dist.group.WORLD)
    for peer in range(ctx.world_size):
        if peer != ctx.rank:
            want = expected
            if hosts:
                want = "shm" if hosts[peer] == hosts[ctx.rank] else "tcp"
            got = backend.transport_of(peer)
            ctx.expect(got == want, f"peer {peer} uses {got!r}, expected {want!r}")


# --- case lists (built identically in the parent and in every rank) ------------------


def _roots(world: int) -> tuple[int, ...]:
    return tuple(range(world)) if world <= 4 else tuple(sorted({0, 3, world - 1}))


def _case(cases: list[Case], name: str, fn, **kw) -> None:
    cases.append(Case(name, functools.partial(fn, **kw)))


def matrix(
    world: int,
    sizes=SIZES,
    dtypes=DTYPES,
    layouts: bool = True,
    extras: bool = True,
    transport_name: str = "shm",
    hosts: tuple[int, ...] = (),
) -> list[Case]:
    """The op × dtype × reduce-op × size matrix at one world size."""
    cases: list[Case] = []
    roots = _roots(world)
    add = functools.partial(_case, cases)
    for dtype in dtypes:
        d = dtype_name(dtype)
        for n in sizes:
            rot = seed_of(d, n) % world  # a root per (dtype, size), all of them over the matrix
            for op in reduce_ops_for(dtype):
                add(f"all_reduce/{d}/{op}/n{n}", all_reduce, dtype=dtype, op=op, n=n)
                add(f"reduce/{d}/{op}/n{n}/root{rot}", reduce, dtype=dtype, op=op, n=n, root=rot)
                add(
                    f"reduce_scatter_tensor/{d}/{op}/n{n}",
                    reduce_scatter_tensor,
                    dtype=dtype,
                    op=op,
                    n=n,
                )
            add(f"reduce_scatter/{d}/SUM/n{n}", reduce_scatter, dtype=dtype, op="SUM", n=n)
            add(f"broadcast/{d}/n{n}/root{rot}", broadcast, dtype=dtype, n=n, root=rot)
            add(f"all_gather/{d}/n{n}", all_gather, dtype=dtype, n=n)
            add(
                f"all_gather_into_tensor/{d}/n{n}",
                all_gather_into_tensor,
                dtype=dtype,
                n=n,
                form="flat",
            )
            add(f"gather/{d}/n{n}/root{rot}", gather, dtype=dtype, n=n, root=rot)
            add(f"scatter/{d}/n{n}/root{rot}", scatter, dtype=dtype, n=n, root=rot)
            for mode in ("even", "uneven"):
                add(f"all_to_all/{d}/n{n}/{mode}", all_to_all, dtype=dtype, n=n, mode=mode)
                add(
                    f"all_to_all_single/{d}/n{n}/{mode}",
                    all_to_all_single,
                    dtype=dtype,
                    n=n,
                    mode=mode,
                )
    if not extras:
        return cases
    for n in sizes:
        # Every root, every op of two dtypes (one through fp32 accumulation).
        for root in roots:
            for dtype, op in (
                (torch.float32, "SUM"),
                (torch.bfloat16, "AVG"),
                (torch.int16, "MAX"),
            ):
                d = dtype_name(dtype)
                add(
                    f"reduce/{d}/{op}/n{n}/root{root}/sweep",
                    reduce,
                    dtype=dtype,
                    op=op,
                    n=n,
                    root=root,
                )
            for dtype in (torch.float64, torch.uint8):
                d = dtype_name(dtype)
                add(f"broadcast/{d}/n{n}/root{root}/sweep", broadcast, dtype=dtype, n=n, root=root)
                add(f"gather/{d}/n{n}/root{root}/sweep", gather, dtype=dtype, n=n, root=root)
                add(f"scatter/{d}/n{n}/root{root}/sweep", scatter, dtype=dtype, n=n, root=root)
        for dtype in (torch.float32, torch.int32):
            d = dtype_name(dtype)
            for op in reduce_ops_for(dtype)[1:]:  # SUM is in the matrix above
                add(f"reduce_scatter/{d}/{op}/n{n}", reduce_scatter, dtype=dtype, op=op, n=n)
        for form in ("stacked", "stacked_t"):
            add(
                f"all_gather_into_tensor/float32/n{n}/{form}",
                all_gather_into_tensor,
                dtype=torch.float32,
                n=n,
                form=form,
            )
        for form in ("stacked", "transposed"):
            add(
                f"reduce_scatter_tensor/int64/SUM/n{n}/{form}",
                reduce_scatter_tensor,
                dtype=torch.int64,
                op="SUM",
                n=n,
                form=form,
            )
        for mode in ("even_2d", "uneven_2d", "uneven_t", "one_sender"):
            add(
                f"all_to_all_single/float64/n{n}/{mode}",
                all_to_all_single,
                dtype=torch.float64,
                n=n,
                mode=mode,
            )
        for dtype in COMPLEX_DTYPES:
            d = dtype_name(dtype)
            for op in reduce_ops_for(dtype):
                add(f"all_reduce/{d}/{op}/n{n}", all_reduce, dtype=dtype, op=op, n=n)
            add(f"broadcast/{d}/n{n}/root{world - 1}", broadcast, dtype=dtype, n=n, root=world - 1)
            add(f"all_gather/{d}/n{n}", all_gather, dtype=dtype, n=n)
            add(f"reduce/{d}/AVG/n{n}/root0", reduce, dtype=dtype, op="AVG", n=n, root=0)
            add(
                f"reduce_scatter_tensor/{d}/SUM/n{n}",
                reduce_scatter_tensor,
                dtype=dtype,
                op="SUM",
                n=n,
            )
            add(
                f"all_to_all_single/{d}/n{n}/uneven",
                all_to_all_single,
                dtype=dtype,
                n=n,
                mode="uneven",
            )
        for dtype in (torch.float32, torch.bfloat16, torch.int8):
            d = dtype_name(dtype)
            add(f"all_gather_in_place/{d}/n{n}", all_gather_in_place, dtype=dtype, n=n)
            op = "AVG" if dtype.is_floating_point else "BXOR"
            add(
                f"reduce_scatter_in_place/{d}/{op}/n{n}",
                reduce_scatter_in_place,
                dtype=dtype,
                op=op,
                n=n,
            )
        add(f"coalesced/all_reduce/n{n}", coalesced_all_reduce, n=n)
        add(f"coalesced/all_reduce_async/n{n}", coalesced_all_reduce, n=n, async_ops=True)
        add(f"coalesced/all_reduce_legacy/n{n}", coalesced_all_reduce_legacy, n=n)
        add(f"coalesced/all_gather_into_tensor/n{n}", coalesced_all_gather_into_tensor, n=n)
        add(f"coalesced/reduce_scatter_tensor/n{n}", coalesced_reduce_scatter_tensor, n=n)
        add(f"coalesced/all_gather_legacy/n{n}", coalesced_all_gather_legacy, n=n)
        add(f"functional/n{n}", functional, n=n)
    if layouts:
        for dtype in LAYOUT_DTYPES:
            d = dtype_name(dtype)
            op = "MAX" if dtype == torch.bool else "SUM"
            shapes = [
                (f"n{n}/{lay}", n, lay) for n in sizes if n in LAYOUT_SIZES for lay in LAYOUTS
            ]
            for tail, n, layout in [*shapes, ("scalar", 1, "scalar")]:
                root = seed_of("layout", d, tail) % world
                kw = {"dtype": dtype, "n": n, "layout": layout}
                add(f"all_reduce/{d}/{op}/{tail}", all_reduce, op=op, **kw)
                add(f"reduce/{d}/{op}/{tail}/root{root}", reduce, op=op, root=root, **kw)
                add(f"broadcast/{d}/{tail}/root{root}", broadcast, root=root, **kw)
                add(f"all_gather/{d}/{tail}", all_gather, **kw)
                add(f"gather/{d}/{tail}/root{root}", gather, root=root, **kw)
                add(f"scatter/{d}/{tail}/root{root}", scatter, root=root, **kw)
    add("barrier", barrier)
    add("callback_collective", callback_collective)
    add("objects", objects)
    add("latency/all_reduce_x200", latency)
    if world > 1:
        add(f"transport/{transport_name}", transport, expected=transport_name, hosts=hosts)
    return cases


def big(
    world: int, sizes=BIG_SIZES, dtypes=BIG_DTYPES, transport_name="shm", hosts=()
) -> list[Case]:
    """Tensors beyond the default 64 KiB threshold and the default 256 KiB slot."""
    cases: list[Case] = []
    add = functools.partial(_case, cases)
    for dtype in dtypes:
        d = dtype_name(dtype)
        for n in sizes:
            root = seed_of("big", d, n) % world
            ops = ("SUM", "AVG") if dtype.is_floating_point else ("SUM", "BXOR")
            for op in ops:
                add(f"all_reduce/{d}/{op}/n{n}", all_reduce, dtype=dtype, op=op, n=n)
            add(f"reduce/{d}/SUM/n{n}/root{root}", reduce, dtype=dtype, op="SUM", n=n, root=root)
            add(f"broadcast/{d}/n{n}/root{root}", broadcast, dtype=dtype, n=n, root=root)
            add(
                f"reduce_scatter_tensor/{d}/MIN/n{n}",
                reduce_scatter_tensor,
                dtype=dtype,
                op="MIN",
                n=n,
            )
            add(
                f"all_gather_into_tensor/{d}/n{n}",
                all_gather_into_tensor,
                dtype=dtype,
                n=n,
                form="flat",
            )
            add(
                f"all_to_all_single/{d}/n{n}/uneven",
                all_to_all_single,
                dtype=dtype,
                n=n,
                mode="uneven",
            )
            add(f"gather/{d}/n{n}/root{root}", gather, dtype=dtype, n=n, root=root)
            add(f"scatter/{d}/n{n}/root{root}", scatter, dtype=dtype, n=n, root=root)
    n = BIG_SIZES[-1]
    add(
        f"all_reduce/float32/SUM/n{n}/strided",
        all_reduce,
        dtype=torch.float32,
        op="SUM",
        n=n,
        layout="strided",
    )
    add(
        f"broadcast/bfloat16/n{n}/transposed/root0",
        broadcast,
        dtype=torch.bfloat16,
        n=n,
        root=0,
        layout="transposed",
    )
    if world > 1:
        add(f"transport/{transport_name}", transport, expected=transport_name, hosts=hosts)
    return cases


# --- the same cases on CUDA tensors (backend "mooncake") ---------------------------------

#: Cases that call torch.distributed in ways DeviceDist does not mirror (coalescing blocks,
#: functional collectives; test_cuda_backend.py has CUDA versions of them).
# (callback_collective: the CUDA backend's futures are not yet run with it on the GPU)
NOT_ON_DEVICE = ("coalesced/", "functional/", "callback_collective")


def _on_device(fn, ctx) -> None:
    """Runs case ``fn`` with this module's ``dist`` moving its tensors to the GPU."""
    from device_dist import DeviceDist

    global dist
    host_dist, dist = dist, DeviceDist("cuda")
    try:
        fn(ctx)
    finally:
        dist = host_dist


def plane_served(ctx, plane: str) -> None:
    """Which path served the launch's ops on the world group (``pg.get_op_paths``), so that a
    bypassed device plane fails: ``all``, every op on the plane; ``on``, some; ``off``, none."""
    from mooncake import pg

    paths = pg.get_op_paths()
    device, staged = paths["device"], paths["staged"]
    want = {"all": device > 0 and staged == 0, "on": device > 0, "off": device == 0 and staged > 0}
    ctx.expect(want[plane], f"plane {plane}: {device} ops on the device plane, {staged} staged")


def on_device(world: int, of: str = "matrix", plane: str = "on", **params) -> list[Case]:
    """The cases of ``of`` (matrix or big) with CUDA tensors, then a check of which path
    served them (``plane_served``)."""
    cases = {"matrix": matrix, "big": big}[of](world, **params)
    return [
        *(
            Case(c.name, functools.partial(_on_device, c.fn))
            for c in cases
            if not c.name.startswith(NOT_ON_DEVICE)
        ),
        Case("plane_served", functools.partial(plane_served, plane=plane)),
    ]


# --- launches -----------------------------------------------------------------------------

TCP = (("MOONCAKE_TRANSPORT", "tcp"), *SMALL_CHUNKS)
UCX = (("MOONCAKE_TRANSPORT", "ucx"), *SMALL_CHUNKS)
SAMPLE = (("sizes", (0, 7, 5000)),)
SAMPLE_DTYPES = (torch.bool, torch.int8, torch.int64, torch.bfloat16, torch.float32)

LAUNCHES = [
    *(Launch(matrix, w, f"w{w}-chunk4k", env=SMALL_CHUNKS) for w in (1, 2, 3, 4)),
    Launch(
        matrix,
        8,
        "w8-chunk4k-sample",
        env=SMALL_CHUNKS,
        params=(*SAMPLE, ("dtypes", SAMPLE_DTYPES), ("layouts", False)),
    ),
    Launch(big, 3, "w3-default"),
    Launch(
        big,
        3,
        "w3-tcp-default",
        env=(("MOONCAKE_TRANSPORT", "tcp"),),
        params=(("transport_name", "tcp"),),
    ),
    Launch(
        matrix,
        3,
        "w3-tcp-sample",
        env=TCP,
        params=(*SAMPLE, ("dtypes", SAMPLE_DTYPES), ("transport_name", "tcp")),
    ),
    # The ucx transport (UCX over tcp and shared memory here), where the build has it.
    *(
        [
            Launch(
                big,
                3,
                "w3-ucx-default",
                env=(("MOONCAKE_TRANSPORT", "ucx"),),
                params=(("transport_name", "ucx"),),
                stress=True,  # the big tensors over ucx run across hosts by default
            ),
            Launch(
                matrix,
                3,
                "w3-ucx-sample",
                env=UCX,
                params=(*SAMPLE, ("dtypes", SAMPLE_DTYPES), ("transport_name", "ucx")),
            ),
        ]
        if ucx_built()
        else []
    ),
    # make stress: the full matrix at 8 ranks, and the big tensors at 4 and 8.
    Launch(matrix, 8, "w8-chunk4k", env=SMALL_CHUNKS, timeout_s=590, stress=True),
    Launch(big, 4, "w4-default", stress=True),
    Launch(big, 8, "w8-default", stress=True, timeout_s=590),
    Launch(matrix, 4, "w4-tcp", env=TCP, params=(("transport_name", "tcp"),), stress=True),
]

#: With a GPU (make gpu-check), all on CUDA tensors: the matrix at 1, 2 and 4 processes
#: sharing it, every op on the device plane (at 4 through a 16 KiB segment, so that larger
#: inputs move through it in pieces; at 2 again with the plane off), the big tensors at 2,
#: and a tcp sample (staged: the plane serves groups on one host only).
SEGMENT = "MOONCAKE_CUDA_SEGMENT_BYTES"
PLANE_ALL = (("MOONCAKE_CUDA_PLANE_MIN_BYTES", "0"),)  # every size that fits takes the plane
CUDA_LAUNCHES = [
    *(
        Launch(
            on_device,
            w,
            f"cuda-w{w}-chunk4k",
            env=(*SMALL_CHUNKS, *PLANE_ALL),
            params=(("plane", "all"),),
            backend="mooncake",
        )
        for w in (1, 2)
    ),
    Launch(
        on_device,
        4,
        "cuda-w4-chunk4k-seg16k",
        env=(*SMALL_CHUNKS, *PLANE_ALL, (SEGMENT, "16384")),
        params=(("plane", "all"),),
        backend="mooncake",
    ),
    Launch(
        on_device,
        2,
        "cuda-w2-chunk4k-staged",
        env=(*SMALL_CHUNKS, (SEGMENT, "0")),
        params=(("plane", "off"),),
        backend="mooncake",
    ),
    Launch(
        on_device, 2, "cuda-w2-default", env=PLANE_ALL, params=(("of", "big"),), backend="mooncake"
    ),
    Launch(
        on_device,
        3,
        "cuda-w3-tcp-sample",
        env=TCP,
        params=(*SAMPLE, ("dtypes", SAMPLE_DTYPES), ("transport_name", "tcp"), ("plane", "off")),
        backend="mooncake",
    ),
]


@pytest.mark.parametrize(("launch", "case"), parametrize(LAUNCHES))
def test_collective(launch, case):
    """The case's result equals the local reference bit for bit on every rank."""
    check(launch, case)


@needs_cuda
@pytest.mark.parametrize(("launch", "case"), parametrize(CUDA_LAUNCHES))
def test_collective_cuda(launch, case):
    """The same, with CUDA tensors on the ``mooncake`` backend."""
    check(launch, case)
