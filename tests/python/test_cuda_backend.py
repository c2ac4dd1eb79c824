"""The ``mooncake`` backend with CUDA tensors: what the CPU cases cannot show.

(test_collectives.py runs its whole op x dtype x size x layout matrix on CUDA
tensors too, and test_fault_tolerance.py kills ranks of a CUDA group.) Here:

* stream semantics: an op is ordered after the caller's current stream and
  issuing it does not wait for the GPU; ``wait()`` makes the current stream wait
  for the results; ``get_future()`` resolves to the device tensors;
* coalescing blocks, ``batch_isend_irecv``, functional collectives, p2p (also
  from any source) on CUDA tensors;
* one group serves CPU tensors too; ``active_ranks`` is a CUDA int32 tensor;
* which path served an op (``pg.get_op_paths``): the device plane where it should;
* the device-driven all_reduce: one-shot and two-shot equal to the host-driven paths bit
  for bit; captured in a CUDA graph and replayed with new inputs, equal to eager calls;
  which ops can be captured, and that capture needs one eager call first; and, in a
  launch of its own (``test_graph_replay_masks_a_killed_rank``), a rank killed between
  replays: the survivors' replays finish at once and cover the others;
* bad input (CPU and CUDA tensors mixed, split sizes that disagree between ranks, an op
  under CUDA graph capture that cannot be captured) raises ValueError naming the argument
  on every rank, and the group goes on;
* ranks on different GPUs of one host (``test_cuda_backend_multi_gpu``, marked
  ``multi_gpu``: it needs 2 GPUs): the op matrix and the plane's cases again, every op on
  the plane, and a tensor on another GPU than its rank's rejected.

Runs only with a GPU and a CUDA build (``make gpu-check``); several processes
share the one GPU, except in the ``multi_gpu`` launches.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

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
    """An output that no right answer equals: NaN, or -77 for integers."""
    return torch.full(
        shape, float("nan") if dtype.is_floating_point else -77, dtype=dtype, device="cuda"
    )


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
    one rank's bad call (the others' errors name that rank). The group goes on. (A tensor on
    another GPU than the rank's is rejected the same way: ``other_gpu``, with 2 GPUs.)"""
    world = ctx.world_size
    x = torch.ones(4, device="cuda")
    with ctx.expect_raises(ValueError, "all_gather_into_tensor", "input_tensor", "cpu"):
        dist.all_gather_into_tensor(torch.empty(4 * world, device="cuda"), torch.ones(4))
    _usable(ctx, "mixed devices")
    if world > 1:
        bad = ctx.rank == 0
        out = [torch.empty(4) if bad else torch.empty(4, device="cuda") for _ in range(world)]
        with ctx.expect_raises(ValueError, ("tensor_list", "rank 0")):
            dist.all_gather(out, x)
        _usable(ctx, "one rank's bad call")


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


def subgroup(ctx):
    """A subgroup of the even ranks (its own device segments, mapped among its members) and
    the world group, used in turn; 128 KiB tensors, which take the device plane."""
    world, n = ctx.world_size, 1 << 15
    ranks = list(range(0, world, 2))
    g = dist.new_group(ranks)
    for i in range(2):
        x = torch.full((n,), float(ctx.rank + 1), device="cuda")
        if ctx.rank in ranks:
            got = _paths(lambda x=x: dist.all_reduce(x, group=g), g)
            ctx.expect(got == (1, 0), f"subgroup all_reduce {i}: (device, staged) {got}")
            want = float(sum(r + 1 for r in ranks))
            ctx.expect(bool((x == want).all()), f"subgroup all_reduce {i}: {x[0].item()}")
        y = torch.full((n,), float(ctx.rank + 1), device="cuda")
        got = _paths(lambda y=y: dist.all_reduce(y))
        ctx.expect(got == (1, 0), f"world all_reduce {i}: (device, staged) {got}")
        want = world * (world + 1) / 2
        ctx.expect(bool((y == want).all()), f"world all_reduce {i}: {y[0].item()}")
    dist.destroy_process_group(g)


