"""async_op=True: Work objects, futures, timeouts, and DDP's use of them.

* many ops in flight complete, in issue order, with correct results;
* issuing an op does not wait for the peers;
* ``Work.wait(timeout=...)`` gives up on time with TimeoutError and the op
  still completes later;
* ``get_future()`` resolves to the output tensors; ``then`` chains run;
* DDP (default and with an all_reduce-future comm hook) trains to the same
  parameters on every rank as a local reference computed from all ranks'
  batches.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from launcher import SMALL_CHUNKS, Case, Launch, check, parametrize
from reference import reduce_ref


def in_flight(ctx, count):
    """``count`` mixed async ops (sizes 0..5000, several dtypes) issued back to back, then
    waited in reverse order: all results exact, and completion callbacks ran in issue order."""
    world = ctx.world_size
    dtypes = (torch.float32, torch.int64, torch.bfloat16, torch.uint8)
    done_order: list[int] = []
    checks = []
    works = []
    for i in range(count):
        dtype, n = dtypes[i % len(dtypes)], (0, 1, 7, 1001, 5000)[i % 5]
        kind = i % 3
        if kind == 0:
            x = ctx.input((n,), dtype, tag=str(i))
            work = dist.all_reduce(x, async_op=True)
            checks.append((x, reduce_ref(ctx.inputs((n,), dtype, str(i)), "SUM")))
        elif kind == 1:
            root = i % world
            x = ctx.input((n,), dtype, tag=str(i))
            work = dist.broadcast(x, src=root, async_op=True)
            checks.append((x, ctx.input((n,), dtype, root, str(i))))
        else:
            x = ctx.input((n,), dtype, tag=str(i))
            out = torch.empty(world * n, dtype=dtype)
            work = dist.all_gather_into_tensor(out, x, async_op=True)
            checks.append((out, torch.cat(ctx.inputs((n,), dtype, str(i)))))
        work.get_future().then(lambda _f, i=i: done_order.append(i))
        works.append(work)
    for work in reversed(works):
        work.wait()
    for i, (got, want) in enumerate(checks):
        ctx.expect_equal(got, want, f"op {i}")
    ctx.expect(all(w.is_completed() and w.is_success() for w in works), "work not completed")
    deadline = time.monotonic() + 5
    while len(done_order) < count and time.monotonic() < deadline:
        time.sleep(0.001)  # `then` callbacks may run just after wait() returns
    ctx.expect(done_order == list(range(count)), f"completion order {done_order[:20]}...")


def issue_does_not_block(ctx):
    """Rank 0 issues an all_reduce while the others are 2.5 s late: issuing returns at once,
    is_completed() is False, wait(timeout=200 ms) called at once raises TimeoutError well
    before the others join, and the op completes correctly once they do."""
    me, world = ctx.rank, ctx.world_size
    x = ctx.input((1001,), torch.float64)
    want = reduce_ref(ctx.inputs((1001,), torch.float64), "SUM")
    if me != 0:
        time.sleep(2.5)
        dist.all_reduce(x)
        ctx.expect_equal(x, want)
        return
    start = time.monotonic()
    work = dist.all_reduce(x, async_op=True)
    if world > 1:
        try:
            work.wait(timeout=timedelta(milliseconds=200))
            raised = None
        except Exception as e:  # checked below, after the timing
            raised = e
        took = time.monotonic() - start
        ctx.expect(isinstance(raised, TimeoutError), f"wait(timeout=200 ms) raised {raised!r}")
        ctx.expect(
            took < 2.0,
            f"issue + wait(timeout=200 ms) returned after {took:.2f} s (the peers joined "
            "after 2.5 s)",
        )
        if isinstance(raised, TimeoutError):
            ctx.expect(not work.is_completed(), "is_completed() before the peers joined")
    work.wait()
    ctx.expect_equal(x, want)


def progress_without_wait(ctx):
    """Async ops complete, and their futures' callbacks run, with nobody calling wait():
    the caller only polls is_completed()."""
    xs = [ctx.input((n,), torch.float32, tag=str(n)) for n in (7, 5000)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    fired = []
    works[-1].get_future().then(lambda _f: fired.append(True))
    deadline = time.monotonic() + 20
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.005)
    ctx.expect(all(w.is_completed() for w in works), "not completed after 20 s without wait()")
    while not fired and time.monotonic() < deadline:
        time.sleep(0.005)
    ctx.expect(bool(fired), "the future's callback did not run")
    for x, n in zip(xs, (7, 5000), strict=True):
        ctx.expect_equal(x, reduce_ref(ctx.inputs((n,), torch.float32, str(n)), "SUM"), f"n={n}")


def irecv_wait_timeout(ctx):
    """irecv(...).wait(timeout=200 ms) with no sender yet raises TimeoutError on time; the
    receive still completes when the message comes."""
    world, me = ctx.world_size, ctx.rank
    if world < 2:
        return
    if me == 0:
        got = torch.zeros(5)
        work = dist.irecv(got, src=1, tag=3)
        start = time.monotonic()
        with ctx.expect_raises(TimeoutError):
            work.wait(timeout=timedelta(milliseconds=200))
        took = time.monotonic() - start
        ctx.expect(0.15 <= took < 2.0, f"wait(timeout=200 ms) returned after {took:.2f} s")
        ctx.store.set("timed-out", "1")
        work.wait()
        ctx.expect_equal(got, torch.arange(5.0), "message")
    elif me == 1:
        ctx.store.wait(["timed-out"], timedelta(seconds=30))
        dist.send(torch.arange(5.0), dst=0, tag=3)


def futures(ctx):
    """get_future().wait() returns the output tensors; then() chains see them."""
    world = ctx.world_size
    x = ctx.input((7,), torch.float32)
    fut = dist.all_reduce(x, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    value = fut.wait()
    want = reduce_ref(ctx.inputs((7,), torch.float32), "SUM")
    ctx.expect(isinstance(value, list) and len(value) == 1, f"future value {value!r}")
    ctx.expect_equal(value[0], want, "future value")
    ctx.expect_equal(doubled.wait(), want * 2, "then() result")
    out = [torch.empty(3, dtype=torch.int32) for _ in range(world)]
    value = (
        dist.all_gather(out, torch.full((3,), ctx.rank, dtype=torch.int32), async_op=True)
        .get_future()
        .wait()
    )
    for r in range(world):
        ctx.expect_equal(
            value[r] if len(value) == world else out[r],
            torch.full((3,), r, dtype=torch.int32),
            f"all_gather slot {r}",
        )
    fut = dist.barrier(async_op=True).get_future()
    fut.wait()
    ctx.expect(fut.done(), "barrier future not done after wait()")
    # The future of a work that is already done (it is made on first asking), twice.
    y = ctx.input((5,), torch.float32, tag="late")
    work = dist.all_reduce(y, async_op=True)
    work.wait()
    late = work.get_future()
    ctx.expect(late.done(), "the future of a finished work is not done")
    ctx.expect(work.get_future() is late or work.get_future().done(), "a second future differs")
    ctx.expect_equal(
        late.value()[0],
        reduce_ref(ctx.inputs((5,), torch.float32, tag="late"), "SUM"),
        "late future value",
    )


def every_op_async(ctx):
    """Every collective accepts async_op=True; waiting the works in issue order gives the
    same results as the blocking calls."""
    world, me = ctx.world_size, ctx.rank
    n = 1001
    root = world - 1
    a = ctx.input((n,), torch.float32, tag="a")
    b = ctx.input((n,), torch.int32, tag="b")
    c_out = torch.empty(world * n, dtype=torch.float16)
    d_in = ctx.input((world * n,), torch.float64, tag="d")
    d_out = torch.empty(n, dtype=torch.float64)
    e_in = ctx.input((world * 5,), torch.int8, tag="e")
    e_out = torch.empty(world * 5, dtype=torch.int8)
    g_out = [torch.empty(n, dtype=torch.bfloat16) for _ in range(world)]
    s_out = torch.empty(n, dtype=torch.int64)
    s_in = [ctx.input((n,), torch.int64, tag=f"s{p}") for p in range(world)]
    works = [
        dist.all_reduce(a, op=dist.ReduceOp.MAX, async_op=True),
        dist.reduce(b, dst=root, op=dist.ReduceOp.BXOR, async_op=True),
        dist.all_gather_into_tensor(c_out, ctx.input((n,), torch.float16, tag="c"), async_op=True),
        dist.reduce_scatter_tensor(d_out, d_in, op=dist.ReduceOp.AVG, async_op=True),
        dist.all_to_all_single(e_out, e_in, async_op=True),
        dist.gather(
            ctx.input((n,), torch.bfloat16, tag="g"),
            g_out if me == root else None,
            dst=root,
            async_op=True,
        ),
        dist.scatter(s_out, s_in if me == root else None, src=root, async_op=True),
        dist.barrier(async_op=True),
    ]
    for w in works:
        w.wait()
    ctx.expect_equal(a, reduce_ref(ctx.inputs((n,), torch.float32, "a"), "MAX"), "all_reduce")
    if me == root:
        ctx.expect_equal(b, reduce_ref(ctx.inputs((n,), torch.int32, "b"), "BXOR"), "reduce")
        for r in range(world):
            ctx.expect_equal(g_out[r], ctx.input((n,), torch.bfloat16, r, "g"), f"gather {r}")
    ctx.expect_equal(c_out, torch.cat(ctx.inputs((n,), torch.float16, "c")), "all_gather")
    parts = [t[me * n : (me + 1) * n] for t in ctx.inputs((world * n,), torch.float64, "d")]
    ctx.expect_equal(d_out, reduce_ref(parts, "AVG"), "reduce_scatter_tensor")
    want = torch.cat([t[me * 5 : (me + 1) * 5] for t in ctx.inputs((world * 5,), torch.int8, "e")])
    ctx.expect_equal(e_out, want, "all_to_all_single")
    ctx.expect_equal(s_out, ctx.input((n,), torch.int64, root, f"s{me}"), "scatter")


# --- DDP ------------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _allreduce_hook(state, bucket):
    """A comm hook built on all_reduce futures: sum the bucket, then divide by the world."""
    world = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


def _reference_training(world: int, steps: int, hook: bool) -> list[torch.Tensor]:
    """What DDP must compute: rank 0's initial weights, and per step the mean of every rank's
    gradient in the order the backend reduces (rank order), then one SGD step."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            x, y = _batch(step, r)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            if hook:  # sum in rank order, then divide
                acc = grads[0][i].clone()
                for g in grads[1:]:
                    acc += g[i]
                p.grad = acc.div_(world)
            else:  # DDP scales each rank's gradient by 1/world first, then sums
                acc = grads[0][i] * (1.0 / world)
                for g in grads[1:]:
                    acc += g[i] * (1.0 / world)
                p.grad = acc
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ddp(ctx, hook: bool, steps: int = 3):
    """DDP broadcasts rank 0's weights, then every step leaves identical parameters equal to
    the local reference on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0 if ctx.rank == 0 else 100 + ctx.rank)  # rank 0's init must win
    model = DistributedDataParallel(_model())
    if hook:
        model.register_comm_hook(None, _allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step, ctx.rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    want = _reference_training(ctx.world_size, steps, hook)
    for i, (p, w) in enumerate(zip(model.parameters(), want, strict=True)):
        ctx.expect_equal(p.detach(), w, f"parameter {i}")


def async_cases(world: int) -> list[Case]:
    return [
        Case("in_flight/64", functools.partial(in_flight, count=64)),
        Case("in_flight/300", functools.partial(in_flight, count=300)),
        Case("issue_does_not_block", issue_does_not_block),
        Case("progress_without_wait", progress_without_wait),
        Case("irecv_wait_timeout", irecv_wait_timeout),
        Case("futures", futures),
        Case("every_op_async", every_op_async),
        Case("ddp/default", functools.partial(ddp, hook=False)),
        Case("ddp/comm_hook", functools.partial(ddp, hook=True)),
    ]


LAUNCHES = [
    *(Launch(async_cases, w, f"w{w}-chunk4k", env=SMALL_CHUNKS) for w in (1, 2, 3)),
    # Async ops normally start after a short delay (a caller that waits sooner runs them
    # itself); with no delay the queue's thread runs every op.
    Launch(async_cases, 3, "w3-no-start-delay", env=(("MOONCAKE_ASYNC_DELAY_US", "0"),)),
    Launch(async_cases, 4, "w4-default"),
    Launch(async_cases, 8, "w8-chunk4k", env=SMALL_CHUNKS, stress=True),
]


@pytest.mark.parametrize(("launch", "case"), parametrize(LAUNCHES))
def test_async(launch, case):
    """Async work completes correctly and on time on every rank."""
    check(launch, case)
