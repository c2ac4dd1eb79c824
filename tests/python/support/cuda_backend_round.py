"""A round of the ``mooncake`` backend on CUDA tensors at 2+ processes, for compute-sanitizer.

    cuda_backend_round.py [--world N]     (default 2; starts N ranks on the one GPU)

Every op the device plane serves, on inputs that take it (``MOONCAKE_CUDA_PLANE_MIN_BYTES=0``)
through a 64 KiB segment (``MOONCAKE_CUDA_SEGMENT_BYTES``), so that the larger ones move
through it in pieces, and isend/irecv (staged) beside them. Each
output starts as garbage (NaN, or a sentinel for integers) and is checked against a reference
computed here from every rank's inputs, which each rank can regenerate (small integers, so
that any summation order is exact). Each op's path is checked too (``pg.get_op_paths``: the
plane ops on the plane, the rest staged), so a bypassed plane fails the round. Exits non-zero
on a wrong result, a wrong path, or a rank that fails or does not finish.
scripts/gpu_check.sh runs it under memcheck and racecheck (compute-sanitizer follows the
ranks, which are its child processes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zlib

import torch
import torch.distributed as dist

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
        """Runs ``fn(*args, **kwargs)`` (one collective) and checks which path served it."""
        from mooncake import pg

        before = pg.get_op_paths()
        fn(*args, **kwargs)
        torch.cuda.synchronize()
        after = pg.get_op_paths()
        got = {k: after[k] - before[k] for k in ("device", "staged")}
        if got != {"device": int(want == "device"), "staged": int(want == "staged")}:
            self.bad.append(f"{what}: served {got}, wanted {want}")

    def plane_ops(self) -> None:
        me, world = self.rank, self.world
        for dtype, op in SWEEP:
            for n in SIZES:
                xs = self.inputs(f"ar{dtype}{n}", (n,), dtype)
                x = xs[me].cuda()
                self.path(f"all_reduce {dtype} {op} n{n}", "device", dist.all_reduce, x, op)
                self.same(f"all_reduce {dtype} {op} n{n}", x, reduce_all(xs, op))
        for src in range(world):
            xs = self.inputs(f"bc{src}", (3001,))
            x = xs[me].cuda() if me == src else garbage((3001,), torch.float32)
            self.path(f"broadcast from {src}", "device", dist.broadcast, x, src)
            self.same(f"broadcast from {src}", x, xs[src])
        n = 2003
        xs = self.inputs("ag", (n,), torch.bfloat16)
        out = garbage((world * n,), torch.bfloat16)
        self.path(
            "all_gather_into_tensor",
            "device",
            dist.all_gather_into_tensor,
            out,
            xs[me].cuda(),
        )
        self.same("all_gather_into_tensor", out, torch.cat(xs))
        outs = [garbage((n,), torch.bfloat16) for _ in range(world)]
        self.path("all_gather", "device", dist.all_gather, outs, xs[me].cuda())
        for r in range(world):
            self.same(f"all_gather [{r}]", outs[r], xs[r])
        for op in (R.SUM, R.MAX):
            xs = self.inputs(f"rs{op}", (world * n,))
            out = garbage((n,), torch.float32)
            self.path(
                f"reduce_scatter_tensor {op}",
                "device",
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
            "device",
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
            "device",
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
        self.path("all_to_all_single even", "device", dist.all_to_all_single, out, xs[me].cuda())
        self.same("all_to_all_single even", out, torch.cat([x[me * k : (me + 1) * k] for x in xs]))
        ins = [data(me, f"a2al{d}", (d + 3,), torch.int32, world).cuda() for d in range(world)]
        outs = [garbage((me + 3,), torch.int32) for _ in range(world)]
        self.path("all_to_all", "device", dist.all_to_all, outs, ins)
        for s in range(world):
            self.same(
                f"all_to_all from {s}", outs[s], data(s, f"a2al{me}", (me + 3,), torch.int32, world)
            )

    def rooted_ops(self) -> None:
        me, world = self.rank, self.world
        xs = self.inputs("red", (999,))
        x = xs[me].cuda()
        self.path("reduce", "device", dist.reduce, x, dst=world - 1)
        if me == world - 1:
            self.same("reduce", x, reduce_all(xs, R.SUM))
        xs = self.inputs("ga", (500,))
        parts = [garbage((500,), torch.float32) for _ in range(world)] if me == 0 else None
        self.path("gather", "device", dist.gather, xs[me].cuda(), parts, dst=0)
        if me == 0:
            for r in range(world):
                self.same(f"gather [{r}]", parts[r], xs[r])
        chunks = self.inputs("sc", (300,))
        out = garbage((300,), torch.float32)
        src_list = [c.cuda() for c in chunks] if me == 0 else None
        self.path("scatter", "device", dist.scatter, out, src_list, src=0)
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
        self.path("all_reduce_coalesced", "device", dist.all_reduce_coalesced, ys, op=R.MAX)
        for i, y in enumerate(ys):
            self.same(f"all_reduce_coalesced [{i}]", y, reduce_all(xs[i], R.MAX))


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
    with torch.cuda.graph(graph):
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
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    print(f"cuda_backend_round rank {rank}/{world}:", "ok" if not r.bad else f"wrong: {r.bad}")
    return 1 if r.bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank is not None:
        return rank_main(a.rank, a.world, a.port)
    store = dist.TCPStore("127.0.0.1", 0, a.world + 1, is_master=True, wait_for_workers=False)
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--world",
                str(a.world),
                "--rank",
                str(r),
                "--port",
                str(store.port),
            ]
        )
        for r in range(a.world)
    ]
    codes = []
    for proc in ranks:
        try:
            codes.append(proc.wait(timeout=ROUND_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            codes.append("timeout")
    print("cuda_backend_round:", "ok" if all(c == 0 for c in codes) else f"rank exits {codes}")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
