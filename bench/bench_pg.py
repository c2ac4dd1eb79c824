"""nccl-tests-style benchmark of the ``mooncake-cpu`` backend against gloo, with floors.

For each world size, each backend is launched once the way torchrun does it
(``mooncake.launch``): this process hosts the ``TCPStore`` and every rank is a
spawned process that runs every op and size inside one process group. Each
point is timed as: barrier, warm-up ops, then a few timed loops of
back-to-back ops, each between barriers. A loop's time is the slowest rank's
mean; a point's is its fastest loop's (the others are kept in the JSON).

Beside every row stands a floor measured in the same run (see ``floors.py``
and ``bench/README.md``): the wake-up hand-offs the algorithm needs, and the
bytes it must copy at this host's memcpy bandwidth. Results go to
``<out-dir>/pg.json``, ``pg.png`` and ``pg_table.md``.

    .venv/bin/python bench/bench_pg.py            # the full run, about 2 minutes on 2 cores
    .venv/bin/python bench/bench_pg.py --quick    # world 4, five sizes, about a minute
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import floors
import harness
import report

HERE = Path(__file__).resolve().parent
OPS = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
)
ALIASES = {"all_gather": OPS[1], "reduce_scatter": OPS[2], "all_to_all": OPS[3]}
MOONCAKE_CPU = "mooncake-cpu"
BACKENDS = (MOONCAKE_CPU, "gloo")
# Knobs of the library the floor models depend on (defaults as in src/core/env.cc).
MOONCAKE_ENV_DEFAULTS = {
    "MOONCAKE_SMALL_MSG_BYTES": "65536",
    "MOONCAKE_CHUNK_BYTES": "262144",
    "MOONCAKE_SPIN_US": "20",
    "MOONCAKE_ASYNC_DELAY_US": "100",
}
QUICK_SIZES = (8, 4 << 10, 64 << 10, 1 << 20, 16 << 20)
# Copy rates from cache-sized to DRAM-sized (below 256 KiB the call costs more than the bytes).
COPY_SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


# --- command line ------------------------------------------------------------------


# The overhead probe that calls the backend object itself (see run_worker).
DIRECT_PROBE = "all_reduce_8B_direct"
BARE_BINARY = HERE.parent / "build" / "mooncake_latency_bench"
# Rounds of the small all_reduce beside the bare core and the hand-off ring (paired_rounds).
PAIR_ROUNDS = 5
PAIR_POINT_SECONDS = 0.1


def parse_list(text: str, allowed: tuple[str, ...], aliases: dict[str, str]) -> list[str]:
    names = [aliases.get(n.strip(), n.strip()) for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise ValueError(f"unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    return names


def sizes_between(lo: int, hi: int, factor: int) -> list[int]:
    """``hi``, ``hi / factor``, ... down to ``lo``, with ``lo`` itself, ascending."""
    sizes = {lo}
    s = hi
    while s > lo:
        sizes.add(s)
        s //= factor
    return sorted(sizes)


def build_parser() -> argparse.ArgumentParser:
    p = harness.arg_parser(
        "nccl-tests-style benchmark of mooncake-cpu against gloo, with floors measured in the "
        "same run (see bench/README.md).",
        world_sizes="2,4,8",
    )
    p.add_argument("--min-bytes", default="8", help="smallest message size (K/M/G suffixes)")
    p.add_argument("--max-bytes", default="64M", help="largest message size")
    p.add_argument("--step-factor", type=int, default=4, choices=(2, 4), help="size step")
    p.add_argument("--sizes", default="", help="explicit comma-separated sizes (overrides range)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated backends")
    harness.add_loop_args(p, "point (all its loops)", 3, 3, 1000, warmup_note=" (1 above 1 MiB)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed loops per point; the fastest is reported"
    )
    p.add_argument(
        "--no-overhead", action="store_true", help="skip the world-size-1 per-op overhead probe"
    )
    p.add_argument("--no-plot", action="store_true", help="skip pg.png")
    p.add_argument(
        "--launch-timeout", type=float, default=900, help="seconds before a launch is killed"
    )
    p.add_argument("--op-timeout", type=float, default=120, help="backend op timeout, seconds")
    p.add_argument(
        "--start-method",
        default="forkserver",
        choices=("forkserver", "spawn"),
        help="how ranks start (LocalGroup's start_method); spawn: fresh interpreters, as torchrun's",
    )
    p.add_argument(
        "--no-fresh",
        action="store_true",
        help="skip the small all_reduce with fresh interpreters beside forked ranks",
    )
    p.add_argument(
        "--no-pairs",
        action="store_true",
        help="judge the targets on floors measured apart from the ops: the bare core once "
        "after the sweep and the hand-off ring at the start (not in rounds beside the small "
        "all_reduce inside each launch), the copy floor at the start (not each rank's copy "
        "after each loop of a large op)",
    )
    harness.add_output_args(
        p, "world 4, sizes 8 B/4K/64K/1M/16M, short loops: a smoke run of about a minute"
    )
    return p


# --- one rank -----------------------------------------------------------------------


def make_op(name: str, nbytes: int, world: int):
    """The op to time, its actual size in bytes and its nccl-tests count.

    Sizes follow nccl-tests: all_gather's size is its output, reduce_scatter's
    its input, all_to_all's one rank's whole buffer; those three move whole
    elements per rank, so a size below ``4 * world`` bytes grows to it.
    """
    import torch
    import torch.distributed as dist

    elems = max(1, nbytes // 4)
    per_rank = max(1, elems // world)
    zeros = torch.zeros  # written, so every page is touched before timing
    if name == "all_reduce":
        t = zeros(elems)
        return (lambda: dist.all_reduce(t)), 4 * elems, elems
    if name == "broadcast":
        t = zeros(elems)
        return (lambda: dist.broadcast(t, src=0)), 4 * elems, elems
    if name == "all_gather_into_tensor":
        out, inp = zeros(per_rank * world), zeros(per_rank)
        return (lambda: dist.all_gather_into_tensor(out, inp)), 4 * per_rank * world, per_rank
    if name == "reduce_scatter_tensor":
        out, inp = zeros(per_rank), zeros(per_rank * world)
        return (lambda: dist.reduce_scatter_tensor(out, inp)), 4 * per_rank * world, per_rank
    if name == "all_to_all_single":
        out, inp = zeros(per_rank * world), zeros(per_rank * world)
        return (lambda: dist.all_to_all_single(out, inp)), 4 * per_rank * world, per_rank
    raise ValueError(f"unknown op {name}")


def time_point(fn, nbytes: int, cfg: dict, beside=None) -> tuple[list[float], int, dict]:
    """Mean seconds per call of ``fn`` in each timed loop, the calls per loop, and this
    rank's sleeps, preemptions and CPU time per call (see :func:`usage_now`).
    ``beside``: run as many times right after each loop, between barriers; its mean
    microseconds per call per loop go into the usage dict as ``beside_us``.

    Every rank makes the same calls: the loop length comes from the slowest
    rank's warm-up, agreed through an all_reduce(MAX). The budget of
    ``point_seconds`` (at least ``min_iters`` calls) is split into ``repeats`` loops,
    each between barriers, so that one disturbed loop on a shared host can be told
    apart.
    """
    import torch
    import torch.distributed as dist

    warmup = cfg["warmup"] if nbytes <= (1 << 20) else 1
    dist.barrier()
    fn()  # first call: first touch of buffers and peer slots
    total = harness.calls_in_budget(harness.mean_seconds(fn, warmup), cfg, torch.float64)
    # As many loops as asked whenever that many calls fit, one call each at the least:
    # a point of a few large calls is not decided by one disturbed loop.
    repeats = max(1, min(cfg["repeats"], total))
    iters = max(1, total // repeats)
    means, beside_means, usage = [], [], [0.0, 0.0, 0.0]
    if beside is not None:
        beside()  # first touch
    for _ in range(repeats):
        dist.barrier()
        before = usage_now()
        means.append(harness.mean_seconds(fn, iters))
        after = usage_now()
        usage = [u + a - b for u, a, b in zip(usage, after, before, strict=True)]
        if beside is not None:
            dist.barrier()
            beside_means.append(harness.mean_seconds(beside, iters))
    dist.barrier()
    calls = repeats * iters
    return (
        means,
        iters,
        {
            "sleeps": round(usage[0] / calls, 2),
            "preempted": round(usage[1] / calls, 2),
            "cpu_us": round(usage[2] / calls * 1e6, 2),
            **({"beside_us": us(beside_means)} if beside is not None else {}),
        },
    )


def copy_beside(copy_bytes: int):
    """One rank's share of the copy floor, done for real: ``copy_bytes`` copied by
    ``numpy.copyto``, as the floor's bandwidth is measured (see floors.py)."""
    import numpy as np

    src = np.ones(max(1, copy_bytes // 4), dtype=np.float32)
    dst = np.zeros_like(src)
    return lambda: np.copyto(dst, src)


def usage_now() -> tuple[int, int, float]:
    """This process's (voluntary, involuntary) context switches and CPU seconds so far.

    A voluntary switch is a thread going to sleep (here: waiting for a peer or
    for its own worker thread), so per op it counts the hand-offs the op took;
    CPU seconds (user + system, all threads) include time spent spinning.
    """
    voluntary = involuntary = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:  # the thread exited
            continue
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                involuntary += int(line.split()[1])
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return voluntary, involuntary, ru.ru_utime + ru.ru_stime


def us(seconds: list[float]) -> list[float]:
    return [round(s * 1e6, 3) for s in seconds]


def run_worker(rank: int, world: int, port: int, cfg: dict) -> None:
    """One rank (``mooncake.launch.LocalGroup`` runs it); its points go to the store."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # torch 2.13 steers all_gather_into_tensor/reduce_scatter_tensor users to *_single.
    warnings.filterwarnings("ignore", category=FutureWarning)
    if cfg["backend"].startswith("mooncake"):
        from mooncake import pg  # noqa: F401  (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(
        cfg["backend"],
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg["op_timeout"]),
    )
    points: list[dict] = []

    def record(point: dict) -> None:
        points.append(point)
        harness.publish(store, f"result/{rank}", points)
        if rank == 0:
            print(
                f"[{cfg['backend']} world {world}] {point['op']:<23} {point['bytes']:>10} B "
                f"{min(point['loops_us']):>11.1f} us  ({len(point['loops_us'])} x "
                f"{point['iters']} calls)",
                file=sys.stderr,
                flush=True,
            )

    # Per-op costs with no data: an all_reduce of 0 elements, and a barrier; and
    # an 8-byte all_reduce straight through the backend object, which leaves out
    # torch's Python wrapper (dist.all_reduce's checks and dispatch).
    empty, small = torch.zeros(0), torch.zeros(2)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # as dist.all_reduce(async_op=False) asks: run on the caller's thread
    probes = {
        "all_reduce_0B": lambda: dist.all_reduce(empty),
        "barrier": dist.barrier,
        DIRECT_PROBE: lambda: backend.allreduce([small], opts).wait(),
    }
    for name, fn in probes.items():
        means, iters, usage = time_point(fn, 0, cfg)
        record(
            {
                "op": name,
                "bytes": 0,
                "count": 0,
                "loops_us": us(means),
                "iters": iters,
                "usage": usage,
            }
        )
    for op in cfg["ops"]:
        for size in cfg["sizes"]:
            fn, nbytes, count = make_op(op, size, world)
            copy_bytes = cfg.get("copy_beside", {}).get(f"{op}/{nbytes}")
            beside = copy_beside(int(copy_bytes[rank])) if copy_bytes else None
            means, iters, usage = time_point(fn, nbytes, cfg, beside)
            del beside
            record(
                {
                    "op": op,
                    "bytes": nbytes,
                    "count": count,
                    "loops_us": us(means),
                    "iters": iters,
                    "usage": usage,
                }
            )
            del fn
    if cfg.get("pair_rounds") and world >= 2:
        pairs = paired_rounds(rank, world, store, cfg, probes[DIRECT_PROBE])
        harness.publish(store, f"pairs/{rank}", pairs)
    dist.destroy_process_group()


def paired_rounds(rank: int, world: int, store, cfg: dict, direct) -> list[dict]:
    """Rounds of the small all_reduce (every size in ``cfg["pair_sizes"]``, 8 bytes
    among them) through torch and the 8-byte one through the backend object, each
    round followed by its floors in the same world: the bare core and the hand-off
    ring (rank 0 runs both while the other ranks sleep in the store). Returns
    ``[{"small": {bytes: loops}, "direct": loops, "bare": us, "hop_us": us}]``, this
    rank's loop means. On this shared VM the machine's speed drifts over seconds,
    so a ratio of numbers taken minutes apart was decided by the drift; a round's
    are taken within a few seconds."""
    short = dict(cfg, point_seconds=PAIR_POINT_SECONDS)
    small = [make_op("all_reduce", n, world) for n in cfg["pair_sizes"]]
    rounds = []
    for i in range(cfg["pair_rounds"]):
        loops = {str(nbytes): us(time_point(fn, nbytes, short)[0]) for fn, nbytes, _ in small}
        obj, _, _ = time_point(direct, 0, short)
        key = f"pair_floors/{i}"
        if rank == 0:
            floors_now = {
                "bare": run_bare_core(Path(cfg["bare_binary"]), [world]).get(world),
                "hop_us": run_ring(world),
            }
            harness.publish(store, key, floors_now)
        else:
            store.wait([key])
        rounds.append({"small": loops, "direct": us(obj), **harness.store_json(store, key)})
    return rounds


def run_ring(world: int) -> float | None:
    """The hand-off floor's hop at ``world`` (µs), measured now in a fresh interpreter
    (floors.py forks its ring, which a rank with threads should not)."""
    code = f"import floors; print(floors.measure_handoff({world}, trials=5).hop_us)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=120
        )
        return float(out.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        print(f"# hand-off ring, world {world}: {e}", file=sys.stderr)
        return None


# --- the launcher ---------------------------------------------------------------------


def launch(backend: str, world: int, cfg: dict, timeout: float, start_method: str) -> dict:
    """Runs one group of ``world`` ranks; returns each rank's points and any error."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = harness.launch(
        world,
        run_worker,
        (dict(cfg, backend=backend),),
        env=env,
        timeout_s=timeout,
        start_method=start_method,
    )
    pairs = [p for p in run.per_rank("pairs") if p is not None]
    return {
        "backend": backend,
        "world": world,
        "error": run.error,
        "per_rank": run.per_rank("result", []),
        "pairs": merge_pairs(pairs) if len(pairs) == world else [],
        "wall_s": run.wall_s,
        "loadavg": run.loadavg,
    }


def copy_shares(
    model: floors.FloorModel, world: int, ops: list[str], sizes: list[int]
) -> dict[str, list[float]]:
    """ "op/bytes" -> each rank's bytes to copy beside the op (its traffic / 2), for the
    points whose targets are against the copy floor."""
    t = report.TARGETS
    return {
        f"{op}/{nbytes}": [b / 2 for b in model.traffic(op, nbytes, world)]
        for op in ops
        if op in t["large_ops"]
        for nbytes in sizes
        if nbytes >= t["large_min_bytes"]
    }


def merge(launch_result: dict) -> dict[tuple[str, int], dict]:
    """(op, bytes) -> the point: per loop, the slowest rank's mean; the fastest such loop."""
    merged: dict[tuple[str, int], dict] = {}
    ranks = launch_result["per_rank"]
    complete = min((len(points) for points in ranks), default=0)
    for i in range(complete):
        rows = [points[i] for points in ranks]
        first = rows[0]
        loops = harness.slowest([r["loops_us"] for r in rows])
        best = loops.index(min(loops))
        merged[(first["op"], first["bytes"])] = {
            "op": first["op"],
            "bytes": first["bytes"],
            "count": first["count"],
            "iters": first["iters"],
            "time_us": loops[best],
            "loops_us": loops,
            "per_rank_us": [r["loops_us"][best] for r in rows],
            # per op: sleeps and preemptions per rank (mean), CPU time of all ranks (sum)
            "sleeps_per_op": round(sum(r["usage"]["sleeps"] for r in rows) / len(rows), 2),
            "preempted_per_op": round(sum(r["usage"]["preempted"] for r in rows) / len(rows), 2),
            "cpu_us_per_op": round(sum(r["usage"]["cpu_us"] for r in rows), 1),
        }
        if all("beside_us" in r["usage"] for r in rows):
            point = merged[(first["op"], first["bytes"])]
            point["copy_beside_us"] = harness.slowest([r["usage"]["beside_us"] for r in rows])
    return merged


def merge_pairs(per_rank: list[list[dict]]) -> list[dict]:
    """Each paired round as one point: per loop the slowest rank, then the fastest loop,
    as merge() does; rounds where the bare core failed are left out."""

    def slowest_then_fastest(loops_per_rank: list[list[float]]) -> float:
        return min(harness.slowest(loops_per_rank))

    out = []
    for i, first in enumerate(per_rank[0]):
        if not first["bare"]:
            continue
        mine = [rounds[i] for rounds in per_rank]
        small = {
            int(n): slowest_then_fastest([r["small"][n] for r in mine]) for n in first["small"]
        }
        out.append(
            {
                "torch_us": small[8],
                "backend_object_us": slowest_then_fastest([r["direct"] for r in mine]),
                "bare_us": first["bare"],
                "hop_us": first["hop_us"],
                "small_us": small,
            }
        )
    return out


def measure_floors(worlds: list[int], quick: bool) -> dict:
    cores = floors.host_cores()
    print(f"# measuring floors on {cores} cores ...", file=sys.stderr, flush=True)
    copy = floors.measure_copy(COPY_SIZES, trials=3 if quick else 5)
    loop_us = floors.loop_overhead_us()
    rings = sorted({w for w in worlds if w >= 2})
    handoff = {
        n: floors.measure_handoff(n, trials=5 if quick else 15, loop_us=loop_us) for n in rings
    }
    return {"cores": cores, "copy": copy, "handoff": handoff}


def torch_layer(points: dict) -> float | None:
    """torch's own part of an op through ``dist`` (its Python wrapper and dispatcher)
    as it runs in these ranks: the 8-byte all_reduce through ``dist.all_reduce``
    minus the same op through the backend object; None unless both were run."""
    through, direct = points.get(("all_reduce", 8)), points.get((DIRECT_PROBE, 0))
    if not through or not direct:
        return None
    return max(0.0, through["time_us"] - direct["time_us"])


def fresh_interpreters(
    worlds: list[int], sizes: list[int], cfg: dict, timeout: float
) -> dict[int, dict]:
    """The small all_reduce through torch once more, with every rank a fresh
    interpreter (as torchrun starts them) rather than forked from one process:
    world -> {"all_reduce_us": {bytes: us}, "backend_object_us": us}.

    Forked ranks share one address layout, and on a core that several ranks
    share, what the core learned about one rank's code (most likely its branch
    predictors, which are keyed by virtual address) still fits the next one
    after a switch; with ASLR each fresh interpreter has its own layout. World
    8 on 2 cores: about twice the CPU per op through torch (bench/README)."""
    fresh = {}
    for world in [w for w in worlds if w >= 2]:
        print(f"# launching mooncake-cpu, world {world}, fresh interpreters ...", file=sys.stderr)
        one = dict(cfg, ops=["all_reduce"], sizes=sizes)
        result = launch(MOONCAKE_CPU, world, one, timeout, "spawn")
        if result["error"]:
            print(f"# fresh interpreters, world {world}: {result['error']}", file=sys.stderr)
        merged = merge(result)
        direct = merged.get((DIRECT_PROBE, 0))
        fresh[world] = {
            "all_reduce_us": {
                nbytes: p["time_us"] for (op, nbytes), p in merged.items() if op == "all_reduce"
            },
            "backend_object_us": direct["time_us"] if direct else None,
        }
    return fresh


def run_bare_core(binary: Path, worlds: list[int]) -> dict[int, float]:
    """world -> the bare core's µs per 8-byte all_reduce (worlds where it failed left out)."""
    try:
        out = subprocess.run(
            [str(binary), *map(str, worlds)], capture_output=True, text=True, timeout=600
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        print(f"# bare core: {e}", file=sys.stderr)
        return {}
    bare = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and cells[0].isdigit():
            try:
                bare[int(cells[0])] = float(cells[1])
            except ValueError:
                pass  # "failed"
    return bare


def paired_point(world: int, rounds: list[dict], sweep_layer: float | None) -> dict:
    """One world's row of bare_core from its rounds: medians of the figures and of
    the per-round ratios. torch's layer is each round's through torch - through the
    backend object (the sweep's when a round lacks the backend object). A do-nothing
    backend through torch: its hand-offs plus torch's layer; the bare core does
    those hand-offs for real, and at 4 ranks per core in less than the Python ring's
    floor (which leaves a core idle): the lower of the two counts. A round's
    ``floor_us`` is the 8-byte op's floor (hand-off or copy) beside it, if known."""
    layers, nothing, nothing_ratios = [], [], []
    for p in rounds:
        direct = p["backend_object_us"]
        layer = sweep_layer if direct is None else max(0.0, p["torch_us"] - direct)
        layers.append(layer)
        if p.get("floor_us") is not None and layer is not None:
            nothing.append(min(p["floor_us"], p["bare_us"]) + layer)
            nothing_ratios.append(nothing[-1] / p["bare_us"])
    has_direct = all(p["backend_object_us"] is not None for p in rounds)
    return {
        "world": world,
        "torch_us": harness.median([p["torch_us"] for p in rounds]),
        "backend_object_us": harness.median([p["backend_object_us"] for p in rounds]),
        "bare_us": harness.median([p["bare_us"] for p in rounds]),
        "ratio": harness.median([p["torch_us"] / p["bare_us"] for p in rounds]),
        "backend_object_ratio": harness.median(
            [p["backend_object_us"] / p["bare_us"] for p in rounds]
        )
        if has_direct
        else None,
        "torch_layer_us": harness.median(layers),
        "do_nothing_us": harness.median(nothing),
        "do_nothing_ratio": harness.median(nothing_ratios),
        "rounds": rounds,
        "fresh_torch_us": None,
        "fresh_backend_object_us": None,
        "fresh_ratio": None,
    }


def round_floor_us(model: floors.FloorModel, nbytes: int, world: int, hop: float) -> float:
    """An all_reduce's floor (hand-off or copy) with the ring's hop of one round."""
    hand = model.handoff_us("all_reduce", nbytes, world, hop=hop)
    return max(hand, model.copy_us("all_reduce", nbytes, world))


def small_against_floors(model: floors.FloorModel, world: int, rounds: list[dict]) -> dict:
    """bytes -> the small all_reduce against its hand-off floor and its torch floor
    (floor + torch's layer), each the median over rounds of the ratio within a round
    (the ring's hop and torch's layer measured in that round); {} without rounds
    that measured the ring."""
    usable = [p for p in rounds if p.get("hop_us") and p.get("small_us")]
    out = {}
    for nbytes in usable[0]["small_us"] if usable else ():
        vs_hand, vs_torch, nothing = [], [], []
        for p in usable:
            hand = model.handoff_us("all_reduce", nbytes, world, hop=p["hop_us"])
            floor = round_floor_us(model, nbytes, world, p["hop_us"])
            layer = max(0.0, p["torch_us"] - p["backend_object_us"])
            vs_hand.append(p["small_us"][nbytes] / hand if hand > 0 else None)
            vs_torch.append(p["small_us"][nbytes] / (floor + layer) if floor + layer > 0 else None)
            nothing.append((floor + layer) / hand if hand > 0 else None)
        out[nbytes] = {
            "vs_handoff": harness.median(vs_hand),
            "vs_torch_floor": harness.median(vs_torch),
            "do_nothing_vs_handoff": harness.median(nothing),  # a backend that moved nothing
        }
    return out


def bare_core(
    worlds: list[int],
    rows: list[dict],
    overhead: list[dict],
    model: floors.FloorModel,
    fresh: dict[int, dict],
    paired: dict[int, list[dict]],
) -> list[dict]:
    """The smallest all_reduce through torch against the bare C++ core's (the
    mooncake_latency_bench binary, run here for the same worlds when it is built):
    what torch, Python and the backend add to a small op; between them the same op
    through the backend object (no dist.all_reduce wrapper, no dispatcher); and
    beside them torch's layer (torch_layer), which no backend saves.
    ``paired`` (world -> merge_pairs' rounds): where present, each figure and ratio
    is the median over rounds, every ratio taken within its round; elsewhere the
    bare core runs once now, beside the sweep's points.
    The bare core forks its ranks, as LocalGroup does; ``fresh`` (world -> the
    same op with fresh interpreters) is shown beside it."""
    ws = [w for w in worlds if w >= 2]
    if not BARE_BINARY.exists() or not ws:
        return []
    unpaired = [w for w in ws if not paired.get(w)]
    bare = run_bare_core(BARE_BINARY, unpaired) if unpaired else {}
    found = []
    for r in rows:
        torch_us = (r.get("mooncake-cpu") or {}).get("time_us")
        w = r["world"]
        if r["op"] != "all_reduce" or r["bytes"] != 8 or not torch_us:
            continue
        if paired.get(w):
            rounds = [
                dict(
                    p,
                    floor_us=round_floor_us(model, 8, w, p["hop_us"])
                    if p["hop_us"]
                    else r["floor"]["floor_us"],
                )
                for p in paired[w]
            ]
        elif w in bare:
            direct = [
                o["time_us"]
                for o in overhead
                if (o["probe"], o["backend"], o["world"]) == (DIRECT_PROBE, MOONCAKE_CPU, w)
            ]
            rounds = [
                {
                    "torch_us": torch_us,
                    "backend_object_us": direct[0] if direct else None,
                    "bare_us": bare[w],
                    "floor_us": r["floor"]["floor_us"],
                }
            ]
        else:
            continue
        point = paired_point(w, rounds, model.torch_layer_us(w))
        point["small"] = small_against_floors(model, w, rounds)
        torch_us, direct_us, core = point["torch_us"], point["backend_object_us"], point["bare_us"]
        layer, nothing = point["torch_layer_us"], point["do_nothing_us"]
        fresh_us = fresh.get(w, {}).get("all_reduce_us", {}).get(8)
        if fresh_us:
            point["fresh_torch_us"] = fresh_us
            point["fresh_backend_object_us"] = fresh[w]["backend_object_us"]
            point["fresh_ratio"] = fresh_us / core
        found.append(point)
        via = f", through the backend object {direct_us:.1f} us" if direct_us else ""
        print(
            f"# world {w}: 8 B all_reduce through torch {torch_us:.1f} us{via}, bare "
            f"core {core:.1f} us ({point['ratio']:.2f}x"
            + (f"; {point['backend_object_ratio']:.2f}x" if direct_us else "")
            + ")"
        )
        if fresh_us:
            obj = fresh[w]["backend_object_us"]
            print(
                f"#   fresh interpreters (as torchrun starts ranks): through torch "
                f"{fresh_us:.1f} us"
                + (f", through the backend object {obj:.1f} us" if obj else "")
                + f" ({point['fresh_ratio']:.2f}x the bare core)"
            )
        if len(point["rounds"]) > 1:
            print(
                f"#   medians of {len(point['rounds'])} rounds, each through torch / through the "
                "backend object / bare core / the ring's hop (us): "
                + ", ".join(
                    f"{p['torch_us']:.1f}/{p['backend_object_us']:.1f}/{p['bare_us']:.1f}/"
                    + (f"{p['hop_us']:.1f}" if p.get("hop_us") else "-")
                    for p in point["rounds"]
                )
            )
        if layer is not None and nothing is not None:
            print(
                f"#   torch's layer {layer:.1f} us (through torch - through the backend "
                f"object); a do-nothing backend: {nothing:.1f} us with the hand-offs (the "
                f"lower of the floor's and the bare core's), {point['do_nothing_ratio']:.2f}x "
                "the bare core"
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = harness.parse_args(
        parser, argv, {"world_sizes": "4"}, {"point_seconds": 0.05, "warmup": 2}
    )
    if args.quick:
        args.sizes = args.sizes or ",".join(str(s) for s in QUICK_SIZES)
    try:
        worlds = sorted(set(harness.csv_ints(args.world_sizes)))
        ops = parse_list(args.ops, OPS, ALIASES)
        backends = parse_list(args.backends, BACKENDS, {})
        if args.sizes:
            sizes = sorted({harness.parse_bytes(s) for s in args.sizes.split(",") if s.strip()})
        else:
            sizes = sizes_between(
                harness.parse_bytes(args.min_bytes),
                harness.parse_bytes(args.max_bytes),
                args.step_factor,
            )
    except ValueError as e:
        parser.error(str(e))
    if not worlds or min(worlds) < 1 or not sizes or min(sizes) < 1:
        parser.error("world sizes and message sizes must be >= 1")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    started = time.time()
    load_start = os.getloadavg()
    # Before any TCPStore exists: the floor micro-benchmarks fork.
    measured = measure_floors(worlds, args.quick)
    mooncake_env = {k: os.environ.get(k, v) for k, v in MOONCAKE_ENV_DEFAULTS.items()}
    model = floors.FloorModel(
        cores=measured["cores"],
        copy=measured["copy"],
        handoff=measured["handoff"],
        small_bytes=int(mooncake_env["MOONCAKE_SMALL_MSG_BYTES"]),
    )
    report.print_floors(model, load_start)

    cfg = {
        "ops": ops,
        "sizes": sizes,
        "warmup": args.warmup,
        "min_iters": args.min_iters,
        "max_iters": args.max_iters,
        "repeats": args.repeats,
        "point_seconds": args.point_seconds,
        "op_timeout": args.op_timeout,
    }
    errors, launches = [], []
    by_world: dict[int, dict[str, dict]] = {}
    probe_worlds = ([] if args.no_overhead or 1 in worlds else [1]) + worlds
    # The small all_reduce beside the bare core and the ring, in rounds inside each launch.
    pair = BARE_BINARY.exists() and "all_reduce" in ops and 8 in sizes and not args.no_pairs
    paired: dict[int, list[dict]] = {}
    for world in probe_worlds:
        world_cfg = dict(cfg, ops=ops if world in worlds else [])
        by_backend = by_world.setdefault(world, {})
        for backend in backends:
            print(f"# launching {backend}, world {world} ...", file=sys.stderr, flush=True)
            run_cfg = world_cfg
            if pair and backend == MOONCAKE_CPU and world in worlds and world >= 2:
                run_cfg = dict(
                    run_cfg,
                    pair_rounds=PAIR_ROUNDS,
                    bare_binary=str(BARE_BINARY),
                    pair_sizes=[n for n in sizes if n <= report.TARGETS["small_max_bytes"]],
                )
            if not args.no_pairs and backend == MOONCAKE_CPU and world == report.KEY_WORLD:
                run_cfg = dict(run_cfg, copy_beside=copy_shares(model, world, ops, sizes))
            result = launch(backend, world, run_cfg, args.launch_timeout, args.start_method)
            launches.append({k: v for k, v in result.items() if k not in ("per_rank", "pairs")})
            if result["error"]:
                print(f"# {backend} world {world}: {result['error']}", file=sys.stderr)
                errors.append({"backend": backend, "world": world, "error": result["error"]})
            by_backend[backend] = merge(result)
            if result["pairs"]:
                paired[world] = result["pairs"]
        layer = torch_layer(by_backend.get(MOONCAKE_CPU, {}))
        if layer is not None:
            model.torch_layer[world] = layer
        if world in worlds and world >= 2:
            report.print_world(model, world, ops, backends, by_backend)

    results = report.collect(model, by_world, ops)
    fresh = {}
    small = [s for s in sizes if s <= report.TARGETS["small_max_bytes"]]
    forked = args.start_method == "forkserver"
    if forked and MOONCAKE_CPU in backends and "all_reduce" in ops and small and not args.no_fresh:
        fresh = fresh_interpreters(worlds, small, cfg, args.launch_timeout)
    bare = bare_core(worlds, results["rows"], results["overhead"], model, fresh, paired)
    targets = report.check_targets(results, backends, bare, fresh)
    report.print_overheads(results["overhead"], backends)
    report.print_targets(targets)
    document = {
        "meta": {
            **harness.run_meta(started, measured["cores"], load_start, args),
            "mooncake_env": mooncake_env,
            "dtype": "float32",
            "time": "per timed loop of back-to-back ops, the slowest rank's mean; per point, "
            "the fastest of its loops (loops_us lists them all)",
        },
        "launches": launches,
        "floors": report.floors_json(model),
        "overhead": results["overhead"],
        "results": results["rows"],
        "targets": targets,
        "bare_core": bare,
        "fresh_interpreters": {str(w): v for w, v in fresh.items()},
        "errors": errors,
    }
    wrote = harness.write_outputs(
        out_dir,
        {"pg.json": document, "pg_table.md": report.markdown_table(results["rows"], backends)},
    )
    if not args.no_plot:
        report.plot(results["rows"], backends, out_dir / "pg.png")
    print(f"# {wrote}" + ("" if args.no_plot else ", pg.png"))
    print(f"# total {time.time() - started:.0f} s", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
