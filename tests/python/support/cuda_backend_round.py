"""A round of the ``mooncake`` backend on CUDA tensors at 2+ processes, for compute-sanitizer.

    cuda_backend_round.py [--world N]     (default 2; starts N ranks on the one GPU)

Every op the device plane serves, on inputs that take it (``MOONCAKE_CUDA_PLANE_MIN_BYTES=0``)
through a 64 KiB segment (``MOONCAKE_CUDA_SEGMENT_BYTES``), so that the larger ones move
through it in pieces, and isend/irecv (staged) beside them. all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, all_reduce_coalesced, the rooted ops and
the list forms of all_gather and reduce_scatter whose input (every part of it) is at most
16 KiB (``MOONCAKE_CUDA_DIRECT_BYTES``) run on the device-driven kernels, the larger ones
on the host-driven plane; all_to_all_single (split sizes or none) and all_to_all's list
form on the kernels at any size (parts past the segment's region in rounds); then the ops
the kernels took eagerly under a
watch, or not at all, are captured in a graph and replayed, so that both paths of every
op are exercised. Each output starts as garbage (NaN, or a sentinel for integers) and is checked against a reference
computed here from every rank's inputs, which each rank can regenerate (small integers, so
that any summation order is exact). Each op's path is checked too (``pg.get_op_paths``: the
device-driven kernels, the plane, or staged), so a bypassed plane or kernel fails the round.
Exits non-zero on a wrong result, a wrong path, or a rank that fails or does not finish.
scripts/gpu_check.sh runs it under memcheck and racecheck (compute-sanitizer follows the
ranks, which are its child processes).
"""

from __future__ import annotations

import os
import sys
import zlib

import torch
import torch.distributed as dist

import capture
from round_ranks import round_main

R = dist.ReduceOp
#: (dtype, op) pairs of the all_reduce sweep; AVG takes inputs that are multiples of world.
SWEEP = (
    (torch.float32, R.SUM),
    (torch.bfloat16, R.AVG),
    (torch.int64, R.MAX),
    (torch.float16, R.MIN),
    (torch.int32, R.PRODUCT),
)
SIZES = (1, 7, 1001, 70_000)
ROUND_TIMEOUT_S = 200
#: MOONCAKE_CUDA_DIRECT_BYTES of the round: the largest input (every part of it) the
#: device-driven kernels take.
DIRECT_BYTES = 16 << 10


def kernel(nbytes: int) -> str:
    """The eager path of an op the device-driven kernels take eagerly (all_reduce,
    all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single without split sizes,
    the coalesced forms, the rooted ops, all_gather and reduce_scatter) whose input (every
    part of it) is ``nbytes``."""
    return "direct" if nbytes <= DIRECT_BYTES else "plane"


