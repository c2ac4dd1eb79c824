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
* bad input (CPU and CUDA tensors mixed, split sizes that disagree between ranks, an op
  under CUDA graph capture) raises ValueError naming the argument on every rank,
  and the group goes on.

Runs only with a GPU and a CUDA build (``make gpu-check``); several processes
share the one GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from launcher import TEARDOWN, Case, Launch, check, needs_cuda, parametrize, run
from reference import reduce_ref

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
    another GPU than the rank's is rejected the same way; one GPU cannot show it.)"""
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


def _paths(fn, group=None) -> tuple[int, int]:
    """(device, staged) ops that ``fn`` issued on ``group``, from pg.get_op_paths."""
    from mooncake import pg

    before = pg.get_op_paths(group)
    fn()
    torch.cuda.synchronize()
    after = pg.get_op_paths(group)
    return after["device"] - before["device"], after["staged"] - before["staged"]


def op_paths(ctx):
    """Which path served each op, asserted (the plane must not be bypassed silently):
    128 KiB all_reduce and all_gather_into_tensor on the device plane at every launch; a
    4 KiB all_reduce on the plane where PLANE_ALL lowers its threshold, else staged;
    gather, scatter and reduce on the plane too; CPU tensors in the same group counted as
    neither."""
    import os

    world, n = ctx.world_size, 1 << 15
    x = torch.ones(n, device="cuda")
    out = torch.empty(world * n, device="cuda")
    got = _paths(lambda: dist.all_reduce(x))
    ctx.expect(got == (1, 0), f"128 KiB all_reduce: (device, staged) {got}")
    got = _paths(lambda: dist.all_gather_into_tensor(out, x))
    ctx.expect(got == (1, 0), f"128 KiB all_gather_into_tensor: {got}")
    small = torch.ones(1024, device="cuda")
    plane_all = os.environ.get("MOONCAKE_CUDA_PLANE_MIN_BYTES") == "0"
    got = _paths(lambda: dist.all_reduce(small))
    ctx.expect(got == ((1, 0) if plane_all else (0, 1)), f"4 KiB all_reduce: {got}")
    parts = [torch.empty(n, device="cuda") for _ in range(world)] if ctx.rank == 0 else None
    got = _paths(lambda: dist.gather(x, parts, dst=0))
    ctx.expect(got == (1, 0), f"gather: {got}")
    got = _paths(lambda: dist.scatter(x, [p.clone() for p in parts] if parts else None, src=0))
    ctx.expect(got == (1, 0), f"scatter: {got}")
    got = _paths(lambda: dist.reduce(x, dst=world - 1))
    ctx.expect(got == (1, 0), f"reduce: {got}")
    got = _paths(lambda: dist.all_reduce(torch.ones(n)))
    ctx.expect(got == (0, 0), f"CPU all_reduce: {got}")


def graph_capture(ctx):
    """An op under CUDA graph capture raises ValueError saying why, on every rank."""
    x = torch.ones(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        try:
            with ctx.expect_raises(ValueError, "graph capture"):
                with torch.cuda.graph(g, stream=s):
                    dist.all_reduce(x)
        except RuntimeError as e:  # the capture itself failing on the way out
            ctx.fail(f"capture raised {e}")
    _usable(ctx, "graph capture")


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
