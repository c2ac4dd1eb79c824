"""The ``mooncake`` backend with CUDA tensors: what the CPU cases cannot show.

(test_collectives.py runs its whole op x dtype x size x layout matrix on CUDA
tensors too, and test_fault_tolerance.py kills ranks of a CUDA group.) Here:

* stream semantics: an op is ordered after the caller's current stream and
  issuing it does not wait for the GPU; ``wait()`` makes the current stream wait
  for the results; ``get_future()`` resolves to the device tensors;
* coalescing blocks, ``batch_isend_irecv``, functional collectives, p2p (also
  from any source) on CUDA tensors;
* one group serves CPU tensors too; ``active_ranks`` is a CUDA int32 tensor;
* which path served an op (``pg.get_op_paths``): the device-driven kernels, the device
  plane or the staged path, each where it should;
* the device-driven kernels (up to ``MOONCAKE_CUDA_DIRECT_BYTES``: eagerly all_reduce,
  all_gather_into_tensor, reduce_scatter_tensor and their coalesced forms, the rooted
  ops and the list forms of all_gather and reduce_scatter; all_to_all and
  all_to_all_single eagerly at any size, parts of any sizes; under CUDA graph capture
  all_gather_coalesced, all_to_all's list form and all_to_all_single with equal split
  sizes too): all_reduce one-shot and two-shot, and every other op, equal to the
  host-driven paths (a ``MOONCAKE_CUDA_DIRECT=off`` group) and the reference bit for bit;
  one graph of every capturable op replayed with new inputs; which ops cannot be
  captured, and that capture needs one eager call first; and, in a launch of its own
  (``test_graph_replay_masks_a_killed_rank``), a rank killed between replays: the
  survivors' replays finish at once and cover the others;
* bad input (CPU and CUDA tensors mixed, split sizes that disagree between ranks, an op
  under CUDA graph capture that cannot be captured) raises ValueError naming the argument
  on every rank (on the device-driven kernels, on the rank that made the bad call, whose
  part the others find zero-filled), and the group goes on;
* ranks on different GPUs of one host (``test_cuda_backend_multi_gpu``, marked
  ``multi_gpu``: it needs 2 GPUs): the op matrix and the plane's cases again, every op on
  the plane, and a tensor on another GPU than its rank's rejected.

Runs only with a GPU and a CUDA build (``make gpu-check``); several processes
share the one GPU, except in the ``multi_gpu`` launches.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from capture import graph as _graph
from launcher import TEARDOWN, Case, Launch, check, needs_cuda, parametrize, run
from reference import reduce_ops_for, reduce_ref

pytestmark = needs_cuda

#: GPU cycles of the sleep that keeps a stream busy (~0.1-0.2 s on an H200).
SLEEP_CYCLES = 200_000_000


def cuda(t: torch.Tensor) -> torch.Tensor:
    return t.to("cuda")


def stream_order(ctx):
    """Inputs written on a side stream behind a long GPU sleep: the call returns while the
    GPU still sleeps (it queued work, it did not wait for it); after ``wait()``, work on
    that stream sees the result."""
    side = torch.cuda.Stream()
    n = 1001
    xs = ctx.inputs((n,), torch.float32)
    x = torch.zeros(n, device="cuda")
    mine = cuda(xs[ctx.rank])  # (a copy from pageable memory would wait for the sleep)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.copy_(mine)
        asleep = torch.cuda.Event()
        asleep.record()
        work = dist.all_reduce(x, async_op=True)
        ctx.expect(not asleep.query(), "all_reduce waited for the caller's stream to finish")
        work.wait()
        y = x * 2
    side.synchronize()
    ctx.expect_equal(y.cpu(), reduce_ref(xs, "SUM") * 2)


def default_stream(ctx):
    """A synchronous op on the default stream, read back at once, and again after a
    kernel that changes the tensor (the results' copy must not land after it)."""
    for dtype in (torch.bfloat16, torch.int64):
        xs = ctx.inputs((5000,), dtype)
        x = cuda(xs[ctx.rank])
        dist.all_reduce(x)
        ctx.expect_equal(x.cpu(), reduce_ref(xs, "SUM"), f"{dtype}")
        x += 1
        ctx.expect_equal(x.cpu(), reduce_ref(xs, "SUM") + 1, f"{dtype} after +1")


def future(ctx):
    """get_future() resolves to the device tensors; a then() chain sees them."""
    xs = ctx.inputs((7,), torch.float32)
    x = cuda(xs[ctx.rank])
    fut = dist.all_reduce(x, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    got = fut.wait()
    ctx.expect(got[0].is_cuda, "future value is not on the GPU")
    ctx.expect_equal(got[0].cpu(), reduce_ref(xs, "SUM"))
    ctx.expect_equal(doubled.wait().cpu(), reduce_ref(xs, "SUM") * 2, "then()")


def in_flight(ctx):
    """Ten async ops of mixed kinds in flight, waited for in reverse order."""
    world = ctx.world_size
    checks, works = [], []
    for i in range(10):
        x = cuda(ctx.input((100 + i,), torch.float32, tag=str(i)))
        if i % 2:
            works.append(dist.all_reduce(x, async_op=True))
            checks.append((x, reduce_ref(ctx.inputs((100 + i,), torch.float32, str(i)), "SUM")))
        else:
            out = torch.empty(world * (100 + i), device="cuda")
            works.append(dist.all_gather_into_tensor(out, x, async_op=True))
            checks.append((out, torch.cat(ctx.inputs((100 + i,), torch.float32, str(i)))))
    for w in reversed(works):
        w.wait()
    for i, (got, want) in enumerate(checks):
        ctx.expect_equal(got.cpu(), want, f"op {i}")
    ctx.expect(all(w.is_completed() and w.is_success() for w in works), "work not completed")


def coalesced(ctx, async_ops):
    """A coalescing block of mixed-dtype all_reduces and an all_gather_into_tensor, then the
    other coalesced forms (``_coalesced_rest``)."""
    dtypes = (torch.float32, torch.int64, torch.bfloat16, torch.uint8)
    hosts = [ctx.input((50 + i,), dt, tag=str(i)) for i, dt in enumerate(dtypes)]
    xs = [cuda(h) for h in hosts]
    with dist._coalescing_manager(async_ops=async_ops) as cm:
        for x in xs:
            dist.all_reduce(x)
    if async_ops:
        cm.wait()
    for i, (x, dt) in enumerate(zip(xs, dtypes, strict=True)):
        ctx.expect_equal(x.cpu(), reduce_ref(ctx.inputs((50 + i,), dt, str(i)), "SUM"), f"{dt}")
    world = ctx.world_size
    ins = [cuda(ctx.input((9,), torch.float32, tag=f"ag{i}")) for i in range(2)]
    outs = [torch.empty(world * 9, device="cuda") for _ in range(2)]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins, strict=True):
            dist.all_gather_into_tensor(o, i)
    for k, o in enumerate(outs):
        ctx.expect_equal(o.cpu(), torch.cat(ctx.inputs((9,), torch.float32, f"ag{k}")), "ag")
    _coalesced_rest(ctx)


def _garbage(shape, dtype) -> torch.Tensor:
    """An output that no right answer equals: NaN, or -77 for integers (177 unsigned)."""
    value = float("nan") if dtype.is_floating_point else -77 if dtype.is_signed else 177
    return torch.full(shape, value, dtype=dtype, device="cuda")


def _coalesced_rest(ctx):
    """A coalesced reduce_scatter_tensor and the legacy all_reduce_coalesced and
    all_gather_coalesced, into outputs that start as garbage."""
    world, me = ctx.world_size, ctx.rank
    dtypes = (torch.float32, torch.int16)
    ins = [cuda(ctx.input((world * (20 + i),), dt, tag=f"rs{i}")) for i, dt in enumerate(dtypes)]
    outs = [_garbage((20 + i,), dt) for i, dt in enumerate(dtypes)]
    with dist._coalescing_manager():
        for o, x in zip(outs, ins, strict=True):
            dist.reduce_scatter_tensor(o, x)
    for i, (o, dt) in enumerate(zip(outs, dtypes, strict=True)):
        m = 20 + i
        parts = [t[me * m : (me + 1) * m] for t in ctx.inputs((world * m,), dt, f"rs{i}")]
        ctx.expect_equal(o.cpu(), reduce_ref(parts, "SUM"), f"coalesced reduce_scatter_tensor {dt}")
    xs = [cuda(ctx.input((30 + i,), torch.float64, tag=f"arc{i}")) for i in range(3)]
    dist.all_reduce_coalesced(xs, op=dist.ReduceOp.MAX)
    for i, x in enumerate(xs):
        want = reduce_ref(ctx.inputs((30 + i,), torch.float64, f"arc{i}"), "MAX")
        ctx.expect_equal(x.cpu(), want, f"all_reduce_coalesced {i}")
    xs = [cuda(ctx.input((11 + i,), torch.int8, tag=f"agc{i}")) for i in range(2)]
    outs = [[_garbage((11 + i,), torch.int8) for _ in range(world)] for i in range(2)]
    dist.all_gather_coalesced(outs, xs)
    for i in range(2):
        for r in range(world):
            want = ctx.input((11 + i,), torch.int8, r, f"agc{i}")
            ctx.expect_equal(outs[i][r].cpu(), want, f"all_gather_coalesced {i}/{r}")


def functional(ctx):
    """torch's functional collectives on CUDA tensors."""
    world, n = ctx.world_size, 6
    xs = ctx.inputs((world * n,), torch.float32)
    x = cuda(xs[ctx.rank])
    group = dist.group.WORLD
    got = funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
    ctx.expect_equal(got.cpu(), reduce_ref(xs, "SUM"), "all_reduce")
    got = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))
    ctx.expect_equal(got.cpu(), torch.cat(xs), "all_gather_tensor")
    got = funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, group))
    parts = [t[ctx.rank * n : (ctx.rank + 1) * n] for t in xs]
    ctx.expect_equal(got.cpu(), reduce_ref(parts, "SUM"), "reduce_scatter_tensor")
    got = funcol.wait_tensor(funcol.all_to_all_single(x, [n] * world, [n] * world, group))
    want = torch.cat([t[ctx.rank * n : (ctx.rank + 1) * n] for t in xs])
    ctx.expect_equal(got.cpu(), want, "all_to_all_single")
    ctx.expect_equal(x.cpu(), xs[ctx.rank], "input (must not change)")