def data(rank: int, tag: str, shape, dtype, world: int) -> torch.Tensor:
    """Rank ``rank``'s input ``tag``: small integers (times world), any rank can make it."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))
    if dtype == torch.int32:  # PRODUCT: factors in {-1, 1, 2} stay exact
        return torch.tensor([-1, 1, 2], dtype=dtype)[torch.randint(0, 3, shape, generator=g)]
    return (torch.randint(-12, 13, shape, generator=g) * world).to(dtype)


def reduce_all(parts: list[torch.Tensor], op) -> torch.Tensor:
    """The reduction of ``parts``, by plain loops in float64/int64 (no torch.distributed)."""
    wide = [p.to(torch.float64 if p.is_floating_point() else torch.int64) for p in parts]
    acc = wide[0].clone()
    for p in wide[1:]:
        if op in (R.SUM, R.AVG):
            acc += p
        elif op == R.PRODUCT:
            acc *= p
        elif op == R.MAX:
            acc = torch.maximum(acc, p)
        else:
            acc = torch.minimum(acc, p)
    if op == R.AVG:
        acc /= len(parts)
    return acc.to(parts[0].dtype)


def garbage(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="cuda")
    return t.fill_(float("nan") if dtype.is_floating_point else -77)


class Round:
    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.bad = rank, world, []

    def inputs(self, tag, shape, dtype=torch.float32) -> list[torch.Tensor]:
        return [data(r, tag, shape, dtype, self.world) for r in range(self.world)]

    def same(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got.cpu(), want):
            self.bad.append(what)

    def path(self, what: str, want: str, fn, /, *args, **kwargs) -> None:
        """Runs ``fn(*args, **kwargs)`` (one collective) and checks which path served it:
        ``want`` is "direct" (the device-driven kernels: one device op, a direct op per
        tensor), "plane" (the host-driven device plane) or "staged"."""
        from mooncake import pg

        before = pg.get_op_paths()
        fn(*args, **kwargs)
        torch.cuda.synchronize()
        after = pg.get_op_paths()
        got = {k: after[k] - before[k] for k in ("device", "staged", "direct")}
        ok = {
            "direct": got["device"] == 1 and got["staged"] == 0 and got["direct"] > 0,
            "plane": got == {"device": 1, "staged": 0, "direct": 0},
            "staged": got == {"device": 0, "staged": 1, "direct": 0},
        }[want]
        if not ok:
            self.bad.append(f"{what}: served {got}, wanted {want}")

    def plane_ops(self) -> None:
        me, world = self.rank, self.world
        for dtype, op in SWEEP:
            for n in SIZES:
                xs = self.inputs(f"ar{dtype}{n}", (n,), dtype)
                x = xs[me].cuda()
                want = kernel(x.nbytes)
                self.path(f"all_reduce {dtype} {op} n{n}", want, dist.all_reduce, x, op)
                self.same(f"all_reduce {dtype} {op} n{n}", x, reduce_all(xs, op))
        for src in range(world):
            xs = self.inputs(f"bc{src}", (3001,))
            x = xs[me].cuda() if me == src else garbage((3001,), torch.float32)
            self.path(f"broadcast from {src}", kernel(x.nbytes), dist.broadcast, x, src)
            self.same(f"broadcast from {src}", x, xs[src])
        n = 2003
        xs = self.inputs("ag", (n,), torch.bfloat16)
        out = garbage((world * n,), torch.bfloat16)
        self.path(
            "all_gather_into_tensor",
            kernel(n * 2),
            dist.all_gather_into_tensor,
            out,
            xs[me].cuda(),
        )
        self.same("all_gather_into_tensor", out, torch.cat(xs))
        outs = [garbage((n,), torch.bfloat16) for _ in range(world)]
        self.path("all_gather", kernel(n * 2), dist.all_gather, outs, xs[me].cuda())
        for r in range(world):
            self.same(f"all_gather [{r}]", outs[r], xs[r])
        for op in (R.SUM, R.MAX):
            xs = self.inputs(f"rs{op}", (world * n,))
            out = garbage((n,), torch.float32)
            self.path(
                f"reduce_scatter_tensor {op}",
                kernel(world * n * 4),
                dist.reduce_scatter_tensor,
                out,
                xs[me].cuda(),
                op,
            )
            self.same(
                f"reduce_scatter_tensor {op}",
                out,
                reduce_all([x[me * n : (me + 1) * n] for x in xs], op),
            )
        lists = [self.inputs(f"rsl{r}", (n,), torch.int64) for r in range(world)]  # [dst][src]
        out = garbage((n,), torch.int64)
        self.path(
            "reduce_scatter",
            kernel(world * n * 8),
            dist.reduce_scatter,
            out,
            [lists[r][me].cuda() for r in range(world)],
        )
        self.same("reduce_scatter", out, reduce_all(lists[me], R.SUM))
        self.all_to_all()

    def all_to_all(self) -> None:
        """all_to_all_single with even and uneven splits, and the list form."""
        me, world = self.rank, self.world
        # rank s sends rank d (s + 2d + 1) rows of 5: uneven, and every edge differs.
        rows = [[s + 2 * d + 1 for d in range(world)] for s in range(world)]
        xs = [data(s, "a2a", (sum(rows[s]), 5), torch.float32, world) for s in range(world)]
        recv = [rows[s][me] for s in range(world)]
        out = garbage((sum(recv), 5), torch.float32)
        self.path(
            "all_to_all_single uneven",
            "direct",
            dist.all_to_all_single,
            out,
            xs[me].cuda(),
            recv,
            rows[me],
        )
        want = [xs[s][sum(rows[s][:me]) : sum(rows[s][: me + 1])] for s in range(world)]
        self.same("all_to_all_single uneven", out, torch.cat(want))
        k = 64
        xs = self.inputs("a2a_even", (world * k,), torch.float16)
        out = garbage((world * k,), torch.float16)
        self.path("all_to_all_single even", "direct", dist.all_to_all_single, out, xs[me].cuda())
        self.same("all_to_all_single even", out, torch.cat([x[me * k : (me + 1) * k] for x in xs]))
        ins = [data(me, f"a2al{d}", (d + 3,), torch.int32, world).cuda() for d in range(world)]
        outs = [garbage((me + 3,), torch.int32) for _ in range(world)]
        self.path("all_to_all", "direct", dist.all_to_all, outs, ins)
        for s in range(world):
            self.same(
                f"all_to_all from {s}", outs[s], data(s, f"a2al{me}", (me + 3,), torch.int32, world)
            )
        # Parts past the segment's region per rank (32 KiB at 2 ranks, 16 at 4): several
        # rounds, parts of every size (rank s sends rank d (s + d + 1) * 20000 + 7 int8).
        sizes = [[(s + d + 1) * 20000 + 7 for d in range(world)] for s in range(world)]
        xs = [data(s, "a2a_rounds", (sum(sizes[s]),), torch.int8, world) for s in range(world)]
        recv = [sizes[s][me] for s in range(world)]
        out = garbage((sum(recv),), torch.int8)
        self.path(
            "all_to_all_single in rounds",
            "direct",
            dist.all_to_all_single,
            out,
            xs[me].cuda(),
            recv,
            sizes[me],
        )
        want = [xs[s][sum(sizes[s][:me]) : sum(sizes[s][: me + 1])] for s in range(world)]
        self.same("all_to_all_single in rounds", out, torch.cat(want))

    def rooted_ops(self) -> None:
        me, world = self.rank, self.world
        xs = self.inputs("red", (999,))
        x = xs[me].cuda()
        self.path("reduce", kernel(x.nbytes), dist.reduce, x, dst=world - 1)
        if me == world - 1:
            self.same("reduce", x, reduce_all(xs, R.SUM))
        xs = self.inputs("ga", (500,))
        parts = [garbage((500,), torch.float32) for _ in range(world)] if me == 0 else None
        self.path("gather", kernel(500 * 4), dist.gather, xs[me].cuda(), parts, dst=0)
        if me == 0:
            for r in range(world):
                self.same(f"gather [{r}]", parts[r], xs[r])
        chunks = self.inputs("sc", (300,))
        out = garbage((300,), torch.float32)
        src_list = [c.cuda() for c in chunks] if me == 0 else None
        self.path("scatter", kernel(world * 300 * 4), dist.scatter, out, src_list, src=0)
        self.same("scatter", out, chunks[me])
        nxt, prv = (me + 1) % world, (me - 1) % world
        mine = data(me, "p2p", (4097,), torch.int64, world).cuda()
        buf = garbage((4097,), torch.int64)
        works = [dist.irecv(buf, prv), dist.isend(mine, nxt)]
        for w in works:
            w.wait()
        self.same("isend/irecv", buf, data(prv, "p2p", (4097,), torch.int64, world))
        xs = [self.inputs(f"co{i}", (64 + i,), torch.float64) for i in range(3)]
        ys = [x[me].cuda() for x in xs]
        want = kernel(max(y.nbytes for y in ys))
        self.path("all_reduce_coalesced", want, dist.all_reduce_coalesced, ys, op=R.MAX)
        for i, y in enumerate(ys):
            self.same(f"all_reduce_coalesced [{i}]", y, reduce_all(xs[i], R.MAX))

    def captured_ops(self) -> None:
        """The ops the device-driven kernels take under CUDA graph capture (eagerly they
        took the kernels watched, or the plane, above): broadcast from 0, reduce to the last rank, gather to 0,
        scatter from the last rank, all_gather, reduce_scatter, all_to_all and
        all_to_all_single with equal split sizes, captured in one graph (each counted once
        on the kernels) and replayed once into outputs refilled with garbage."""
        from mooncake import pg

        me, world, last, n = self.rank, self.world, self.world - 1, 300
        f32 = torch.float32
        xs = {k: self.inputs(f"cap_{k}", (n,)) for k in ("bc", "rd", "ga", "ag")}
        sc = [self.inputs(f"cap_sc{j}", (n,)) for j in range(world)]  # [dst][src]
        rs = [self.inputs(f"cap_rs{d}", (n,)) for d in range(world)]  # [dst][src]
        a2 = [self.inputs(f"cap_a2{d}", (n,)) for d in range(world)]  # [dst][src]
        a2s = self.inputs("cap_a2s", (world * n,))
        bc = xs["bc"][me].cuda()
        rd, ga, ag = (xs[k][me].cuda() for k in ("rd", "ga", "ag"))
        sc_in = [sc[j][me].cuda() for j in range(world)] if me == last else None
        rs_in = [rs[d][me].cuda() for d in range(world)]
        a2_in = [a2[d][me].cuda() for d in range(world)]
        a2s_in = a2s[me].cuda()
        outs = {
            "ga": [garbage((n,), f32) for _ in range(world)] if me == 0 else None,
            "sc": garbage((n,), f32),
            "ag": [garbage((n,), f32) for _ in range(world)],
            "rs": garbage((n,), f32),
            "a2": [garbage((n,), f32) for _ in range(world)],
            "a2s": garbage((world * n,), f32),
        }
        written = [
            t for v in outs.values() if v is not None for t in (v if isinstance(v, list) else [v])
        ]
        graph = torch.cuda.CUDAGraph()
        before = pg.get_op_paths()
        with capture.graph(graph):
            b = bc.clone() if me == 0 else garbage((n,), f32)
            dist.broadcast(b, 0)
            r = rd.clone()
            dist.reduce(r, dst=last)
            dist.gather(ga, outs["ga"], dst=0)
            dist.scatter(outs["sc"], sc_in, src=last)
            dist.all_gather(outs["ag"], ag)
            dist.reduce_scatter(outs["rs"], rs_in)
            dist.all_to_all(outs["a2"], a2_in)
            dist.all_to_all_single(outs["a2s"], a2s_in, [n] * world, [n] * world)
        torch.cuda.synchronize()
        after = pg.get_op_paths()
        got = {k: after[k] - before[k] for k in ("device", "staged", "direct")}
        if got != {"device": 8, "staged": 0, "direct": 8}:
            self.bad.append(f"captured ops: served {got}, wanted 8 on the kernels")
        for t in written:
            t.copy_(garbage(t.shape, t.dtype))
        graph.replay()
        torch.cuda.synchronize()
        self.same("captured broadcast", b, xs["bc"][0])
        if me == last:
            self.same("captured reduce", r, reduce_all(xs["rd"], R.SUM))
        for q, t in enumerate(outs["ga"] or []):
            self.same(f"captured gather [{q}]", t, xs["ga"][q])
        self.same("captured scatter", outs["sc"], sc[me][last])
        for q, t in enumerate(outs["ag"]):
            self.same(f"captured all_gather [{q}]", t, xs["ag"][q])
        self.same("captured reduce_scatter", outs["rs"], reduce_all(rs[me], R.SUM))
        for q, t in enumerate(outs["a2"]):
            self.same(f"captured all_to_all [{q}]", t, a2[me][q])
        want = torch.cat([x[me * n : (me + 1) * n] for x in a2s])
        self.same("captured all_to_all_single", outs["a2s"], want)


def replay_through_a_kill(rank: int, world: int, port: int, victim: int) -> dict:
    """Rank side of test_cuda_backend.test_graph_replay_masks_a_killed_rank (a
    ``mooncake.launch.LocalGroup`` process): a 4 KiB all_reduce captured in a CUDA graph,
    replayed with rank r contributing (r + 1) * (k + 1) at replay k; after replay 2 and a
    barrier, ``victim`` launches replay 3 and kills itself (SIGKILL) without waiting for
    it. The survivors return what each replay gave, how long the replays after the kill
    took, their CUDA active_ranks, an eager all_reduce's value, and after a barrier (an op
    on the host, which finds the victim gone) the members' count, an eager all_reduce
    (set up again among them) and one more replay."""
    import signal
    import time

    from mooncake import pg
    from mooncake.launch import init_rank

    active = init_rank(rank, world, port, "mooncake", timeout_s=60)
    n = 1024
    x = torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the eager call that sets the path up
        dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture.graph(graph):
        dist.all_reduce(x)

    def replay(k: int) -> list[float]:
        x.fill_(float((rank + 1) * (k + 1)))
        graph.replay()
        return sorted(set(x.cpu().tolist()))

    out: dict = {"before": [replay(k) for k in range(3)]}
    dist.barrier()
    if rank == victim:
        x.fill_(float((rank + 1) * 4))
        graph.replay()
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    out["racing"] = replay(3)
    out["racing_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    out["after"] = [replay(k) for k in range(4, 7)]
    out["after_s"] = time.monotonic() - t0
    out["active"] = active.cpu().tolist()
    y = torch.full((n,), float(rank + 1), device="cuda")
    dist.all_reduce(y)
    out["eager"] = sorted(set(y.cpu().tolist()))
    dist.barrier()  # on the host: finds the victim gone, and the survivors agree
    out["synced"] = pg.get_num_synced_ranks()
    y = torch.full((n,), float(rank + 1), device="cuda")
    dist.all_reduce(y)
    out["eager_after_view"] = sorted(set(y.cpu().tolist()))
    out["replay_after_view"] = replay(7)
    out["paths"] = pg.get_op_paths()
    dist.destroy_process_group()
    return out


def rank_main(rank: int, world: int, port: int) -> int:
    os.environ["MOONCAKE_CUDA_PLANE_MIN_BYTES"] = "0"
    os.environ["MOONCAKE_CUDA_SEGMENT_BYTES"] = str(64 << 10)
    os.environ["MOONCAKE_CUDA_DIRECT"] = "auto"
    os.environ["MOONCAKE_CUDA_DIRECT_BYTES"] = str(DIRECT_BYTES)
    from mooncake import pg

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    active = torch.ones(world, dtype=torch.int32, device="cuda")
    dist.init_process_group(
        "mooncake",
        store=store,
        rank=rank,
        world_size=world,
        pg_options=pg.MooncakeBackendOptions(active),
    )
    r = Round(rank, world)
    r.plane_ops()
    r.rooted_ops()
    r.captured_ops()
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    print(f"cuda_backend_round rank {rank}/{world}:", "ok" if not r.bad else f"wrong: {r.bad}")
    return 1 if r.bad else 0


def main() -> int:
    return round_main(__file__, __doc__, "cuda_backend_round", rank_main, ROUND_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main())
