"""How fast could a large ``all_reduce`` be that reads its peers' tensors where they lie?

Before anyone writes the kernel (issue: the CUDA backend's 64 MiB ``all_reduce`` at 50% of
the floor-bound rate at world 2), this measures the data movement of each candidate
algorithm alone, with torch's own copy and add kernels (near the memory's rate), on one
GPU shared by ``--world`` processes that map each other's tensors through CUDA IPC. Each
phase starts on every process at once (a host barrier, left out of the times), so under
MPS their kernels run side by side as a collective's would. What it leaves out is what the
kernel adds: its signal rounds, the launch, the host's call.

Bytes each process moves, for an ``all_reduce`` of ``N`` bytes among ``R``:

- ``floor``: a copy of ``N`` into another tensor: read ``N``, write ``N`` (the rate the
  README's percentages are of);
- ``plane``: today's eager path past the device-driven bound: the input copied into the
  segment, then every segment read and the sum written: ``(3 + R) N``;
- ``pull``: each process sums its ``1/R`` share from every input in place into its own
  area, then every process copies each share from its owner's area: ``3N + N/R``; the
  inputs are untouched until every share is ready, so a failure can fall back to a
  re-run;
- ``inplace``: the share summed into the owner's own tensor, and the others copy it from
  there: ``2N + N/R``... for ``R = 2``, ``2.5N``; a rank dying mid-op loses its share's
  inputs.

    python3 bench/mapped_ceiling.py [--world 2] [--mib 64] [--iters 20] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

VARIANTS = ("floor", "plane", "pull", "inplace")


def _phases(name: str, me: int, R: int, t, seg, area, peers, out):
    """The phases of one variant (callables, each a step every process makes at once)."""
    n = t.numel()
    per = n // R
    s = slice(me * per, (me + 1) * per)

    def sl(p):
        return slice(p * per, (p + 1) * per)

    if name == "floor":
        return [lambda: out.copy_(t)]
    if name == "plane":

        def reduce_all():
            torch.add(seg, peers[(me + 1) % R][1], out=out)
            for k in range(2, R):
                out.add_(peers[(me + k) % R][1])

        return [lambda: seg.copy_(t), reduce_all]
    if name == "pull":

        def share():
            torch.add(t[s], peers[(me + 1) % R][0][s], out=area)
            for k in range(2, R):
                area.add_(peers[(me + k) % R][0][s])

        def gather():
            for p in range(R):
                src = area if p == me else peers[p][2]
                t[sl(p)].copy_(src)

        return [share, gather]
    if name == "inplace":

        def share_in_place():
            for k in range(1, R):
                t[s].add_(peers[(me + k) % R][0][s])

        def gather_in_place():
            for p in range(R):
                if p != me:
                    t[sl(p)].copy_(peers[p][0][sl(p)])

        return [share_in_place, gather_in_place]
    raise ValueError(name)


def _rank(me: int, R: int, elems: int, iters: int, device: str, queues, barrier, results) -> None:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    t = torch.ones(elems, device=device, dtype=torch.bfloat16)
    seg = torch.empty_like(t)
    area = torch.empty(elems // R, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(t)
    for p in range(R):
        if p != me:
            queues[p].put((me, t, seg, area))
    peers = {}
    for _ in range(R - 1):
        p, pt, pseg, parea = queues[me].get()
        peers[p] = (pt, pseg, parea)
    peers[me] = (t, seg, area)
    if cuda:
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    mine = {}
    for name in VARIANTS:
        phases = _phases(name, me, R, t, seg, area, peers, out)
        # One round on fresh inputs first: every variant must compute the all_reduce.
        barrier.wait()
        t.fill_(me + 1)
        for phase in phases:
            barrier.wait()
            phase()
            if cuda:
                torch.cuda.synchronize()
        got = (out if name in ("floor", "plane") else t).float()
        want = me + 1 if name == "floor" else R * (R + 1) // 2
        if not bool((got == want).all()):
            raise SystemExit(f"rank {me}: {name} computed {got.unique().tolist()}, want {want}")
        barrier.wait()
        totals = []
        for it in range(iters + 2):
            total = 0.0
            for phase in phases:
                barrier.wait()
                if cuda:
                    e0.record()
                    phase()
                    e1.record()
                    e1.synchronize()
                    total += e0.elapsed_time(e1) * 1000.0
                else:  # a dry run of the script itself
                    t0 = time.perf_counter()
                    phase()
                    total += (time.perf_counter() - t0) * 1e6
            if it >= 2:  # two warm-up rounds
                totals.append(total)
        mine[name] = totals
    results.put((me, mine))
    barrier.wait()  # the peers' mappings of this rank's tensors are done with


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run")
    a = ap.parse_args()
    R = a.world
    elems = a.mib * (1 << 20) // 2 // R * R
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(R)]
    barrier = ctx.Barrier(R)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, R, elems, a.iters, a.device, queues, barrier, results))
        for r in range(R)
    ]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in range(R))
    for p in procs:
        p.join(timeout=60)
    # Each round's time is the slowest process's (a collective ends with its last rank).
    rows = {}
    for name in VARIANTS:
        per_round = [max(got[r][name][i] for r in range(R)) for i in range(a.iters)]
        rows[name] = statistics.median(per_round)
    floor = rows["floor"]
    print(f"world {R}, {a.mib} MiB bf16 per process, median of {a.iters} (slowest process):")
    for name in VARIANTS:
        print(
            f"  {name:8s} {rows[name]:9.1f} us   {floor / rows[name] * 100:5.1f}% of the floor's rate"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"world": R, "mib": a.mib, "iters": a.iters, "us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