def _paths(fn, group=None, direct: bool = False) -> tuple[int, ...]:
    """(device, staged) ops that ``fn`` issued on ``group``, from pg.get_op_paths; with
    ``direct``, (device, staged, direct): direct counts the device-driven all_reduce."""
    from mooncake import pg

    before = pg.get_op_paths(group)
    fn()
    torch.cuda.synchronize()
    after = pg.get_op_paths(group)
    keys = ("device", "staged", "direct") if direct else ("device", "staged")
    return tuple(after[k] - before[k] for k in keys)


def op_paths(ctx):
    """Which path served each op, asserted (the plane must not be bypassed silently):
    128 KiB and 4 KiB all_reduce on the device-driven kernel and all_gather_into_tensor
    on the device plane at every launch; gather, scatter and reduce on the plane too; CPU
    tensors in the same group counted as neither."""
    world, n = ctx.world_size, 1 << 15
    x = torch.ones(n, device="cuda")
    out = torch.empty(world * n, device="cuda")
    got = _paths(lambda: dist.all_reduce(x), direct=True)
    ctx.expect(got == (1, 0, 1), f"128 KiB all_reduce: (device, staged, direct) {got}")
    got = _paths(lambda: dist.all_gather_into_tensor(out, x), direct=True)
    ctx.expect(got == (1, 0, 0), f"128 KiB all_gather_into_tensor: {got}")
    small = torch.ones(1024, device="cuda")
    got = _paths(lambda: dist.all_reduce(small), direct=True)
    ctx.expect(got == (1, 0, 1), f"4 KiB all_reduce: {got}")
    parts = [torch.empty(n, device="cuda") for _ in range(world)] if ctx.rank == 0 else None
    got = _paths(lambda: dist.gather(x, parts, dst=0))
    ctx.expect(got == (1, 0), f"gather: {got}")
    got = _paths(lambda: dist.scatter(x, [p.clone() for p in parts] if parts else None, src=0))
    ctx.expect(got == (1, 0), f"scatter: {got}")
    got = _paths(lambda: dist.reduce(x, dst=world - 1))
    ctx.expect(got == (1, 0), f"reduce: {got}")
    got = _paths(lambda: dist.all_reduce(torch.ones(n)))
    ctx.expect(got == (0, 0), f"CPU all_reduce: {got}")


