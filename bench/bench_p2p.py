#!/usr/bin/env python3
"""Point-to-point time of the CPU backends: blocking send/recv between two ranks.

For each backend (``mooncake-cpu``, gloo) and size, two patterns on one group of
``--world`` ranks on this host:

* ``pingpong``: rank 0 sends rank 1 a tensor and receives it back (the other ranks
  wait); a message's time is half a round trip;
* ``ring``: every rank sends its successor and receives from its predecessor (even
  ranks send first), the pattern of a pipeline's stage-to-stage hand-off; a step's
  time is the slowest rank's.

Beside them, the same group's ``all_reduce`` of the same bytes: a message should not
cost more than a collective that moves as much. Per point the fastest of ``--repeats``
loops (each loop timed on every rank, the slowest rank's mean), as bench_pg.py reports.

    python bench/bench_p2p.py [--world 2] [--sizes 8,4K,64K,1M,16M] [--quick]
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta

import harness

SIZES = (8, 4 << 10, 64 << 10, 1 << 20, 16 << 20)
QUICK_SIZES = (8, 4 << 10, 1 << 20)
BACKENDS = ("mooncake-cpu", "gloo")
PATTERNS = ("pingpong", "ring", "all_reduce")


def step_of(pattern: str, t, rank: int, world: int):
    """One step of ``pattern`` on tensor ``t``; None where this rank takes no part."""
    import torch.distributed as dist

    if pattern == "all_reduce":
        return lambda: dist.all_reduce(t)
    if pattern == "pingpong":
        if rank == 0:
            return lambda: (dist.send(t, 1), dist.recv(t, 1))
        if rank == 1:
            return lambda: (dist.recv(t, 0), dist.send(t, 0))
        return None
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        return lambda: (dist.send(t, nxt), dist.recv(t, prv))
    return lambda: (dist.recv(t, prv), dist.send(t, nxt))


def run_rank(rank: int, world: int, port: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if cfg["backend"].startswith("mooncake"):
        from mooncake import pg  # noqa: F401  (registers the backend)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # fmt: skip
    points = []
    for nbytes in cfg["sizes"]:
        t = torch.zeros(max(1, nbytes // 4))
        for pattern in PATTERNS:
            step = step_of(pattern, t, rank, world) or (lambda: None)
            dist.barrier()
            step()  # first touch
            # Calls per loop: as many as fit in point_seconds at the slowest rank's pace.
            calls = harness.calls_in_budget(
                harness.mean_seconds(step, cfg["warmup"]), cfg, torch.float64
            )
            loops = []
            for _ in range(cfg["repeats"]):
                dist.barrier()
                took = harness.mean_seconds(step, calls)
                loops.append(harness.rank_max(took, torch.float64) * 1e6)  # the slowest rank's
            # A ping-pong step carries two messages; a ring step one per rank, in turn.
            per = 2 if pattern == "pingpong" else 1
            points.append({"bytes": 4 * t.numel(), "pattern": pattern,
                           "us": min(loops) / per, "loops_us": loops, "calls": calls})  # fmt: skip
        harness.publish(store, f"result/{rank}", points)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks (at least 2)")
    p.add_argument("--sizes", default="", help="comma-separated bytes (K/M suffixes)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--repeats", type=int, default=3, help="timed loops per point")
    p.add_argument("--point-s", type=float, default=0.3, help="seconds a loop aims at")
    p.add_argument("--quick", action="store_true", help="three sizes, shorter loops")
    p.add_argument("--out", default=str(harness.RESULTS / "p2p.json"))
    args = p.parse_args(argv)
    if args.world < 2:
        p.error("--world must be at least 2")
    sizes = [harness.parse_bytes(s) for s in args.sizes.split(",")] if args.sizes else list(
        QUICK_SIZES if args.quick else SIZES)  # fmt: skip
    cfg = {"sizes": sizes, "repeats": args.repeats, "warmup": 20, "min_iters": 5,
           "max_iters": 5000, "point_seconds": 0.1 if args.quick else args.point_s}  # fmt: skip
    harness.say_host(f"bench_p2p: send/recv at world {args.world}", os.cpu_count() or 1,
                     os.getloadavg())  # fmt: skip
    results = {}
    for backend in args.backends.split(","):
        run = harness.launch(args.world, run_rank, (dict(cfg, backend=backend),),
                             env={"OMP_NUM_THREADS": "1"}, timeout_s=600)  # fmt: skip
        if run.error:
            harness.log(f"{backend}: {run.error}")
            return 1
        results[backend] = {(q["bytes"], q["pattern"]): q for q in run.per_rank("result", [])[0]}
    header = ["bytes", "pattern"]
    for b in results:
        header += [f"{b} µs"]
    header += [f"{b} / its all_reduce" for b in results]
    if "gloo" in results and "mooncake-cpu" in results:
        header += ["mooncake-cpu / gloo"]
    rows = []
    for nbytes in sorted({k[0] for r in results.values() for k in r}):
        for pattern in ("pingpong", "ring"):
            row = [harness.fmt_bytes(nbytes), pattern]
            row += [harness.fmt_fixed(r[(nbytes, pattern)]["us"], 100) for r in results.values()]
            row += [harness.fmt_ratio(r[(nbytes, pattern)]["us"] / r[(nbytes, "all_reduce")]["us"])
                    for r in results.values()]  # fmt: skip
            if len(row) < len(header):
                m, g = results["mooncake-cpu"], results["gloo"]
                row.append(
                    harness.fmt_ratio(m[(nbytes, pattern)]["us"] / g[(nbytes, pattern)]["us"])
                )
            rows.append(row)
    for line in harness.markdown_table(header, rows):
        harness.say(line)
    harness.say("(pingpong: µs per message, half a round trip; ring: µs per step, every rank "
                "sending its successor; all_reduce of the same bytes beside them)")  # fmt: skip
    out = {b: [dict(v) for v in r.values()] for b, r in results.items()}
    harness.write_json(args.out, {"world": args.world, "points": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