def p2p(ctx):
    """A ring of send/recv, then isend/irecv, batch_isend_irecv and a recv from any source."""
    world, me = ctx.world_size, ctx.rank
    nxt, prv = (me + 1) % world, (me - 1) % world
    if world == 1:
        return
    mine = cuda(ctx.input((3000,), torch.int64))
    buf = torch.full((3000,), -1, dtype=torch.int64, device="cuda")
    if me % 2 == 0:
        dist.send(mine, nxt)
        dist.recv(buf, prv)
    else:
        dist.recv(buf, prv)
        dist.send(mine, nxt)
    ctx.expect_equal(buf.cpu(), ctx.input((3000,), torch.int64, prv), "send/recv")
    buf.fill_(-1)
    works = [dist.irecv(buf, prv), dist.isend(mine, nxt)]
    for w in works:
        w.wait()
    ctx.expect_equal(buf.cpu(), ctx.input((3000,), torch.int64, prv), "isend/irecv")
    buf.fill_(-1)
    ops = [dist.P2POp(dist.irecv, buf, prv), dist.P2POp(dist.isend, mine, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ctx.expect_equal(buf.cpu(), ctx.input((3000,), torch.int64, prv), "batch_isend_irecv")
    # Every rank but 0 sends to rank 0, which receives from any source.
    if me == 0:
        seen = set()
        for _ in range(world - 1):
            b = torch.empty(3, dtype=torch.int64, device="cuda")
            src = dist.recv(b)
            seen.add(src)
            ctx.expect_equal(b.cpu(), torch.full((3,), src, dtype=torch.int64), f"from {src}")
        ctx.expect(seen == set(range(1, world)), f"any-source recv saw {sorted(seen)}")
    else:
        dist.send(torch.full((3,), me, dtype=torch.int64, device="cuda"), 0)


def cpu_tensors_too(ctx):
    """The same group takes CPU tensors (mooncake-cpu's path, no staging)."""
    xs = ctx.inputs((1001,), torch.float64)
    x = xs[ctx.rank].clone()
    dist.all_reduce(x)
    ctx.expect_equal(x, reduce_ref(xs, "SUM"))


def active_ranks(ctx):
    """get_active_ranks() is the backend's CUDA int32 mask, all ones."""
    from mooncake import pg

    a = pg.get_active_ranks()
    ctx.expect(a.is_cuda and a.dtype == torch.int32, f"active_ranks is {a.device} {a.dtype}")
    ctx.expect(a.cpu().tolist() == [1] * ctx.world_size, f"active_ranks {a.tolist()}")
    ctx.expect(pg.get_num_synced_ranks() == ctx.world_size, "num_synced_ranks")


def _usable(ctx, what):
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    ctx.expect(x.cpu().tolist() == [float(ctx.world_size)] * 4, f"group unusable after {what}")


def bad_input(ctx):
    """Mixed CPU/CUDA tensors raise ValueError naming the argument on every rank; so does
    one rank's bad call of a list form, or a root's bad gather_list (the kernels' launch
    is watched: that rank raises naming the argument, after taking part without data, and
    the others' Works, and their futures, raise naming that rank). One rank's bad call of a tensor form (not
    watched): that rank raises, naming the argument, after taking part without data; the
    others' op completes with its part zero-filled. The group goes on. (A tensor on another
    GPU than the rank's is rejected the same way: ``other_gpu``, with 2 GPUs.)"""
    world, me = ctx.world_size, ctx.rank
    x = torch.ones(4, device="cuda")
    with ctx.expect_raises(ValueError, "all_gather_into_tensor", "input_tensor", "cpu"):
        dist.all_gather_into_tensor(torch.empty(4 * world, device="cuda"), torch.ones(4))
    _usable(ctx, "mixed devices")
    if world > 1:
        bad = me == 0
        out = [torch.empty(4) if bad else torch.empty(4, device="cuda") for _ in range(world)]
        with ctx.expect_raises(ValueError, ("tensor_list", "rank 0")):
            dist.all_gather(out, x)
        _usable(ctx, "one rank's bad call")
        # A root's list one short (on the kernels: the root takes part without data, and
        # the others' Works raise what their launches found).
        parts = [torch.empty(4, device="cuda") for _ in range(world - 1)] if bad else None
        with ctx.expect_raises(ValueError, ("gather_list", "rank 0")):
            dist.gather(x, parts, dst=0)
        _usable(ctx, "a root's bad gather_list")
        # The same through the Work's future: it carries what the launch found.
        with ctx.expect_raises(ValueError, ("gather_list", "rank 0")):
            dist.gather(x, parts, dst=0, async_op=True).get_future().wait()
        _usable(ctx, "a root's bad gather_list, through get_future()")
    # Rank 0's output on the CPU: the op is decided from the input (on the GPU everywhere).
    y = torch.full((4,), float(me + 1), device="cuda")
    if me == 0:
        with ctx.expect_raises(ValueError, "all_gather_into_tensor", "tensors", "cpu"):
            dist.all_gather_into_tensor(torch.empty(4 * world), y)
    else:
        out = _garbage((4 * world,), torch.float32)
        got = _paths(lambda: dist.all_gather_into_tensor(out, y), direct=True)
        ctx.expect(got == DIRECT, f"all_gather_into_tensor beside a bad call: {got}")
        want = torch.cat([torch.zeros(4), *(torch.full((4,), r + 1.0) for r in range(1, world))])
        ctx.expect_equal(out.cpu(), want, "all_gather_into_tensor beside rank 0's bad call")
    _usable(ctx, "one rank's bad call on the device-driven kernels")


def split_mismatch(ctx):
    """all_to_all_single whose split sizes disagree on one edge (rank 0 sends rank 1 a row
    more than rank 1 expects): ValueError on every rank, and the group goes on."""
    world, n = ctx.world_size, 3
    if world == 1:
        return
    send = [n + 1 if (ctx.rank == 0 and d == 1) else n for d in range(world)]
    x = torch.ones(sum(send), 2, device="cuda")
    out = torch.empty(world * n, 2, device="cuda")
    with ctx.expect_raises(ValueError, "split sizes"):
        dist.all_to_all_single(out, x, output_split_sizes=[n] * world, input_split_sizes=send)
    _usable(ctx, "a split mismatch")


def all_to_all_any_size(ctx):
    """Eager all_to_all_single with split sizes and without, and all_to_all, on the
    device-driven kernels at any size (one launch of per-pair sizes), on a group whose
    segment is 256 KiB (the areas 64 KiB): every rank sends every other a part of its own
    size, from empty to several rounds of the segment's region, in four dtypes; a
    transposed input and output (copies); parts into a list of non-contiguous outputs; an
    input that is a view of the output's storage; and a list whose sizes disagree on one
    edge (ValueError on every rank, no output written, a strided one included; the group
    goes on)."""
    world, me = ctx.world_size, ctx.rank
    g = _group_with(
        {"MOONCAKE_CUDA_SEGMENT_BYTES": str(256 << 10), "MOONCAKE_CUDA_DIRECT_BYTES": str(64 << 10)}
    )

    # Rank s sends rank d rows(s, d) rows: 0 on one edge, past 2 segment regions on another.
    def rows(s, d):
        return (0, 1, 7, 3 * 65536 // max(world, 1) + 5)[(s + 2 * d) % 4] + s

    def part(s, d, dt, cols):
        """What rank s sends rank d: its own rows, any rank can make it."""
        n = rows(s, d)
        base = torch.arange(n * cols, dtype=torch.float64).reshape(n, cols)
        return (base * 0 + (s * 131 + d * 17) % 97 + base % 13).to(dt)

    for dt, cols in ((torch.float32, 3), (torch.bfloat16, 8), (torch.int8, 5), (torch.int64, 1)):
        send = [rows(me, d) for d in range(world)]
        recv = [rows(s, me) for s in range(world)]
        x = torch.cat([part(me, d, dt, cols) for d in range(world)]).cuda()
        out = _garbage((sum(recv), cols), dt)
        got = _paths(
            lambda o=out, i=x, r=recv, w=send: dist.all_to_all_single(o, i, r, w, group=g),
            g,
            direct=True,
        )
        ctx.expect(got == DIRECT, f"all_to_all_single {dt}: (device, staged, direct) {got}")
        want = torch.cat([part(s, me, dt, cols) for s in range(world)])
        ctx.expect_equal(out.cpu(), want, f"all_to_all_single with split sizes, {dt}")
        outs = [_garbage((rows(s, me), cols), dt) for s in range(world)]
        ins = [part(me, d, dt, cols).cuda() for d in range(world)]
        got = _paths(lambda o=outs, i=ins: dist.all_to_all(o, i, group=g), g, direct=True)
        ctx.expect(got == DIRECT, f"all_to_all {dt}: (device, staged, direct) {got}")
        for s in range(world):
            ctx.expect_equal(outs[s].cpu(), part(s, me, dt, cols), f"all_to_all {dt} from {s}")
    # Equal parts without split sizes, transposed (both copied), past the regions.
    n = 70_000
    xt = torch.stack([torch.arange(world * n, dtype=torch.float32) + 1e6 * me] * 2).cuda().t()
    out = _garbage((2, world * n), torch.float32).t()
    dist.all_to_all_single(out, xt, group=g)
    want = torch.cat(
        [torch.arange(me * n, (me + 1) * n, dtype=torch.float32) + 1e6 * s for s in range(world)]
    )
    ctx.expect_equal(out[:, 1].cpu(), want, "transposed all_to_all_single")
    # Non-contiguous outputs of a list (every other element of a larger tensor).
    wide = [_garbage((2 * 300,), torch.float32) for _ in range(world)]
    outs = [w[::2] for w in wide]
    ins = [torch.full((300,), float(me * 10 + d), device="cuda") for d in range(world)]
    dist.all_to_all(outs, ins, group=g)
    for s in range(world):
        ctx.expect_equal(outs[s].cpu(), torch.full((300,), float(s * 10 + me)), "strided output")
        ctx.expect(bool(wide[s][1::2].isnan().all()), "strided output: the gaps untouched")
    # The input a view of the output's storage: the input is read before any output lands.
    buf = torch.cat([torch.full((n,), float(me * 100 + d)) for d in range(world)] * 2).cuda()
    dist.all_to_all_single(buf[: world * n], buf[world * n :], group=g)
    want = torch.cat([torch.full((n,), float(s * 100 + me)) for s in range(world)])
    ctx.expect_equal(buf[: world * n].cpu(), want, "all_to_all_single into its input's storage")
    if world > 1:
        # Rank 0 sends rank 1 a list part of 5 elements; rank 1 expects 4. The last part
        # is a strided view (its copy starts from the caller's data, so stays as it was).
        outs = [_garbage((5 if (me != 1 or s != 0) else 4,), torch.float32) for s in range(world)]
        wide = _garbage((2 * outs[-1].numel(),), torch.float32)
        outs[-1] = wide[::2]
        ins = [torch.ones(5, device="cuda") for _ in range(world)]
        with ctx.expect_raises(ValueError, "all_to_all", "split sizes", "ranks 0 and 1"):
            dist.all_to_all(outs, ins, group=g)
        for s in range(world):
            ctx.expect(bool(outs[s].isnan().all()), f"the disagreeing all_to_all wrote [{s}]")
        ctx.expect(bool(wide.isnan().all()), "the disagreeing all_to_all wrote a strided part")
    dist.destroy_process_group(g)
    _usable(ctx, "all_to_all at any size")


def subgroup(ctx):
    """A subgroup of the even ranks (its own device segments, mapped among its members) and
    the world group, used in turn; 128 KiB all_reduce, on the device-driven kernels of each
    (set up per group), and a 128 KiB gather on the subgroup's kernels."""
    world, n = ctx.world_size, 1 << 15
    ranks = list(range(0, world, 2))
    g = dist.new_group(ranks)
    for i in range(2):
        x = torch.full((n,), float(ctx.rank + 1), device="cuda")
        if ctx.rank in ranks:
            got = _paths(lambda x=x: dist.all_reduce(x, group=g), g, direct=True)
            ctx.expect(got == DIRECT, f"subgroup all_reduce {i}: (device, staged, direct) {got}")
            want = float(sum(r + 1 for r in ranks))
            ctx.expect(bool((x == want).all()), f"subgroup all_reduce {i}: {x[0].item()}")
            parts = [_garbage((n,), torch.float32) for _ in ranks] if ctx.rank == 0 else None
            got = _paths(lambda x=x, p=parts: dist.gather(x, p, dst=0, group=g), g, direct=True)
            ctx.expect(got == DIRECT, f"subgroup gather {i}: (device, staged, direct) {got}")
            for j, p in enumerate(parts or []):
                ctx.expect(bool((p == want).all()), f"subgroup gather {i} [{j}]: {p[0].item()}")
        y = torch.full((n,), float(ctx.rank + 1), device="cuda")
        got = _paths(lambda y=y: dist.all_reduce(y), direct=True)
        ctx.expect(got == DIRECT, f"world all_reduce {i}: (device, staged, direct) {got}")
        want = world * (world + 1) / 2
        ctx.expect(bool((y == want).all()), f"world all_reduce {i}: {y[0].item()}")
    dist.destroy_process_group(g)


#: What ``_paths(..., direct=True)`` gives for one op on CUDA tensors: (device, staged,
#: direct) on the device-driven kernels (a coalesced call of N tensors: (1, 0, N)), on the
#: host-driven device plane, and staged through host memory.
DIRECT, PLANE, STAGED = (1, 0, 1), (1, 0, 0), (0, 1, 0)
#: The default MOONCAKE_CUDA_DIRECT_BYTES: the largest input (at the root, every part of it)
#: the device-driven kernels serve.
DIRECT_BYTES = 8 << 20


def _plane_or_alone(world: int, direct_ops: int = 1) -> tuple[int, int, int]:
    """The paths of an op that takes the device plane eagerly on a group of ``world`` ranks
    (the rooted ops, the list forms, split sizes, any op past the kernels' bound): at one
    rank the kernels' path instead (a local copy), ``direct_ops`` of them."""
    return (1, 0, direct_ops) if world == 1 else PLANE


def _paths(fn, group=None, direct: bool = False) -> tuple[int, ...]:
    """(device, staged) ops that ``fn`` issued on ``group``, from pg.get_op_paths; with
    ``direct``, (device, staged, direct): direct counts the device plane's ops that ran on
    the device-driven kernels (each tensor of a coalesced call)."""
    from mooncake import pg

    before = pg.get_op_paths(group)
    fn()
    torch.cuda.synchronize()
    after = pg.get_op_paths(group)
    keys = ("device", "staged", "direct") if direct else ("device", "staged")
    return tuple(after[k] - before[k] for k in keys)


def op_paths(ctx):
    """Which path served each op, asserted (no path may be bypassed silently). On the
    device-driven kernels, at any size up to MOONCAKE_CUDA_DIRECT_BYTES (4 KiB, below
    MOONCAKE_CUDA_PLANE_MIN_BYTES, and 128 KiB): all_reduce, all_gather_into_tensor,
    reduce_scatter_tensor, all_to_all_single with split sizes and without, all_to_all,
    all_reduce_coalesced (one device op, a direct op per tensor), broadcast, reduce,
    gather, scatter (4 KiB and 128 KiB), all_gather and reduce_scatter at 4 KiB, and a
    reduce_scatter_tensor whose whole input is 8 MiB. On the device plane at any size, also
    below MOONCAKE_CUDA_PLANE_MIN_BYTES (the kernels serve them under capture only; the
    eager call sets them up): all_gather_coalesced; a reduce_scatter_tensor whose whole
    input is 4 bytes per rank past 8 MiB (the bound counts every part). At one rank all of
    those take the kernels' path (a local copy). CPU tensors in the same group counted as
    none."""
    world, me, last, n = ctx.world_size, ctx.rank, ctx.world_size - 1, 1 << 15

    def expect(what, fn, want):
        got = _paths(fn, direct=True)
        ctx.expect(got == want, f"{what}: (device, staged, direct) {got}, want {want}")

    ROOTED = _plane_or_alone(world)
    x = torch.ones(n, device="cuda")
    out = torch.empty(world * n, device="cuda")
    expect("128 KiB all_reduce", lambda: dist.all_reduce(x), DIRECT)
    expect("128 KiB all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, x), DIRECT)
    expect("128 KiB reduce", lambda: dist.reduce(x, dst=last), DIRECT)
    expect("128 KiB broadcast", lambda: dist.broadcast(x, 0), DIRECT)
    small = torch.ones(1024, device="cuda")
    expect("4 KiB all_reduce", lambda: dist.all_reduce(small), DIRECT)
    expect("4 KiB broadcast", lambda: dist.broadcast(small, last), DIRECT)
    expect("4 KiB reduce", lambda: dist.reduce(small, dst=0), DIRECT)
    m = 1024 // world
    rs_in, rs_out = torch.ones(world * m, device="cuda"), torch.empty(m, device="cuda")
    expect("4 KiB reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(rs_out, rs_in), DIRECT)
    a2a_out = torch.empty(world * m, device="cuda")
    expect("4 KiB all_to_all_single", lambda: dist.all_to_all_single(a2a_out, rs_in), DIRECT)
    splits = [m] * world
    expect(
        "4 KiB all_to_all_single with split sizes",
        lambda: dist.all_to_all_single(a2a_out, rs_in, splits, splits),
        DIRECT,
    )
    three = [torch.ones(256, device="cuda") for _ in range(3)]
    expect("all_reduce_coalesced of 3", lambda: dist.all_reduce_coalesced(three), (1, 0, 3))
    for label, t in (("128 KiB", x), ("4 KiB", small)):
        parts = [torch.empty_like(t) for _ in range(world)] if me == 0 else None
        expect(f"{label} gather", lambda t=t, p=parts: dist.gather(t, p, dst=0), DIRECT)
        chunks = [p.clone() for p in parts] if parts else None
        expect(f"{label} scatter", lambda t=t, c=chunks: dist.scatter(t, c, src=0), DIRECT)
    listed = [torch.empty(1024, device="cuda") for _ in range(world)]
    expect("4 KiB all_gather", lambda: dist.all_gather(listed, small), DIRECT)
    lists = [[torch.empty(1024, device="cuda") for _ in range(world)]]
    expect("4 KiB all_gather_coalesced", lambda: dist.all_gather_coalesced(lists, [small]), ROOTED)
    expect("4 KiB reduce_scatter", lambda: dist.reduce_scatter(small, listed), DIRECT)
    parts = [torch.ones(m, device="cuda") for _ in range(world)]
    got_parts = [torch.empty(m, device="cuda") for _ in range(world)]
    expect("4 KiB all_to_all", lambda: dist.all_to_all(got_parts, parts), DIRECT)
    for label, k, want in (("8 MiB", 0, DIRECT), ("8 MiB + 4 bytes per rank", 1, ROOTED)):
        m = DIRECT_BYTES // 4 // world + k
        big_in = torch.full((world * m,), float(me + 1), device="cuda")
        big_out = _garbage((m,), torch.float32)
        expect(
            f"reduce_scatter_tensor of {label} of input",
            lambda i=big_in, o=big_out: dist.reduce_scatter_tensor(o, i),
            want,
        )
        total = world * (world + 1) / 2
        ctx.expect(bool((big_out == total).all()), f"reduce_scatter_tensor of {label}")
        del big_in, big_out
    expect("CPU all_reduce", lambda: dist.all_reduce(torch.ones(n)), (0, 0, 0))


def spare_slots(ctx):
    """A group with a slot to spare (max_group_size one past the world size) is never alone,
    at world 1 either: a rank may join past the world size and take part. Eagerly its 4 KiB
    all_reduce and its 4 KiB broadcast take the kernels, its 16 MiB all_reduce the device
    plane, as at any world."""
    from mooncake import pg

    world = ctx.world_size
    opts = pg.MooncakeBackendOptions(torch.ones(world + 1, dtype=torch.int32), False, world + 1)
    g = dist.new_group(list(range(world)), pg_options=opts)
    small = torch.ones(1024, device="cuda")
    got = _paths(lambda: dist.all_reduce(small, group=g), g, direct=True)
    ctx.expect(got == DIRECT, f"4 KiB all_reduce with a spare slot: {got}")
    got = _paths(lambda: dist.broadcast(small, 0, group=g), g, direct=True)
    ctx.expect(got == DIRECT, f"4 KiB broadcast with a spare slot: {got}")
    big = torch.ones(4 << 20, device="cuda")
    got = _paths(lambda: dist.all_reduce(big, group=g), g, direct=True)
    ctx.expect(got == PLANE, f"16 MiB all_reduce with a spare slot: {got}")
    ctx.expect(bool((big == world).all()), "16 MiB all_reduce with a spare slot: its result")
    dist.destroy_process_group(g)


def _capture_all(graph, calls) -> None:
    """Each of ``calls`` captured, in order, in ``graph``."""
    with _graph(graph):
        for call in calls:
            call()


def _capture_raises(ctx, fn, *match) -> None:
    """``fn()`` under CUDA graph capture raises ValueError matching ``match``, and the
    capture ends cleanly."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        try:
            with ctx.expect_raises(ValueError, *match, what=f"{match[0]} under capture"):
                with _graph(g, stream=s):
                    fn()
        except RuntimeError as e:  # the capture itself failing on the way out
            ctx.fail(f"capture raised {e}")


def _group_with(env: dict[str, str]):
    """A group of every rank whose backend read ``env`` when it was made (the device
    collectives read their knobs then), with a 4 MiB segment."""
    env = {"MOONCAKE_CUDA_SEGMENT_BYTES": str(4 << 20), **env}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return dist.new_group(list(range(dist.get_world_size())))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: Words of the staged path's refusal under CUDA graph capture (cuda_staging.h).
NOT_CAPTURABLE = "cannot run under cuda graph capture"


def graph_capture(ctx):
    """Under CUDA graph capture, what cannot be captured raises ValueError saying why, and
    the group goes on: barrier, send and recv (point-to-point); all_to_all_single with
    split sizes that are not all equal; all_to_all whose parts differ in size; any
    collective on a group made with MOONCAKE_CUDA_DIRECT=off; and a collective on a group
    whose device-driven kernels were never set up (one eager broadcast, on the device
    plane, sets them up, and a captured broadcast then replays; on another group a 4 KiB
    eager all_gather on the device plane does, and a captured all_gather replays). all_to_all_single with equal split sizes (as
    torch's functional collectives pass them) is captured and replays. On a group made with
    MOONCAKE_CUDA_DIRECT_BYTES=4096, ops past the bound (which counts every part of an
    input: a reduce_scatter_tensor whose output part is far smaller is past it) take the
    host-driven paths eagerly, and under capture go as one launch per piece of each part
    and replay: all_reduce, reduce_scatter_tensor, all_gather_into_tensor and
    all_to_all_single (whose eager call takes the kernels at any size); a 4 KiB
    all_reduce is captured and replayed there; on another
    such group whose only eager op is a 128 KiB all_reduce (the plane), that op sets the
    kernels up, and its capture replays; the same for all_to_all_single without split
    sizes. An op under a
    capture that an earlier call broke (a synchronize) raises ValueError saying so. At one rank the
    ops past the bound, and the eager calls above, take the kernels' path (a local copy),
    which captures and replays. Every collective the kernels serve is capturable:
    ``graph_replay`` captures them all."""
    world, me, last = ctx.world_size, ctx.rank, ctx.world_size - 1
    _usable(ctx, "nothing")  # sets the world group's kernels up (this case may run first)
    x = torch.ones(4, device="cuda")
    _capture_raises(ctx, dist.barrier, "barrier", NOT_CAPTURABLE, "point-to-point ops, barrier")
    _usable(ctx, "a barrier under graph capture")
    # A capture that an earlier call broke (a synchronize): the op says so, not its own rule.
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        try:
            with _graph(g, stream=s):
                with contextlib.suppress(RuntimeError):
                    torch.cuda.synchronize()
                with ctx.expect_raises(ValueError, "all_reduce", "already invalidated"):
                    dist.all_reduce(x)
        except RuntimeError:
            pass  # the capture ends in error, as it must
    _usable(ctx, "an all_reduce under a broken capture")
    if world > 1:
        nxt, prv = (me + 1) % world, (me - 1) % world
        for name, fn in (("send", lambda: dist.send(x, nxt)), ("recv", lambda: dist.recv(x, prv))):
            _capture_raises(ctx, fn, name, NOT_CAPTURABLE, "point-to-point")
        _usable(ctx, "send and recv under graph capture")
    ins, out = torch.ones(world * 2, device="cuda"), torch.empty(world * 2, device="cuda")
    if world > 1:  # every rank sends rank 0 one element, rank 1 three, the others two
        splits = [1 if d == 0 else 3 if d == 1 else 2 for d in range(world)]
        _capture_raises(
            ctx,
            lambda: dist.all_to_all_single(out, ins, splits, splits),
            "all_to_all_single",
            "split sizes must be equal",
        )
        _usable(ctx, "all_to_all_single with unequal split sizes under graph capture")
    mine = torch.full((world * 2,), float(me + 1), device="cuda")
    got_a2a = _garbage((world * 2,), torch.float32)
    g = torch.cuda.CUDAGraph()

    def capture_a2a():
        with _graph(g):
            dist.all_to_all_single(got_a2a, mine, [2] * world, [2] * world)

    try:
        got = _paths(capture_a2a, direct=True)
    except (ValueError, RuntimeError) as e:
        ctx.fail(f"all_to_all_single with equal split sizes under capture: {e}")
    else:
        ctx.expect(got == DIRECT, f"capture of all_to_all_single with equal splits: {got}")
        mine.fill_(float(-me - 1))
        got_a2a.fill_(0.0)
        g.replay()
        want = torch.cat([torch.full((2,), float(-s - 1)) for s in range(world)])
        ctx.expect_equal(got_a2a.cpu(), want, "replayed all_to_all_single with equal splits")
    if world > 1:  # every rank sends rank d d + 1 elements
        uneven = [torch.ones(d + 1, device="cuda") for d in range(world)]
        received = [torch.empty(me + 1, device="cuda") for _ in range(world)]
        _capture_raises(
            ctx,
            lambda: dist.all_to_all(received, uneven),
            "all_to_all",
            NOT_CAPTURABLE,
            "one size",
        )
        _usable(ctx, "all_to_all of parts of several sizes under graph capture")

    small = _group_with({"MOONCAKE_CUDA_DIRECT_BYTES": "4096"})
    y = torch.ones(1024, device="cuda")  # 4 KiB: the most it serves
    got = _paths(lambda: dist.all_reduce(y, group=small), small, direct=True)
    ctx.expect(got == DIRECT, f"4 KiB all_reduce at a 4 KiB bound: {got}")
    over = torch.ones(1025, device="cuda")
    # Past the bound eagerly: the plane (or staged); alone, a local copy.
    past = (PLANE, STAGED) if world > 1 else (DIRECT,)
    got = _paths(lambda: dist.all_reduce(over, group=small), small, direct=True)
    ctx.expect(got in past, f"4 KiB + 4 bytes all_reduce at a 4 KiB bound: {got}")
    m = 1024 // world + 1  # the whole input: world * m floats, past 4 KiB
    rs_in, rs_out = torch.ones(world * m, device="cuda"), torch.empty(m, device="cuda")
    got = _paths(lambda: dist.reduce_scatter_tensor(rs_out, rs_in, group=small), small, True)
    ctx.expect(got in past, f"reduce_scatter_tensor past a 4 KiB bound: {got}")
    # Past the bound under capture every op goes as one launch per piece of each part
    # (a whole piece fills the area, the last takes the rest): an all_reduce of 4 KiB + 4 bytes, and ops of
    # several parts, whose pieces are strided (a reduce_scatter_tensor's input parts, an
    # all_gather_into_tensor's output parts, both of all_to_all_single's); alone, each is
    # one local copy.
    a = 1025  # all_gather's input: one part, past the bound
    ag_in = torch.empty(a, device="cuda")
    ag_out = _garbage((world * a,), torch.float32)
    a2a_in = torch.empty(world * m, device="cuda")
    a2a_out = _garbage((world * m,), torch.float32)
    g = torch.cuda.CUDAGraph()
    got = _paths(
        lambda: _capture_all(
            g,
            [
                lambda: dist.all_reduce(over, group=small),
                lambda: dist.reduce_scatter_tensor(rs_out, rs_in, group=small),
                lambda: dist.all_gather_into_tensor(ag_out, ag_in, group=small),
                lambda: dist.all_to_all_single(a2a_out, a2a_in, group=small),
            ],
        ),
        small,
        direct=True,
    )
    ctx.expect(got == (4, 0, 4), f"capture past the bound: (device, staged, direct) {got}")
    # Values that tell every element of every part apart (exact in float32).
    pos = torch.arange(world * m, device="cuda", dtype=torch.float32)
    over.fill_(3.0)
    rs_in.copy_(pos + 1000.0 * (me + 1))
    ag_in.copy_(torch.arange(a, device="cuda", dtype=torch.float32) + 10000.0 * (me + 1))
    a2a_in.copy_(pos + 10000.0 * (me + 1))
    rs_out.zero_()
    ag_out.fill_(float("nan"))
    a2a_out.fill_(float("nan"))
    g.replay()
    ctx.expect_equal(over.cpu(), torch.full((1025,), 3.0 * world), "replayed all_reduce past it")
    mine_part = torch.arange(me * m, (me + 1) * m, dtype=torch.float32)
    ctx.expect_equal(
        rs_out.cpu(),
        world * mine_part + 1000.0 * world * (world + 1) / 2,
        "replayed reduce_scatter_tensor past the bound, in strided pieces",
    )
    want_ag = torch.cat(
        [torch.arange(a, dtype=torch.float32) + 10000.0 * (r + 1) for r in range(world)]
    )
    ctx.expect_equal(ag_out.cpu(), want_ag, "replayed all_gather_into_tensor past the bound")
    want_a2a = torch.cat([mine_part + 10000.0 * (r + 1) for r in range(world)])
    ctx.expect_equal(a2a_out.cpu(), want_a2a, "replayed all_to_all_single past the bound")
    g = torch.cuda.CUDAGraph()
    with _graph(g):
        dist.all_reduce(y, group=small)
    y.fill_(1.0)
    g.replay()
    ctx.expect_equal(y.cpu(), torch.full((1024,), float(world)), "4 KiB replay at a 4 KiB bound")

    # A group whose only eager op is past the bound (128 KiB: on the plane, not staged):
    # that op sets the kernels up too, so that the same op is captured (in pieces) and
    # replays.
    large = _group_with({"MOONCAKE_CUDA_DIRECT_BYTES": "4096"})
    n_big = 32 << 10
    big_x = torch.full((n_big,), float(me + 1), device="cuda")
    got = _paths(lambda: dist.all_reduce(big_x, group=large), large, direct=True)
    ctx.expect(got == (PLANE if world > 1 else DIRECT), f"128 KiB, a group's first op: {got}")
    total = world * (world + 1) / 2
    ctx.expect_equal(big_x.cpu(), torch.full((n_big,), total), "eager all_reduce past the bound")
    g = torch.cuda.CUDAGraph()
    try:
        with _graph(g):
            dist.all_reduce(big_x, group=large)
    except (ValueError, RuntimeError) as e:
        ctx.fail(f"capture after only an eager op past the bound: {type(e).__name__}: {e}")
    else:
        big_x.fill_(float(me + 1))
        g.replay()
        ctx.expect_equal(big_x.cpu(), torch.full((n_big,), total), "its replay")
    # The same for all_to_all_single without split sizes (every rank's parts alike),
    # whose eager call takes the kernels at any size (per-pair sizes, in rounds).
    large = _group_with({"MOONCAKE_CUDA_DIRECT_BYTES": "4096"})
    a_in = torch.arange(n_big, device="cuda", dtype=torch.float32) + 1e6 * me
    a_out = _garbage((n_big,), torch.float32)
    got = _paths(lambda: dist.all_to_all_single(a_out, a_in, group=large), large, direct=True)
    ctx.expect(got == DIRECT, f"128 KiB all_to_all_single: {got}")
    part = n_big // world
    want_a = torch.cat(
        [
            torch.arange(me * part, (me + 1) * part, dtype=torch.float32) + 1e6 * r
            for r in range(world)
        ]
    )
    ctx.expect_equal(a_out.cpu(), want_a, "eager all_to_all_single past the bound")
    g = torch.cuda.CUDAGraph()
    try:
        with _graph(g):
            dist.all_to_all_single(a_out, a_in, group=large)
    except (ValueError, RuntimeError) as e:
        ctx.fail(f"capture after an eager all_to_all_single past the bound: {e}")
    else:
        a_out.fill_(float("nan"))
        g.replay()
        ctx.expect_equal(a_out.cpu(), want_a, "its replay")

    off = _group_with({"MOONCAKE_CUDA_DIRECT": "off"})
    for name, fn in (
        ("all_reduce", lambda: dist.all_reduce(x, group=off)),
        ("broadcast", lambda: dist.broadcast(x, 0, group=off)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, x[:2], group=off)),
    ):
        _capture_raises(ctx, fn, name, NOT_CAPTURABLE)
    z = torch.ones(4, device="cuda")
    dist.all_reduce(z, group=off)
    ctx.expect_equal(z.cpu(), torch.full((4,), float(world)), "off group after capture")

    fresh = _group_with({})
    not_set_up = ("broadcast", "graph capture", "not set up", "outside the captured")
    _capture_raises(ctx, lambda: dist.broadcast(x, last, group=fresh), *not_set_up)
    if world > 1:
        _capture_raises(ctx, lambda: dist.broadcast(x, last, group=fresh), *not_set_up)
    b = torch.full((4,), float(me + 1), device="cuda")
    got = _paths(lambda: dist.broadcast(b, last, group=fresh), fresh, direct=True)
    ctx.expect(got == DIRECT, f"16-byte eager broadcast that sets up: {got}")
    ctx.expect_equal(b.cpu(), torch.full((4,), float(world)), "the broadcast that set up")
    g = torch.cuda.CUDAGraph()
    with _graph(g):
        dist.broadcast(b, last, group=fresh)
    b.fill_(float(-me - 1))
    g.replay()
    ctx.expect_equal(b.cpu(), torch.full((4,), float(-world)), "replay after set-up")
    # A list form's eager call on the device plane sets them up too.
    listed = _group_with({})
    n = 1024  # 4 KiB: on the plane all the same (the kernels could serve it)
    parts = [_garbage((n,), torch.float32) for _ in range(world)]
    mine = torch.full((n,), float(me + 1), device="cuda")

    def gather_coalesced():
        dist.all_gather_coalesced([parts], [mine], group=listed)

    got = _paths(gather_coalesced, listed, direct=True)
    ctx.expect(got == _plane_or_alone(world), f"4 KiB all_gather_coalesced that sets up: {got}")
    g = torch.cuda.CUDAGraph()
    try:
        with _graph(g):
            gather_coalesced()
    except (ValueError, RuntimeError) as e:
        ctx.fail(f"all_gather_coalesced under capture after an eager one: {type(e).__name__}: {e}")
    else:
        mine.fill_(float(-me - 1))
        for p in parts:
            p.fill_(0.0)
        g.replay()
        want = torch.cat([torch.full((n,), float(-r - 1)) for r in range(world)])
        ctx.expect_equal(torch.cat(parts).cpu(), want, "all_gather_coalesced replay after set-up")
    for grp in (small, off, fresh, listed):
        dist.destroy_process_group(grp)
    _usable(ctx, "graph capture")


#: (dtype, op) pairs of the device-driven sweep: every dtype, every kind of op.
DIRECT_SWEEP = (
    (torch.float32, "SUM"),
    (torch.bfloat16, "AVG"),
    (torch.float16, "MIN"),
    (torch.float64, "PRODUCT"),
    (torch.int64, "MAX"),
    (torch.int32, "PRODUCT"),
    (torch.int16, "BXOR"),
    (torch.int8, "SUM"),
    (torch.uint8, "BOR"),
    (torch.bool, "SUM"),
)
#: Elements: a tail only; one 16-byte vector short of a block; several blocks (the
#: two-shot shares then span blocks); past 256 KiB (auto takes two-shot at world 4).
DIRECT_SIZES = (7, 4093, 70_001, 300_000)


def direct_matches_host(ctx):
    """The device-driven all_reduce, forced one-shot and two-shot (groups made with
    MOONCAKE_CUDA_DIRECT=oneshot / twoshot) and as it comes (auto, the world group),
    equals the host-driven paths (a group with MOONCAKE_CUDA_DIRECT=off: the device
    plane, or staged below 64 KiB) and the reference bit for bit, over dtypes, ops and
    sizes; also in place on a non-contiguous tensor and on a view 4 bytes off alignment
    (the scalar paths). The paths are asserted: every call of the first three took the
    device-driven kernel, none of the host group's. (The other ops:
    ``direct_matches_host_ops`` and ``direct_matches_host_captured``.)"""
    groups = {
        "host": _group_with({"MOONCAKE_CUDA_DIRECT": "off"}),
        "oneshot": _group_with({"MOONCAKE_CUDA_DIRECT": "oneshot"}),
        "twoshot": _group_with({"MOONCAKE_CUDA_DIRECT": "twoshot"}),
        "auto": None,
    }
    R = dist.ReduceOp
    for dtype, op in DIRECT_SWEEP:
        if op not in reduce_ops_for(dtype):
            ctx.fail(f"the sweep has {op} on {dtype}, which it does not define")
            continue
        for n in DIRECT_SIZES:
            xs = ctx.inputs((n,), dtype, tag=f"{dtype}{op}{n}")
            want = reduce_ref(xs, op)
            for name, grp in groups.items():
                x = cuda(xs[ctx.rank])
                red = getattr(R, op)
                got = _paths(lambda x=x, g=grp, o=red: dist.all_reduce(x, o, group=g), grp, True)
                ctx.expect(got[2] == (0 if name == "host" else 1), f"{name} paths {got}")
                ctx.expect_equal(x.cpu(), want, f"{name} {dtype} {op} n{n}")
    n = 5000
    xs = ctx.inputs((2, n), torch.float32, tag="layouts")
    for name, grp in groups.items():
        t = cuda(xs[ctx.rank]).t()  # [n, 2], not contiguous
        dist.all_reduce(t, group=grp)
        ctx.expect_equal(t.cpu(), reduce_ref(xs, "SUM").t(), f"{name} non-contiguous")
        base = torch.zeros(n + 1, device="cuda")
        off = base[1:]  # 4 bytes past the allocation's alignment
        off.copy_(cuda(xs[ctx.rank][0]))
        dist.all_reduce(off, group=grp)
        ctx.expect_equal(off.cpu(), reduce_ref([x[0] for x in xs], "SUM"), f"{name} misaligned")
        ctx.expect(base[0].item() == 0.0, f"{name} misaligned: wrote before the view")
    for grp in groups.values():
        if grp is not None:
            dist.destroy_process_group(grp)


#: (dtype, reduce op) of the sweep over the other ops (``direct_matches_host_ops`` and
#: ``_captured``): the reductions in each dtype's op, the moves of every dtype (uint8 stands for
#: the 1-byte types, fp8's among them: a move is a copy of bytes).
OPS_SWEEP = (
    (torch.float32, "SUM"),
    (torch.bfloat16, "AVG"),
    (torch.int64, "SUM"),
    (torch.uint8, "BOR"),
)
#: Elements of one part: a tail only (no whole 16-byte vector); several blocks, not a
#: multiple of a vector (the parts of a multi-part input or output then start unaligned).
OPS_SIZES = (7, 70_001)


def _on_both(ctx, off, what: str, call, want: list[torch.Tensor], calls: int = 1) -> None:
    """``call(group)`` runs one op on fresh tensors and returns the outputs to check (none
    where this rank has none): on the world group, which must serve it on the device-driven
    kernels (``calls`` direct ops: one per tensor of a coalesced call), and on ``off`` (made
    with MOONCAKE_CUDA_DIRECT=off: the device plane, or staged), which must not; each
    output equals ``want`` (CPU tensors) bit for bit on both."""
    for label, grp in (("direct", None), ("off", off)):
        outs: list[torch.Tensor] = []
        got = _paths(lambda g=grp, o=outs: o.extend(call(g)), grp, direct=True)
        if grp is None:
            ctx.expect(got == (1, 0, calls), f"{what}: (device, staged, direct) {got}")
        else:
            ctx.expect(got in (PLANE, STAGED), f"{what} on the off group: {got}")
        _expect_outputs(ctx, f"{label} {what}", outs, want)


def _expect_outputs(ctx, what: str, outs: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Each of ``outs`` equals its ``want`` (CPU) bit for bit, and there are as many."""
    ctx.expect(len(outs) == len(want), f"{what}: {len(outs)} outputs, want {len(want)}")
    for i, (o, w) in enumerate(zip(outs, want, strict=False)):
        ctx.expect_equal(o.cpu(), w, f"{what} [{i}]")


def _tensor_forms(ctx, off, dtype, op: str, n: int) -> None:
    """``direct_matches_host_ops`` at one dtype, op and part size."""
    world, me = ctx.world_size, ctx.rank
    red = getattr(dist.ReduceOp, op)
    tag = f"{dtype}{n}"

    def every(key, m=n):  # every rank's input ``key``, on the CPU
        return ctx.inputs((m,), dtype, tag=f"{key}{tag}")

    def mine(key, m=n):
        return cuda(every(key, m)[me])

    def part(t, p, m=n):
        return t[p * m : (p + 1) * m]

    def all_gather_into_tensor(g):
        out = _garbage((world * n,), dtype)
        dist.all_gather_into_tensor(out, mine("ag"), group=g)
        return [out]

    want = [torch.cat(every("ag"))]
    _on_both(ctx, off, f"all_gather_into_tensor {tag}", all_gather_into_tensor, want)

    def reduce_scatter_tensor(g):
        out = _garbage((n,), dtype)
        dist.reduce_scatter_tensor(out, mine("rs", world * n), op=red, group=g)
        return [out]

    want = [reduce_ref([part(x, me) for x in every("rs", world * n)], op)]
    _on_both(ctx, off, f"reduce_scatter_tensor {op} {tag}", reduce_scatter_tensor, want)

    def all_to_all_single(g):
        out = _garbage((world * n,), dtype)
        dist.all_to_all_single(out, mine("a2a", world * n), group=g)
        return [out]

    want = [torch.cat([part(x, me) for x in every("a2a", world * n)])]
    _on_both(ctx, off, f"all_to_all_single {tag}", all_to_all_single, want)

    sizes = (n, 5)  # the coalesced forms: two tensors each

    def all_reduce_coalesced(g):
        ts = [mine(f"arc{i}", m) for i, m in enumerate(sizes)]
        dist.all_reduce_coalesced(ts, op=red, group=g)
        return ts

    want = [reduce_ref(every(f"arc{i}", m), op) for i, m in enumerate(sizes)]
    _on_both(ctx, off, f"all_reduce_coalesced {op} {tag}", all_reduce_coalesced, want, 2)

    def all_gather_into_tensor_coalesced(g):
        outs = [_garbage((world * m,), dtype) for m in sizes]
        with dist._coalescing_manager(group=g):
            for i, (o, m) in enumerate(zip(outs, sizes, strict=True)):
                dist.all_gather_into_tensor(o, mine(f"agc{i}", m), group=g)
        return outs

    want = [torch.cat(every(f"agc{i}", m)) for i, m in enumerate(sizes)]
    what = f"coalesced all_gather_into_tensor {tag}"
    _on_both(ctx, off, what, all_gather_into_tensor_coalesced, want, 2)

    def reduce_scatter_tensor_coalesced(g):
        outs = [_garbage((m,), dtype) for m in sizes]
        with dist._coalescing_manager(group=g):
            for i, (o, m) in enumerate(zip(outs, sizes, strict=True)):
                dist.reduce_scatter_tensor(o, mine(f"rsc{i}", world * m), op=red, group=g)
        return outs

    want = [
        reduce_ref([part(x, me, m) for x in every(f"rsc{i}", world * m)], op)
        for i, m in enumerate(sizes)
    ]
    what = f"coalesced reduce_scatter_tensor {op} {tag}"
    _on_both(ctx, off, what, reduce_scatter_tensor_coalesced, want, 2)


def _tensor_layouts(ctx, off) -> None:
    """Tensor forms on tensors the kernels cannot take as they are: an all_to_all_single
    from a transposed (non-contiguous) input; a reduce_scatter_tensor from a view 4 bytes
    off its allocation's alignment into another; an all_gather_into_tensor into a
    transposed output. (all_reduce in place on such tensors: ``direct_matches_host``.)"""
    world, me, n = ctx.world_size, ctx.rank, 5000
    xs = ctx.inputs((2, n), torch.float32, tag="layouts")
    zs = ctx.inputs((2, world * n), torch.float32, tag="a2a-layouts")

    def all_to_all_single(g):
        out = _garbage((world * n, 2), torch.float32)
        dist.all_to_all_single(out, cuda(zs[me]).t(), group=g)  # [world * n, 2] rows
        return [out]

    want = torch.cat([z.t()[me * n : (me + 1) * n] for z in zs])
    _on_both(ctx, off, "all_to_all_single of a transposed input", all_to_all_single, [want])
    ys = ctx.inputs((world * n,), torch.float32, tag="misaligned")

    def reduce_scatter_tensor(g):
        base_in = torch.zeros(world * n + 1, device="cuda")
        base_in[1:].copy_(cuda(ys[me]))
        base_out = torch.zeros(n + 1, device="cuda")
        dist.reduce_scatter_tensor(base_out[1:], base_in[1:], group=g)
        return [base_out]

    want = torch.cat([torch.zeros(1), reduce_ref([y[me * n : (me + 1) * n] for y in ys], "SUM")])
    _on_both(ctx, off, "reduce_scatter_tensor of misaligned views", reduce_scatter_tensor, [want])

    def all_gather_into_tensor(g):
        out = _garbage((2, world * n), torch.float32).t()  # [world * n, 2], not contiguous
        dist.all_gather_into_tensor(out, cuda(xs[me]).t().contiguous(), group=g)
        return [out]

    want = torch.cat([x.t() for x in xs])
    _on_both(
        ctx, off, "all_gather_into_tensor into a transposed output", all_gather_into_tensor, [want]
    )


def direct_matches_host_ops(ctx):
    """Every op but all_reduce (``direct_matches_host``) that takes the device-driven
    kernels eagerly (the world group: each call asserted to take them) equals the same call
    on a group made with MOONCAKE_CUDA_DIRECT=off (the device plane, or staged below 64 KiB)
    and the reference bit for bit: all_gather_into_tensor, reduce_scatter_tensor,
    all_to_all_single without split sizes, all_reduce_coalesced and the coalesced
    all_gather_into_tensor and reduce_scatter_tensor (two tensors: one direct op each), over
    OPS_SWEEP's dtypes and ops and OPS_SIZES; then the tensors the kernels cannot take as
    they are (``_tensor_layouts``). (The ops they take under capture only:
    ``direct_matches_host_captured``.)"""
    off = _group_with({"MOONCAKE_CUDA_DIRECT": "off"})
    for dtype, op in OPS_SWEEP:
        for n in OPS_SIZES:
            _tensor_forms(ctx, off, dtype, op, n)
    _tensor_layouts(ctx, off)
    dist.destroy_process_group(off)


def _capture_only_forms(ctx, dtype, op: str, n: int) -> list[tuple]:
    """The ops the device-driven kernels take under capture only, at one dtype, op and part
    size, as (what, call, want, direct ops): ``call(group)`` calls the op on inputs made
    here (so that it can run under capture; an op that writes its input in place works on
    a copy) and garbage outputs it makes, and returns the outputs to check; ``want``:
    theirs (CPU)."""
    world, me = ctx.world_size, ctx.rank
    red = getattr(dist.ReduceOp, op)
    tag = f"{dtype}{n}"

    def inp(key, rank=None, m=n):  # rank ``rank``'s (default: this rank's) input, CPU
        return ctx.input((m,), dtype, rank, f"{key}{tag}")

    def garbage(m=n):
        return _garbage((m,), dtype)

    forms = []
    for root in sorted({0, world - 1}):
        bc = cuda(inp(f"bc{root}", root)) if me == root else None

        def broadcast(g, root=root, bc=bc):
            t = bc.clone() if me == root else garbage()
            dist.broadcast(t, root, group=g)
            return [t]

        forms.append((f"broadcast from {root}", broadcast, [inp(f"bc{root}", root)], 1))
        rd = cuda(inp(f"rd{root}"))

        def reduce(g, root=root, rd=rd):
            t = rd.clone()
            dist.reduce(t, root, op=red, group=g)
            return [t] if me == root else []

        want = [reduce_ref([inp(f"rd{root}", r) for r in range(world)], op)] if me == root else []
        forms.append((f"reduce {op} to {root}", reduce, want, 1))
    ag = cuda(inp("ag"))

    def all_gather(g):
        outs = [garbage() for _ in range(world)]
        dist.all_gather(outs, ag, group=g)
        return outs

    forms.append(("all_gather", all_gather, [inp("ag", r) for r in range(world)], 1))
    sizes = (n, 5)
    agc = [cuda(inp(f"agc{i}", m=m)) for i, m in enumerate(sizes)]

    def all_gather_coalesced(g):
        outs = [[garbage(m) for _ in range(world)] for m in sizes]
        dist.all_gather_coalesced(outs, agc, group=g)
        return [o for lst in outs for o in lst]

    want = [inp(f"agc{i}", r, m) for i, m in enumerate(sizes) for r in range(world)]
    forms.append(("all_gather_coalesced", all_gather_coalesced, want, 2))
    for root in sorted({0, world - 1}):
        ga = cuda(inp(f"ga{root}"))

        def gather(g, root=root, ga=ga):
            outs = [garbage() for _ in range(world)] if me == root else None
            dist.gather(ga, outs, dst=root, group=g)
            return outs or []

        want = [inp(f"ga{root}", r) for r in range(world)] if me == root else []
        forms.append((f"gather to {root}", gather, want, 1))
        chunks = [cuda(inp(f"sc{root}/{j}", root)) for j in range(world)] if me == root else None

        def scatter(g, root=root, chunks=chunks):
            out = garbage()
            dist.scatter(out, chunks, src=root, group=g)
            return [out]

        forms.append((f"scatter from {root}", scatter, [inp(f"sc{root}/{me}", root)], 1))
    rsl = [cuda(inp(f"rs/{d}")) for d in range(world)]

    def reduce_scatter(g):
        out = garbage()
        dist.reduce_scatter(out, rsl, op=red, group=g)
        return [out]

    want = [reduce_ref([inp(f"rs/{me}", s) for s in range(world)], op)]
    forms.append((f"reduce_scatter {op}", reduce_scatter, want, 1))
    a2a = [cuda(inp(f"a2a/{d}")) for d in range(world)]

    def all_to_all(g):
        outs = [garbage() for _ in range(world)]
        dist.all_to_all(outs, a2a, group=g)
        return outs

    forms.append(("all_to_all", all_to_all, [inp(f"a2a/{me}", s) for s in range(world)], 1))
    a2s = cuda(inp("a2s", m=world * n))

    def all_to_all_single(g):
        out = garbage(world * n)
        dist.all_to_all_single(out, a2s, [n] * world, [n] * world, group=g)
        return [out]

    want = [torch.cat([inp("a2s", s, world * n)[me * n : (me + 1) * n] for s in range(world)])]
    forms.append(("all_to_all_single with equal split sizes", all_to_all_single, want, 1))
    return forms


#: The ops of _capture_only_forms that take the kernels eagerly too, by first word.
WATCHED = ("broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter")


def direct_matches_host_captured(ctx):
    """The ops the device-driven kernels took under CUDA graph capture only: per dtype and
    op of OPS_SWEEP and size of OPS_SIZES, broadcast and reduce (roots 0 and last),
    all_gather, all_gather_coalesced (two tensors), gather and scatter (roots 0 and last),
    reduce_scatter, all_to_all with parts of one size and all_to_all_single with equal
    split sizes. Each is called eagerly on a MOONCAKE_CUDA_DIRECT=off group (the device
    plane, or staged below 64 KiB) and on the world group (the kernels for the WATCHED
    ops and, at any size, the all_to_all forms; the others the device plane, at any
    size, or at one rank the kernels' path, a local copy);
    then all are captured in one graph on the world group (the capture counts each on the
    device-driven kernels) and replayed once. Every output equals the reference bit for
    bit."""
    off = _group_with({"MOONCAKE_CUDA_DIRECT": "off"})
    _usable(ctx, "nothing")  # sets the world group's kernels up
    for dtype, op in OPS_SWEEP:
        for n in OPS_SIZES:
            what = f"{dtype} {op} n{n}"
            forms = _capture_only_forms(ctx, dtype, op, n)
            for name, call, want, k in forms:
                # The rooted ops and the list forms of all_gather and reduce_scatter take the
                # kernels eagerly too (their eager launches watched); all_to_all and
                # all_to_all_single at any size (per-pair sizes).
                watched = name.split()[0] in WATCHED and n * 8 * ctx.world_size <= DIRECT_BYTES
                vary = name.startswith("all_to_all")
                eager = ((1, 0, k),) if watched or vary else (_plane_or_alone(ctx.world_size, k),)
                for label, grp, paths in (("off", off, (PLANE, STAGED)), ("eager", None, eager)):
                    outs: list[torch.Tensor] = []
                    got = _paths(lambda c=call, g=grp, o=outs: o.extend(c(g)), grp, direct=True)
                    ctx.expect(got in paths, f"{label} {name} {what}: {got}, want one of {paths}")
                    _expect_outputs(ctx, f"{label} {name} {what}", outs, want)
            graph = torch.cuda.CUDAGraph()
            captured: list[list[torch.Tensor]] = []
            try:
                got = _paths(
                    lambda g=graph, f=forms, c=captured: _capture_forms(g, f, c), None, True
                )
            except (ValueError, RuntimeError) as e:
                ctx.fail(f"capturing the forms {what}: {type(e).__name__}: {e}")
                continue
            want = (len(forms), 0, sum(f[3] for f in forms))
            ctx.expect(got == want, f"capture of the forms {what}: {got}, want {want}")
            graph.replay()
            torch.cuda.synchronize()
            for (name, _, want_outs, _), outs in zip(forms, captured, strict=True):
                _expect_outputs(ctx, f"replayed {name} {what}", outs, want_outs)
            del graph, captured
    dist.destroy_process_group(off)


def _capture_forms(graph, forms, captured) -> None:
    """Captures every form's call on the world group in ``graph``, its outputs into
    ``captured``."""
    with _graph(graph):
        for _, call, _, _ in forms:
            captured.append(call(None))


def graph_replay(ctx):
    """all_reduce captured in a CUDA graph (4 KiB one-shot on the world group; 1 MiB on
    the world group, and two-shot on a group forced to it), replayed 5 times with new
    inputs, an eager all_reduce between replays: each replay equals an eager all_reduce of
    the same inputs (and the reference) bit for bit. Capture counts one direct op; the
    replays count none (they are the GPU's alone). Then one graph of every capturable op
    (``_every_op_graph``)."""
    from mooncake import pg

    two = _group_with({"MOONCAKE_CUDA_DIRECT": "twoshot"})
    for label, grp, n in (("4 KiB", None, 1024), ("1 MiB", None, 1 << 18), ("two-shot", two, 1 << 18)):  # fmt: skip
        static = torch.zeros(n, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the eager warm-up sets the path up
            dist.all_reduce(static, group=grp)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        got = _paths(lambda static=static, g=g, grp=grp: _capture(g, static, grp), grp, True)
        ctx.expect(got == (1, 0, 1), f"{label}: capture counted {got}")
        before = pg.get_op_paths(grp)
        for k in range(5):
            xs = ctx.inputs((n,), torch.float32, tag=f"{label}{k}")
            static.copy_(cuda(xs[ctx.rank]))
            g.replay()
            eager = cuda(xs[ctx.rank])
            if k == 2:
                dist.all_reduce(eager, group=grp)
            else:
                torch.cuda.synchronize()
                eager = None
            want = reduce_ref(xs, "SUM")
            ctx.expect_equal(static.cpu(), want, f"{label} replay {k}")
            if eager is not None:
                ctx.expect_equal(eager.cpu(), want, f"{label} eager between replays")
        after = pg.get_op_paths(grp)
        ctx.expect(after["direct"] - before["direct"] == 1, f"{label}: replays counted")
    dist.destroy_process_group(two)
    _every_op_graph(ctx)


class _Statics:
    """A captured graph's static inputs: this rank's, refilled before each replay with that
    round's (``ctx.input`` under the tag ``key/round``); every rank's for the references."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def new(self, key: str, shape, dtype, here: bool = True) -> torch.Tensor | None:
        """Input ``key``: known on every rank, a static tensor where ``here``."""
        self.specs[key] = (tuple(shape), dtype)
        if not here:
            return None
        self.tensors[key] = torch.empty(shape, dtype=dtype, device="cuda")
        return self.tensors[key]

    def of(self, key: str, k: int, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s (default: this rank's) input ``key`` of round ``k``, on the CPU."""
        shape, dtype = self.specs[key]
        return self.ctx.input(shape, dtype, rank, f"{key}/{k}")

    def every(self, key: str, k: int) -> list[torch.Tensor]:
        return [self.of(key, k, r) for r in range(self.ctx.world_size)]

    def fill(self, k: int) -> None:
        for key, t in self.tensors.items():
            t.copy_(cuda(self.of(key, k)))


def _every_op_graph(ctx) -> None:
    """One CUDA graph on the world group holding, in turn, every op the device-driven
    kernels serve under capture: all_reduce, broadcast from 0, reduce (MAX) to the last
    rank, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single without split
    sizes and with equal ones (rows of 2), all_reduce_coalesced, the coalesced
    all_gather_into_tensor and reduce_scatter_tensor (two tensors each), all_gather,
    all_gather_coalesced, gather to the last rank, scatter from 0, reduce_scatter (MIN)
    and all_to_all, over float32, bfloat16, int64 and uint8.
    The capture counts every op once on the device plane and each tensor once as direct;
    the graph is replayed twice with new inputs copied into its static inputs, garbage in
    its outputs: every output equals the reference bit for bit, and the replays count
    nothing."""
    from mooncake import pg

    world, me, last, n = ctx.world_size, ctx.rank, ctx.world_size - 1, 1001
    f32, bf16, i64, u8 = torch.float32, torch.bfloat16, torch.int64, torch.uint8
    S = _Statics(ctx)
    steps = []  # (direct ops, the call)
    checks = []  # (what, output, its reference at round k)
    outs: list[torch.Tensor] = []  # refilled with garbage before each replay

    def out(shape, dtype) -> torch.Tensor:
        outs.append(torch.empty(shape, dtype=dtype, device="cuda"))
        return outs[-1]

    def part(t, p, m=n):
        return t[p * m : (p + 1) * m]

    ar = S.new("ar", (n,), f32)
    steps.append((1, lambda: dist.all_reduce(ar)))
    checks.append(("all_reduce", ar, lambda k: reduce_ref(S.every("ar", k), "SUM")))
    bc = S.new("bc", (n,), i64)
    steps.append((1, lambda: dist.broadcast(bc, 0)))
    checks.append(("broadcast from 0", bc, lambda k: S.of("bc", k, 0)))
    rd = S.new("rd", (n,), bf16)
    steps.append((1, lambda: dist.reduce(rd, last, op=dist.ReduceOp.MAX)))
    if me == last:
        checks.append((f"reduce to {last}", rd, lambda k: reduce_ref(S.every("rd", k), "MAX")))
    agi, ago = S.new("agi", (n,), u8), out((world * n,), u8)
    steps.append((1, lambda: dist.all_gather_into_tensor(ago, agi)))
    checks.append(("all_gather_into_tensor", ago, lambda k: torch.cat(S.every("agi", k))))
    rsi, rso = S.new("rsi", (world * n,), i64), out((n,), i64)
    steps.append((1, lambda: dist.reduce_scatter_tensor(rso, rsi)))
    checks.append(
        (
            "reduce_scatter_tensor",
            rso,
            lambda k: reduce_ref([part(x, me) for x in S.every("rsi", k)], "SUM"),
        )
    )
    a2i, a2o = S.new("a2i", (world * n,), bf16), out((world * n,), bf16)
    steps.append((1, lambda: dist.all_to_all_single(a2o, a2i)))
    checks.append(
        ("all_to_all_single", a2o, lambda k: torch.cat([part(x, me) for x in S.every("a2i", k)]))
    )
    a2s, a2so = S.new("a2s", (world * n, 2), i64), out((world * n, 2), i64)
    steps.append((1, lambda: dist.all_to_all_single(a2so, a2s, [n] * world, [n] * world)))
    checks.append(
        (
            "all_to_all_single with equal split sizes",
            a2so,
            lambda k: torch.cat([part(x, me) for x in S.every("a2s", k)]),
        )
    )
    arc = [S.new(f"arc{i}", (m,), f32) for i, m in enumerate((n, 13))]
    steps.append((2, lambda: dist.all_reduce_coalesced(arc)))
    for i, t in enumerate(arc):
        checks.append(
            (
                f"all_reduce_coalesced [{i}]",
                t,
                lambda k, i=i: reduce_ref(S.every(f"arc{i}", k), "SUM"),
            )
        )
    cag = [
        (S.new(f"cag{i}", (m,), dt), out((world * m,), dt))
        for i, (m, dt) in enumerate(((n, f32), (13, u8)))
    ]
    steps.append((2, lambda: _coalesced(cag, dist.all_gather_into_tensor)))
    for i, (_, o) in enumerate(cag):
        checks.append(
            (
                f"coalesced all_gather_into_tensor [{i}]",
                o,
                lambda k, i=i: torch.cat(S.every(f"cag{i}", k)),
            )
        )
    crs = [
        (S.new(f"crs{i}", (world * m,), dt), out((m,), dt))
        for i, (m, dt) in enumerate(((n, f32), (13, i64)))
    ]
    steps.append((2, lambda: _coalesced(crs, dist.reduce_scatter_tensor)))
    for i, (m, (_, o)) in enumerate(zip((n, 13), crs, strict=True)):
        checks.append(
            (
                f"coalesced reduce_scatter_tensor [{i}]",
                o,
                lambda k, i=i, m=m: reduce_ref(
                    [part(x, me, m) for x in S.every(f"crs{i}", k)], "SUM"
                ),
            )
        )
    agl = S.new("agl", (n,), i64)
    aglo = [out((n,), i64) for _ in range(world)]
    steps.append((1, lambda: dist.all_gather(aglo, agl)))
    for r, o in enumerate(aglo):
        checks.append((f"all_gather [{r}]", o, lambda k, r=r: S.of("agl", k, r)))
    agc = [S.new(f"agc{i}", (m,), u8) for i, m in enumerate((n, 13))]
    agco = [[out((m,), u8) for _ in range(world)] for m in (n, 13)]
    steps.append((2, lambda: dist.all_gather_coalesced(agco, agc)))
    for i, lst in enumerate(agco):
        for r, o in enumerate(lst):
            checks.append(
                (f"all_gather_coalesced [{i}][{r}]", o, lambda k, i=i, r=r: S.of(f"agc{i}", k, r))
            )
    ga = S.new("ga", (n,), f32)
    gal = [out((n,), f32) for _ in range(world)] if me == last else None
    steps.append((1, lambda: dist.gather(ga, gal, dst=last)))
    for r, o in enumerate(gal or []):
        checks.append((f"gather to {last} [{r}]", o, lambda k, r=r: S.of("ga", k, r)))
    scl = [S.new(f"sc{j}", (n,), bf16, here=me == 0) for j in range(world)]
    sco = out((n,), bf16)
    steps.append((1, lambda: dist.scatter(sco, scl if me == 0 else None, src=0)))
    checks.append(("scatter from 0", sco, lambda k: S.of(f"sc{me}", k, 0)))
    rsl = [S.new(f"rsl{d}", (n,), f32) for d in range(world)]
    rslo = out((n,), f32)
    steps.append((1, lambda: dist.reduce_scatter(rslo, rsl, op=dist.ReduceOp.MIN)))
    checks.append(("reduce_scatter", rslo, lambda k: reduce_ref(S.every(f"rsl{me}", k), "MIN")))
    a2l = [S.new(f"a2l{d}", (n,), u8) for d in range(world)]
    a2lo = [out((n,), u8) for _ in range(world)]
    steps.append((1, lambda: dist.all_to_all(a2lo, a2l)))
    for s, o in enumerate(a2lo):
        checks.append((f"all_to_all [{s}]", o, lambda k, s=s: S.of(f"a2l{me}", k, s)))

    _usable(ctx, "nothing")  # the kernels are set up
    graph = torch.cuda.CUDAGraph()

    def capture():
        with _graph(graph):
            for _, step in steps:
                step()

    try:
        got = _paths(capture, direct=True)
    except (ValueError, RuntimeError) as e:
        ctx.fail(f"capturing every op: {type(e).__name__}: {e}")
        return
    want = (len(steps), 0, sum(c for c, _ in steps))
    ctx.expect(got == want, f"capture of every op: (device, staged, direct) {got}, want {want}")
    before = pg.get_op_paths()
    for k in range(2):
        S.fill(k)
        for t in outs:
            t.copy_(_garbage(t.shape, t.dtype))
        graph.replay()
        torch.cuda.synchronize()
        for what, t, ref in checks:
            ctx.expect_equal(t.cpu(), ref(k), f"replay {k}: {what}")
    after = pg.get_op_paths()
    ctx.expect(after == before, f"replays counted: {before} -> {after}")


def _coalesced(pairs, op) -> None:
    """``op(output, input)`` for each (input, output) of ``pairs`` in one coalescing block
    (torch issues them as one coalesced call)."""
    with dist._coalescing_manager():
        for i, o in pairs:
            op(o, i)


def _capture(g, static, grp) -> None:
    with _graph(g):
        dist.all_reduce(static, group=grp)


def big(ctx):
    """16 MiB of bf16 and 64 MiB of float32 all_reduce: past MOONCAKE_CUDA_DIRECT_BYTES,
    on the host-driven device plane (alone, a local copy); a 16 MiB all_to_all_single, on
    the kernels (per-pair sizes, any size);
    a 16 MiB all_reduce captured in a CUDA graph (one launch per chunk) and replayed."""
    past = _plane_or_alone(ctx.world_size)
    for dtype, n in ((torch.bfloat16, 8 << 20), (torch.float32, 16 << 20)):
        xs = ctx.inputs((n,), dtype)
        x = cuda(xs[ctx.rank])
        got = _paths(lambda x=x: dist.all_reduce(x), direct=True)
        ctx.expect(got == past, f"{dtype} all_reduce of {x.nbytes >> 20} MiB: {got}")
        ctx.expect_equal(x.cpu(), reduce_ref(xs, "SUM"), f"{dtype}")
    world = ctx.world_size
    n = (4 << 20) // world * world
    xs = ctx.inputs((n,), torch.float32, tag="a2a")
    out = torch.empty(n, device="cuda")
    got = _paths(lambda: dist.all_to_all_single(out, cuda(xs[ctx.rank])), direct=True)
    ctx.expect(got == DIRECT, f"all_to_all_single of 16 MiB: {got}")
    k = n // world
    want = torch.cat([xs[s][ctx.rank * k : (ctx.rank + 1) * k] for s in range(world)])
    ctx.expect_equal(out.cpu(), want, "all_to_all_single")
    # Under capture a 16 MiB all_reduce goes as one launch per 8 MiB of it (one op counted),
    # once an op the kernels serve whole has set them up (this case may run alone).
    _usable(ctx, "nothing")
    xs = ctx.inputs((4 << 20,), torch.float32, tag="captured")
    x = cuda(xs[ctx.rank])
    g = torch.cuda.CUDAGraph()
    got = _paths(lambda: _capture(g, x, None), direct=True)
    ctx.expect(got == DIRECT, f"captured 16 MiB all_reduce: {got}")
    x.copy_(cuda(xs[ctx.rank]))
    g.replay()
    ctx.expect_equal(x.cpu(), reduce_ref(xs, "SUM"), "replayed 16 MiB all_reduce")


def beyond_segment(ctx):
    """Ops larger than the device segment (64 MiB) move through it in pieces, on the plane:
    a 96 MiB all_reduce in place (the op reads a copy of its input, which a re-run after a
    failure needs), a reduce_scatter_tensor of 64 MiB per rank and an all_gather_into_tensor
    of 80 MiB per rank; outputs start as NaN (alone: a local copy, at any size). Values are
    small integers (exact sums)."""
    world, me = ctx.world_size, ctx.rank
    past = _plane_or_alone(world)
    ranks_sum = world * (world - 1) // 2

    def pattern(first, n):
        return torch.arange(first, first + n, device="cuda") % 251

    n = 24 << 20
    x = (pattern(0, n) + me).float()
    got = _paths(lambda: dist.all_reduce(x), direct=True)
    ctx.expect(got == past, f"96 MiB all_reduce: (device, staged, direct) {got}")
    ctx.expect(torch.equal(x, (pattern(0, n) * world + ranks_sum).float()), "96 MiB all_reduce")
    m = 16 << 20
    inp = (pattern(0, world * m) + me).float()
    out = torch.full((m,), float("nan"), device="cuda")
    got = _paths(lambda: dist.reduce_scatter_tensor(out, inp), direct=True)
    ctx.expect(got == past, f"reduce_scatter_tensor of 64 MiB per rank: {got}")
    want = (pattern(me * m, m) * world + ranks_sum).float()
    ctx.expect(torch.equal(out, want), "reduce_scatter_tensor of 64 MiB per rank")
    k = 20 << 20
    mine = (pattern(0, k) + me).float()
    out = torch.full((world * k,), float("nan"), device="cuda")
    got = _paths(lambda: dist.all_gather_into_tensor(out, mine), direct=True)
    ctx.expect(got == past, f"all_gather_into_tensor of 80 MiB per rank: {got}")
    want = torch.cat([(pattern(0, k) + r).float() for r in range(world)])
    ctx.expect(torch.equal(out, want), "all_gather_into_tensor of 80 MiB per rank")


def _mapped_paths(fn, group) -> tuple[int, int]:
    """(mapped, mapped_planed) pieces that ``fn`` ran on ``group`` (pg.get_op_paths)."""
    from mooncake import pg

    before = pg.get_op_paths(group)
    fn()
    torch.cuda.synchronize()
    after = pg.get_op_paths(group)
    return tuple(after[k] - before[k] for k in ("mapped", "mapped_planed"))


def mapped_all_reduce(ctx):
    """MOONCAKE_CUDA_MAPPED=1 (a group with a 64 KiB device-driven bound and a 256 KiB
    segment, so that a 1 MiB all_reduce goes in four pieces): an all_reduce past the bound
    reads the ranks' tensors in place, one launch per piece that no host waits for. The
    group's first op maps its tensor's allocation and goes through the segments (every
    piece counted ``mapped_planed``); the next on the same tensor reads in place (every
    piece mapped). Other tensors may lie in an allocation already mapped (torch's caching
    allocator packs small ones together): their first op runs either way, their second in
    place. Every result equals the reference bit for bit (sources summed in rank order):
    fp32 and bf16 sums, max, an odd count, a view at an offset into its allocation, and a
    non-contiguous tensor (which goes through a copy). Alone: the option changes nothing
    (a local op)."""
    world, me = ctx.world_size, ctx.rank
    g = _group_with(
        {
            "MOONCAKE_CUDA_MAPPED": "1",
            "MOONCAKE_CUDA_DIRECT_BYTES": str(64 << 10),
            "MOONCAKE_CUDA_SEGMENT_BYTES": str(256 << 10),
        }
    )
    from reference import reduce_ref

    def check(x, op, what, expect: str):
        want = reduce_ref([ctx.input(x.shape, x.dtype, r, what) for r in range(world)], op)
        x.copy_(ctx.input(x.shape, x.dtype, me, what).to(x.device))
        mapped, planed = _mapped_paths(
            lambda: dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=g), g
        )
        ctx.expect_equal(x.cpu(), want, what)
        pieces = (mapped, planed)
        if world == 1:
            ctx.expect(pieces == (0, 0), f"{what}: alone, pieces (mapped, planed) {pieces}")
        elif expect == "planed":
            ctx.expect(mapped == 0 and planed > 0, f"{what}: pieces (mapped, planed) {pieces}")
        elif expect == "mapped":
            ctx.expect(planed == 0 and mapped > 0, f"{what}: pieces (mapped, planed) {pieces}")
        else:
            ctx.expect(mapped + planed > 0, f"{what}: pieces (mapped, planed) {pieces}")

    n = 1 << 18  # 1 MiB of fp32
    x = torch.empty(n, device="cuda")
    check(x, "SUM", "fp32 sum", "planed")
    check(x, "SUM", "fp32 sum, the same tensor", "mapped")
    check(x, "MAX", "fp32 max, the same tensor", "mapped")
    y = torch.empty(n + 4099, device="cuda", dtype=torch.bfloat16)
    check(y, "SUM", "bf16 sum, odd count", "either")
    check(y, "SUM", "bf16 sum, odd count, again", "mapped")
    # A view 4 KiB into a larger allocation: the offer says where it lies.
    big = torch.empty(n + 2048, device="cuda")
    view = big[1024 : 1024 + n]
    check(view, "SUM", "a view at an offset", "either")
    check(view, "SUM", "a view at an offset, again", "mapped")
    # Non-contiguous: reduced in a contiguous copy.
    strided = torch.empty(2 * n, device="cuda")[::2]
    want = reduce_ref([ctx.input((n,), torch.float32, r, "strided") for r in range(world)], "SUM")
    strided.copy_(ctx.input((n,), torch.float32, me, "strided").cuda())
    dist.all_reduce(strided, group=g)
    ctx.expect_equal(strided.cpu(), want, "non-contiguous")
    dist.destroy_process_group(g)


def device_p2p(ctx):
    """MOONCAKE_CUDA_P2P_BYTES=4096: sends and recvs of 4 KiB and more go device to device
    (the sender's buffer mapped by the receiver, a note on the host channel), smaller ones
    through host memory, and every message arrives bit for bit: a ring of blocking
    send/recv at several sizes and dtypes (one past the 1 MiB buffer size, so a larger
    buffer is made; repeats reuse them), isend/irecv, a recv into a non-contiguous
    tensor, a coalesced block and a recv from any source. A recv whose tensor is smaller
    than the message raises, naming both sizes, and the group goes on; at the end every
    sender has its buffers back (every receiver acknowledged)."""
    from mooncake import pg

    world, me = ctx.world_size, ctx.rank
    if world == 1:
        return
    g = _group_with({"MOONCAKE_CUDA_P2P_BYTES": "4096"})
    nxt, prv = (me + 1) % world, (me - 1) % world

    def ring(shape, dtype, tag: str) -> None:
        mine = ctx.input(shape, dtype, me, tag).cuda()
        buf = torch.zeros(shape, dtype=dtype, device="cuda")
        if me % 2 == 0:
            dist.send(mine, nxt, group=g)
            dist.recv(buf, prv, group=g)
        else:
            dist.recv(buf, prv, group=g)
            dist.send(mine, nxt, group=g)
        ctx.expect_equal(buf.cpu(), ctx.input(shape, dtype, prv, tag), tag)

    before = pg.get_op_paths(g)
    sizes = [((1024,), torch.float32), ((3, 4099), torch.bfloat16), (((1 << 18) + 5,), torch.int64)]
    for shape, dtype in sizes:
        for i in range(3):
            ring(shape, dtype, f"ring {shape} {dtype} #{i}")
    mid = pg.get_op_paths(g)
    ctx.expect(mid["p2p_device"] - before["p2p_device"] == 2 * 3 * len(sizes),
               f"device-to-device sends and recvs: {before} -> {mid}")  # fmt: skip
    ring((100,), torch.float32, "below the bound")  # 400 bytes: staged
    after = pg.get_op_paths(g)
    ctx.expect(after["p2p_device"] == mid["p2p_device"] and after["staged"] > mid["staged"],
               f"a small message is staged: {mid} -> {after}")  # fmt: skip

    # isend/irecv, and a recv into a non-contiguous tensor.
    mine = ctx.input((2048, 8), torch.float32, me, "iring").cuda()
    wide = torch.zeros(2048, 16, device="cuda")
    view = wide[:, ::2]
    works = [dist.irecv(view, prv, group=g), dist.isend(mine, nxt, group=g)]
    for w in works:
        w.wait()
    ctx.expect_equal(view.cpu(), ctx.input((2048, 8), torch.float32, prv, "iring"), "irecv")
    ctx.expect_equal(wide[:, 1::2].cpu(), torch.zeros(2048, 8), "irecv left the rest")

    # A coalesced block, device to device too.
    buf = torch.zeros(2048, 8, device="cuda")
    ops = [dist.P2POp(dist.irecv, buf, prv, group=g), dist.P2POp(dist.isend, mine, nxt, group=g)]
    before_batch = pg.get_op_paths(g)["p2p_device"]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ctx.expect_equal(buf.cpu(), ctx.input((2048, 8), torch.float32, prv, "iring"), "batch")
    ctx.expect(
        pg.get_op_paths(g)["p2p_device"] - before_batch == 2, "the batch went device to device"
    )

    # Every rank but 0 sends rank 0 64 KiB, which it receives from any source (under a tag
    # of their own: a rank past this block may already send rank 0 its next ring message).
    if me == 0:
        seen = set()
        for _ in range(world - 1):
            b = torch.empty(1 << 14, dtype=torch.int32, device="cuda")
            src = dist.recv(b, group=g, tag=5)
            seen.add(src)
            ctx.expect_equal(b.cpu(), torch.full((1 << 14,), src, dtype=torch.int32), f"from {src}")
        ctx.expect(seen == set(range(1, world)), f"any-source recv saw {sorted(seen)}")
    else:
        dist.send(torch.full((1 << 14,), me, dtype=torch.int32, device="cuda"), 0, group=g, tag=5)

    # Rank 0 sends 16 KiB where rank 1 receives 8 KiB: rank 1's recv raises, rank 0's send
    # completes, and both go on.
    if me == 0:
        dist.send(torch.ones(4096, device="cuda"), 1, group=g)
    elif me == 1:
        with ctx.expect_raises(ValueError, "16384", "8192"):
            dist.recv(torch.empty(2048, device="cuda"), 0, group=g)
    for shape, dtype in sizes:
        ring(shape, dtype, f"after the mismatch {shape} {dtype}")
    # Every receiver acknowledged (its copy done, or the mismatch refused): every buffer
    # came back to its sender (the acks are host messages after the copies: a moment).
    torch.cuda.synchronize()
    dist.barrier(group=g)
    deadline = time.monotonic() + 10
    while pg.get_op_paths(g)["p2p_lent"] and time.monotonic() < deadline:
        time.sleep(0.01)
    ctx.expect(pg.get_op_paths(g)["p2p_lent"] == 0, f"buffers still lent: {pg.get_op_paths(g)}")
    dist.destroy_process_group(g)


def placement(ctx):
    """Rank r runs on cuda:(r % GPUs), and so does its group (its CUDA active_ranks lie
    there); the ranks' devices, all-gathered on the device-driven kernels, span more than
    one GPU."""
    from mooncake import pg

    gpus = torch.cuda.device_count()
    mine = ctx.rank % gpus
    ctx.expect(torch.cuda.current_device() == mine, f"on cuda:{torch.cuda.current_device()}")
    device = pg.get_active_ranks().device
    ctx.expect(device == torch.device("cuda", mine), f"the group serves {device}, want cuda:{mine}")
    x = torch.tensor([mine], dtype=torch.int64, device="cuda")
    out = torch.empty(ctx.world_size, dtype=torch.int64, device="cuda")
    got = _paths(lambda: dist.all_gather_into_tensor(out, x), direct=True)
    ctx.expect(got == DIRECT, f"all_gather_into_tensor: (device, staged, direct) {got}")
    want = [r % gpus for r in range(ctx.world_size)]
    ctx.expect(out.cpu().tolist() == want, f"the ranks' devices {out.cpu().tolist()}, want {want}")


def other_gpu(ctx):
    """Rank 0's input on another GPU than its rank's. all_gather (a list form, its launch
    watched): ValueError on every rank (rank 0's names the argument and the device, the
    others' rank 0). all_gather_into_tensor (on the device-driven kernels, not watched):
    rank 0 raises ValueError naming the device, having taken part
    without data; the others' op completes with rank 0's part zero-filled. The group goes
    on."""
    gpus, world, me = torch.cuda.device_count(), ctx.world_size, ctx.rank
    other = f"cuda:{(me % gpus + 1) % gpus}"
    x = torch.full((4,), float(me + 1), device="cuda")
    if me == 0:
        x = x.to(other)
    outs = [torch.empty(4, device="cuda") for _ in range(world)]
    with ctx.expect_raises(ValueError, ("tensor must be on cuda", "rank 0")):
        dist.all_gather(outs, x)
    _usable(ctx, "a tensor on another GPU")
    out = _garbage((4 * world,), torch.float32)
    if me == 0:
        with ctx.expect_raises(ValueError, "all_gather_into_tensor", "tensors", other):
            dist.all_gather_into_tensor(out, x)
    else:
        got = _paths(lambda: dist.all_gather_into_tensor(out, x), direct=True)
        ctx.expect(got == DIRECT, f"all_gather_into_tensor beside a bad call: {got}")
        want = torch.cat([torch.zeros(4), *(torch.full((4,), r + 1.0) for r in range(1, world))])
        ctx.expect_equal(out.cpu(), want, "all_gather_into_tensor beside rank 0's bad call")
    _usable(ctx, "a tensor on another GPU on the device-driven kernels")


def _none_staged(fn, ctx) -> None:
    """Case ``fn``, none of whose ops on the world group may be staged through host memory."""
    from mooncake import pg

    before = pg.get_op_paths()["staged"]
    fn(ctx)
    staged = pg.get_op_paths()["staged"] - before
    ctx.expect(staged == 0, f"{staged} op(s) staged through host memory, not on the plane")


def multi_gpu_cases(world: int) -> list[Case]:
    """Ranks on different GPUs of one host: where they run; test_collectives.py's matrix on
    CUDA tensors (sampled dtypes, 0 to 70 000 elements), no op of any case staged; then
    this file's cases that assert the paths, the device-driven kernels among them (eager,
    and captured in a CUDA graph and replayed), and a tensor on another GPU."""
    from test_collectives import SAMPLE_DTYPES, on_device

    matrix = on_device(world, plane="all", sizes=(0, 7, 5000, 70_000), dtypes=SAMPLE_DTYPES)
    plane = (
        ("op_paths", op_paths),
        ("subgroup", subgroup),
        ("direct_matches_host", direct_matches_host),
        ("direct_matches_host_ops", direct_matches_host_ops),
        ("direct_matches_host_captured", direct_matches_host_captured),
        ("graph_capture", graph_capture),
        ("graph_replay", graph_replay),
        ("big", big),
        ("beyond_segment", beyond_segment),
        ("other_gpu", other_gpu),
    )
    return [
        Case("placement", placement),
        *(Case(c.name, functools.partial(_none_staged, c.fn)) for c in matrix),
        *(Case(name, fn) for name, fn in plane),
    ]


def cases(world: int) -> list[Case]:
    return [
        Case("stream_order", stream_order),
        Case("default_stream", default_stream),
        Case("future", future),
        Case("in_flight", in_flight),
        Case("coalesced", functools.partial(coalesced, async_ops=False)),
        Case("coalesced_async", functools.partial(coalesced, async_ops=True)),
        Case("functional", functional),
        Case("p2p", p2p),
        Case("cpu_tensors_too", cpu_tensors_too),
        Case("active_ranks", active_ranks),
        Case("bad_input", bad_input),
        Case("split_mismatch", split_mismatch),
        Case("all_to_all_any_size", all_to_all_any_size),
        Case("subgroup", subgroup),
        Case("op_paths", op_paths),
        Case("graph_capture", graph_capture),
        Case("direct_matches_host", direct_matches_host),
        Case("direct_matches_host_ops", direct_matches_host_ops),
        Case("direct_matches_host_captured", direct_matches_host_captured),
        Case("graph_replay", graph_replay),
        Case("spare_slots", spare_slots),
        Case("big", big),
        Case("beyond_segment", beyond_segment),
        Case("mapped_all_reduce", mapped_all_reduce),
        Case("device_p2p", device_p2p),
    ]


#: Default launches (up to 8 MiB, the ops the device-driven kernels take eagerly on them,
#: the rooted ops and list forms they could serve on the device plane at any size; other
#: ops under 64 KiB staged through host memory, larger ones on the device plane) and
#: launches where every op that fits and that the kernels do not take runs on the plane.
PLANE_ALL = (("MOONCAKE_CUDA_PLANE_MIN_BYTES", "0"),)
LAUNCH_S = 450.0  # the cases of a launch together (several processes share the one GPU)
LAUNCHES = [
    *(Launch(cases, w, f"cuda-w{w}", backend="mooncake", timeout_s=LAUNCH_S) for w in (1, 2, 4)),
    *(
        Launch(cases, w, f"cuda-w{w}-plane", env=PLANE_ALL, backend="mooncake", timeout_s=LAUNCH_S)
        for w in (2, 4)
    ),
]


@pytest.mark.parametrize(("launch", "case"), parametrize(LAUNCHES))
def test_cuda_backend(launch, case):
    check(launch, case)


#: Rank r on cuda:(r % GPUs), every op that fits on the plane.
MULTI_GPU_LAUNCHES = [
    Launch(
        multi_gpu_cases,
        w,
        f"cuda-gpus-w{w}",
        env=PLANE_ALL,
        backend="mooncake",
        spread_gpus=True,
        timeout_s=450.0,
    )
    for w in (2, 4)
]


@pytest.mark.multi_gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs 2 GPUs (ranks on different GPUs of one host); torch sees "
    f"{torch.cuda.device_count()} (gpu-check deselects multi_gpu there)",
)
@pytest.mark.parametrize(("launch", "case"), parametrize(MULTI_GPU_LAUNCHES))
def test_cuda_backend_multi_gpu(launch, case):
    """The case passed on every rank, the ranks spread over the host's GPUs."""
    check(launch, case)


def plane_cases(world: int, names=("op_paths", "subgroup", "big")) -> list[Case]:
    """The cases that assert the paths (of them, those in ``names``): the negative controls'."""
    fns = {"op_paths": op_paths, "subgroup": subgroup, "big": big}
    return [Case(n, fns[n]) for n in names]


def test_bypassed_plane_is_caught():
    """The negative control of the path assertions: with the device plane off (no segment:
    no device-driven kernels either), every case that asserts the plane or the kernels
    fails, naming the staged path ((device, staged, direct) = (0, 1, 0)), and the group ends
    cleanly. (If the assertions could not fail, this would.)"""
    off = Launch(
        plane_cases,
        2,
        "cuda-w2-no-plane",
        env=(("MOONCAKE_CUDA_SEGMENT_BYTES", "0"),),
        backend="mooncake",
    )
    result = run(off)
    for case in ("op_paths", "subgroup", "big"):
        passed, why = result.verdict(case)
        assert not passed and str(STAGED) in why, f"{case} with the plane off: {why or 'passed'}"
    passed, why = result.verdict(TEARDOWN)
    assert passed, why


def test_bypassed_kernels_are_caught():
    """The same for the device-driven kernels: with them off (MOONCAKE_CUDA_DIRECT=off, the
    plane on), op_paths and subgroup fail, naming the plane where the kernels were due
    ((device, staged, direct) = (1, 0, 0)), and the group ends cleanly."""
    off = Launch(
        plane_cases,
        2,
        "cuda-w2-no-direct",
        env=(("MOONCAKE_CUDA_DIRECT", "off"),),
        backend="mooncake",
        params=(("names", ("op_paths", "subgroup")),),
    )
    result = run(off)
    for case, words in (("op_paths", f"{PLANE}, want {DIRECT}"), ("subgroup", str(PLANE))):
        passed, why = result.verdict(case)
        assert not passed and words in why, f"{case} with the kernels off: {why or 'passed'}"
    passed, why = result.verdict(TEARDOWN)
    assert passed, why


@needs_cuda
@pytest.mark.timeout(300)
def test_graph_replay_masks_a_killed_rank():
    """World 3, a 4 KiB all_reduce captured in a CUDA graph and replayed; rank 0 (not
    special: the store is the parent's) dies by SIGKILL right after launching a replay.
    That replay covers it on every survivor or on none (they agree); every later replay
    finishes at once (the host saw it gone: the op timeout is 60 s) over the survivors,
    who find it 0 in their CUDA active_ranks; an eager call agrees; an op on the host then
    settles the view without it, and the path, set up again, serves the eager call and
    the old graph alike. Runs without MPS (a process killed inside a kernel under MPS
    fails every client of the GPU)."""
    from cuda_backend_round import replay_through_a_kill
    from mooncake.launch import LocalGroup

    world, victim = 3, 0
    survivors = [r for r in range(world) if r != victim]
    with LocalGroup(world, env={"PYTHONUNBUFFERED": "1"}) as group:
        group.start(replay_through_a_kill, args=(victim,))
        group.expect_exit(victim)
        results = group.results(timeout_s=240)

    def total(ranks, k):
        return [float(sum((r + 1) * (k + 1) for r in ranks))]

    racing = {str(results[str(r)]["racing"]) for r in survivors}
    assert len(racing) == 1, f"the survivors disagree on the replay the victim died in: {racing}"
    assert results[str(survivors[0])]["racing"] in (
        total(range(world), 3),
        total(survivors, 3),
    ), results
    for r in survivors:
        got = results[str(r)]
        assert got["before"] == [total(range(world), k) for k in range(3)], (r, got)
        assert got["after"] == [total(survivors, k) for k in range(4, 7)], (r, got)
        assert got["racing_s"] < 15 and got["after_s"] < 15, (r, got)
        assert got["active"] == [0 if q == victim else 1 for q in range(world)], (r, got)
        assert got["eager"] == [float(sum(q + 1 for q in survivors))], (r, got)
        assert got["synced"] == len(survivors), (r, got)
        assert got["eager_after_view"] == got["eager"], (r, got)
        assert got["replay_after_view"] == total(survivors, 7), (r, got)
        assert got["paths"]["staged"] == 0 and got["paths"]["direct"] >= 4, (r, got)