def _capture_raises(ctx, fn, *match) -> None:
    """``fn()`` under CUDA graph capture raises ValueError matching ``match``, and the
    capture ends cleanly."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        try:
            with ctx.expect_raises(ValueError, *match):
                with torch.cuda.graph(g, stream=s):
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


def graph_capture(ctx):
    """Under CUDA graph capture: an op other than all_reduce raises ValueError naming the
    ops that can be captured; so does all_reduce on a group whose device-driven path was
    never set up (one eager call first sets it up, and capture then works), and on a group
    where MOONCAKE_CUDA_ALLREDUCE=host turns that path off. The groups go on."""
    x = torch.ones(4, device="cuda")
    _capture_raises(ctx, lambda: dist.broadcast(x, 0), "graph capture", "all_reduce")
    _usable(ctx, "a broadcast under graph capture")
    fresh = _group_with({})
    _capture_raises(
        ctx, lambda: dist.all_reduce(x, group=fresh), "graph capture", "outside the captured"
    )
    y = torch.ones(4, device="cuda")
    dist.all_reduce(y, group=fresh)  # sets it up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(y, group=fresh)
    y.fill_(1.0)
    g.replay()
    ctx.expect_equal(y.cpu(), torch.full((4,), float(ctx.world_size)), "replay after set-up")
    host = _group_with({"MOONCAKE_CUDA_ALLREDUCE": "host"})
    _capture_raises(ctx, lambda: dist.all_reduce(x, group=host), "graph capture")
    z = torch.ones(4, device="cuda")
    dist.all_reduce(z, group=host)
    ctx.expect_equal(z.cpu(), torch.full((4,), float(ctx.world_size)), "host group after capture")
    for grp in (fresh, host):
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
    MOONCAKE_CUDA_ALLREDUCE=oneshot / twoshot) and as it comes (auto, the world group),
    equals the host-driven paths (a group with MOONCAKE_CUDA_ALLREDUCE=host: the device
    plane, or staged below 64 KiB) and the reference bit for bit, over dtypes, ops and
    sizes; also in place on a non-contiguous tensor and on a view 4 bytes off alignment
    (the scalar paths). The paths are asserted: every call of the first three took the
    device-driven kernel, none of the host group's."""
    groups = {
        "host": _group_with({"MOONCAKE_CUDA_ALLREDUCE": "host"}),
        "oneshot": _group_with({"MOONCAKE_CUDA_ALLREDUCE": "oneshot"}),
        "twoshot": _group_with({"MOONCAKE_CUDA_ALLREDUCE": "twoshot"}),
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


def graph_replay(ctx):
    """all_reduce captured in a CUDA graph (4 KiB one-shot on the world group; 1 MiB on
    the world group, and two-shot on a group forced to it), replayed 5 times with new
    inputs, an eager all_reduce between replays: each replay equals an eager all_reduce of
    the same inputs (and the reference) bit for bit. Capture counts one direct op; the
    replays count none (they are the GPU's alone)."""
    from mooncake import pg

    two = _group_with({"MOONCAKE_CUDA_ALLREDUCE": "twoshot"})
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


def _capture(g, static, grp) -> None:
    with torch.cuda.graph(g):
        dist.all_reduce(static, group=grp)


def big(ctx):
    """16 MiB of bf16 and 64 MiB of float32 all_reduce; a 16 MiB all_to_all_single."""
    for dtype, n in ((torch.bfloat16, 8 << 20), (torch.float32, 16 << 20)):
        xs = ctx.inputs((n,), dtype)
        x = cuda(xs[ctx.rank])
        got = _paths(lambda x=x: dist.all_reduce(x))
        ctx.expect(got == (1, 0), f"{dtype} all_reduce of {x.nbytes >> 20} MiB: {got}")
        ctx.expect_equal(x.cpu(), reduce_ref(xs, "SUM"), f"{dtype}")
    world = ctx.world_size
    n = (4 << 20) // world * world
    xs = ctx.inputs((n,), torch.float32, tag="a2a")
    out = torch.empty(n, device="cuda")
    dist.all_to_all_single(out, cuda(xs[ctx.rank]))
    k = n // world
    want = torch.cat([xs[s][ctx.rank * k : (ctx.rank + 1) * k] for s in range(world)])
    ctx.expect_equal(out.cpu(), want, "all_to_all_single")


def beyond_segment(ctx):
    """Ops larger than the device segment (64 MiB) move through it in pieces, on the plane:
    a 96 MiB all_reduce in place (the op reads a copy of its input, which a re-run after a
    failure needs), a reduce_scatter_tensor of 64 MiB per rank and an all_gather_into_tensor
    of 80 MiB per rank; outputs start as NaN. Values are small integers (exact sums)."""
    world, me = ctx.world_size, ctx.rank
    ranks_sum = world * (world - 1) // 2

    def pattern(first, n):
        return torch.arange(first, first + n, device="cuda") % 251

    n = 24 << 20
    x = (pattern(0, n) + me).float()
    got = _paths(lambda: dist.all_reduce(x))
    ctx.expect(got == (1, 0), f"96 MiB all_reduce: (device, staged) {got}")
    ctx.expect(torch.equal(x, (pattern(0, n) * world + ranks_sum).float()), "96 MiB all_reduce")
    m = 16 << 20
    inp = (pattern(0, world * m) + me).float()
    out = torch.full((m,), float("nan"), device="cuda")
    got = _paths(lambda: dist.reduce_scatter_tensor(out, inp))
    ctx.expect(got == (1, 0), f"reduce_scatter_tensor of 64 MiB per rank: {got}")
    want = (pattern(me * m, m) * world + ranks_sum).float()
    ctx.expect(torch.equal(out, want), "reduce_scatter_tensor of 64 MiB per rank")
    k = 20 << 20
    mine = (pattern(0, k) + me).float()
    out = torch.full((world * k,), float("nan"), device="cuda")
    got = _paths(lambda: dist.all_gather_into_tensor(out, mine))
    ctx.expect(got == (1, 0), f"all_gather_into_tensor of 80 MiB per rank: {got}")
    want = torch.cat([(pattern(0, k) + r).float() for r in range(world)])
    ctx.expect(torch.equal(out, want), "all_gather_into_tensor of 80 MiB per rank")


def placement(ctx):
    """Rank r runs on cuda:(r % GPUs), and so does its group (its CUDA active_ranks lie
    there); the ranks' devices, all-gathered on the plane, span more than one GPU."""
    from mooncake import pg

    gpus = torch.cuda.device_count()
    mine = ctx.rank % gpus
    ctx.expect(torch.cuda.current_device() == mine, f"on cuda:{torch.cuda.current_device()}")
    device = pg.get_active_ranks().device
    ctx.expect(device == torch.device("cuda", mine), f"the group serves {device}, want cuda:{mine}")
    x = torch.tensor([mine], dtype=torch.int64, device="cuda")
    out = torch.empty(ctx.world_size, dtype=torch.int64, device="cuda")
    got = _paths(lambda: dist.all_gather_into_tensor(out, x))
    ctx.expect(got == (1, 0), f"all_gather_into_tensor: (device, staged) {got}")
    want = [r % gpus for r in range(ctx.world_size)]
    ctx.expect(out.cpu().tolist() == want, f"the ranks' devices {out.cpu().tolist()}, want {want}")


def other_gpu(ctx):
    """Rank 0's input on another GPU than its rank's: ValueError on every rank (rank 0's
    names the argument and the device, the others' rank 0), and the group goes on."""
    gpus = torch.cuda.device_count()
    mine = ctx.rank % gpus
    x = torch.ones(4, device="cuda")
    if ctx.rank == 0:
        x = x.to(f"cuda:{(mine + 1) % gpus}")
    out = torch.empty(4 * ctx.world_size, device="cuda")
    with ctx.expect_raises(ValueError, ("input_tensor", "rank 0")):
        dist.all_gather_into_tensor(out, x)
    _usable(ctx, "a tensor on another GPU")


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
    this file's cases that assert the plane, the device-driven all_reduce among them (eager,
    and captured in a CUDA graph and replayed), and a tensor on another GPU."""
    from test_collectives import SAMPLE_DTYPES, on_device

    matrix = on_device(world, plane="all", sizes=(0, 7, 5000, 70_000), dtypes=SAMPLE_DTYPES)
    plane = (
        ("op_paths", op_paths),
        ("subgroup", subgroup),
        ("direct_matches_host", direct_matches_host),
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
        Case("subgroup", subgroup),
        Case("op_paths", op_paths),
        Case("graph_capture", graph_capture),
        Case("direct_matches_host", direct_matches_host),
        Case("graph_replay", graph_replay),
        Case("big", big),
        Case("beyond_segment", beyond_segment),
    ]


#: Default launches (ops under 64 KiB staged through host memory, larger ones on the device
#: plane) and launches where every op that fits takes the plane.
PLANE_ALL = (("MOONCAKE_CUDA_PLANE_MIN_BYTES", "0"),)
LAUNCHES = [
    *(Launch(cases, w, f"cuda-w{w}", backend="mooncake") for w in (1, 2, 4)),
    *(Launch(cases, w, f"cuda-w{w}-plane", env=PLANE_ALL, backend="mooncake") for w in (2, 4)),
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


def plane_cases(world: int) -> list[Case]:
    return [Case(n, fn) for n, fn in (("op_paths", op_paths), ("subgroup", subgroup), ("big", big))]


def test_bypassed_plane_is_caught():
    """The negative control of the path assertions: with the device plane off (no segment),
    every case that asserts the plane fails, naming the staged path, and the group ends
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
        assert not passed and "(0, 1)" in why, f"{case} with the plane off: {why or 'passed'}"
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
