"""How fast EP and the collectives get over a failed rank, and take in its replacement.

N processes on this host (``mooncake.launch.LocalGroup``: this process hosts the store),
one GPU shared by all with ``--device cuda`` (the EP ``Buffer``'s device path over a
``mooncake`` group, whose transport tells the kernels of a lost peer), or CPU tensors
with ``--device cpu`` (the portable path over ``mooncake-cpu``). Each launch lives
through a plan of faults (``tests/python/support/chaos_ranks.py``); every step is
checked against the routing model of ``tests/python/support/ep_cases.py``, and a wrong
result, a hang (every wait is bounded), a survivor disagreeing with another on the
ranks a step covered, a stopped rank masked before the hang limit or at the deadline,
or any masking in the healthy run makes the program exit non-zero.

Scenarios (all of them unless some are named: ``--kill``, ``--stop``, ``--healthy``,
``--allreduce``, ``--graph``):

* ``kill``: per world size and ``timeout_us``, ``--kills`` kill -9 of a random rank
  (rank 0 included) per mode of ``--modes``: ``between`` two EP steps (after a barrier,
  so that every process is between steps), or ``inside`` a dispatch (the victim
  SIGKILLs itself right after launching its dispatch, before synchronizing; on the
  portable path, once its tokens' exchange started). Measured from the victim's stamp
  (``time.monotonic()``, one clock for every process of the host, taken just before it
  writes the stamp to the store and kills itself): **kill -> next step**, the slowest
  survivor's next dispatch + combine returned (synchronised; its inputs made before the
  fault, as an engine's are ready), beside the fastest survivor's return and the last
  survivor's start of that step, and when the first and the last survivor's host was
  told of the death (``pg.watch_loss_times``: where the time went); then a pre-started
  replacement joins (``pg.join_group``, its Buffer, the others' ``recover_ranks`` and
  ``update_ep_member``): **kill -> full strength**, the slowest process's first
  full-strength dispatch + combine returned, and **join_group -> full strength** from
  the replacement's ``join_group()`` call.
* ``stop``: ``--stops`` SIGSTOPs of a random rank between steps, for longer than
  ``MOONCAKE_HANG_MS`` (``--hang-ms``): it must be masked after the hang limit, never
  before it nor at ``timeout_us``; it is replaced, then resumed and must be told it was
  left out (``LeftOutError``).
* ``healthy``: ``--healthy-steps`` EP steps with rank ``--busy-rank`` busy for
  ``--busy-ms`` between steps (a matmul loop on the GPU, a spinning loop on the CPU):
  nobody may be masked.
* ``allreduce``: ``--ar-world`` processes, ``--kills`` kills of a random rank inside a
  ``--ar-mib`` MiB float32 all_reduce (the victim issues it, waits a random share of
  the op's usual time, then dies): **kill -> all_reduce returned** on the slowest
  survivor; the result must cover all ranks or the survivors, alike on every survivor.
* ``graph`` (CUDA only): ``--ar-world`` processes, ``--kills`` kill -9 of a random rank
  between replays of a ``--graph-kib`` KiB all_reduce captured in a CUDA graph (the
  device-driven kernels): the survivors replay at once, with no eager call first, and
  their replay meets the lost rank: **kill -> replay returned** on the slowest survivor;
  the result must cover exactly the survivors. Then an eager call sets the kernels up
  among them, the old graph serves again, and a replacement captures its own.

Every step's time is also shown at full strength (``step``), for comparison. A row
gives the median and p99 (nearest rank: with fewer than 100 values, the maximum) over
the faults. Targets (issue 39, the GPU): kill -> next EP step <= 20 ms p99, kill inside
a 64 MiB all_reduce or before a captured one's replay <= 50 ms p99; shown, not fatal.
JSON and a Markdown table go to ``--out-dir`` (``ep_failover.json``,
``ep_failover_table.md``).

Under MPS a process killed while its kernel runs makes the MPS server fail every client
on the GPU (docs/failures.md): run ``inside`` kills and ``allreduce`` without MPS, and
``between`` kills, ``stop`` and ``healthy`` under MPS if you want MPS's speed
(``scripts/gpu_check.sh``'s ``epfail`` step does so).

    python bench/bench_ep_failover.py --device cuda [--worlds 4,8] [--kills 50]
    .venv/bin/python bench/bench_ep_failover.py --device cpu --worlds 4 --kills 3
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path

import harness
from harness import fmt_fixed, log, say

HERE = Path(__file__).resolve().parent
# The rank code and the model live with the tests (shared, not copied).
sys.path.insert(0, str(HERE.parent / "tests" / "python" / "support"))

SCENARIOS = ("kill", "stop", "healthy", "allreduce", "graph")
TARGETS_MS = {"kill": 20.0, "allreduce": 50.0, "graph": 50.0}  # p99, issue 39 (the GPU)


# --- plans ---------------------------------------------------------------------------------


def ep_cycles(seed: int, world: int, modes: list[str], kills: int, stops: int) -> list[dict]:
    """The faults of one EP launch, shuffled: ``kills`` per mode and ``stops``, each on a
    random rank; the first fault of each kind on rank 0."""
    rng = random.Random(seed)
    kinds = [("kill", m) for m in modes for _ in range(kills)] + [("stop", "between")] * stops
    rng.shuffle(kinds)
    seen: set[tuple[str, str]] = set()
    out = []
    for fault, where in kinds:
        v = 0 if (fault, where) not in seen else rng.randrange(world)
        seen.add((fault, where))
        out.append({"victim": v, "fault": fault, "where": where, "frac": 0.5})
    return out


def ar_cycles(seed: int, world: int, kills: int) -> list[dict]:
    """Kills inside the all_reduce, each at a random share of the op's usual time."""
    rng = random.Random(seed)
    return [
        {
            "victim": 0 if k == 0 else rng.randrange(world),
            "fault": "kill",
            "where": "inside",
            "frac": round(rng.uniform(0.05, 0.9), 3),
        }
        for k in range(kills)
    ]


def graph_cycles(seed: int, world: int, kills: int) -> list[dict]:
    """Kills between replays of the captured all_reduce, rank 0 first."""
    rng = random.Random(seed)
    return [
        {"victim": 0 if k == 0 else rng.randrange(world), "fault": "kill", "where": "between",
         "frac": 0.5}
        for k in range(kills)
    ]  # fmt: skip


def launch_budget(plan: dict, device: str) -> float:
    """Seconds a launch may take: start-up, every cycle (a replacement's start and join
    on the GPU takes seconds), every stop's hang limit, every healthy step."""
    per_cycle = 20.0 if device == "cuda" else 10.0
    world_factor = max(1.0, plan["world"] / 4)
    cycles = len(plan["cycles"]) * per_cycle * world_factor
    stops = sum(plan["hang_ms"] / 1000 + 5 for cy in plan["cycles"] if cy["fault"] == "stop")
    h = plan.get("healthy") or {}
    healthy = h.get("steps", 0) * (h.get("busy_ms", 0) / 1000 + 0.25 * world_factor)
    return 120 + cycles + stops + healthy


# --- summary -------------------------------------------------------------------------------


def stats(values: list[float]) -> dict:
    keys = {"n": "n", "median_ms": "median", "p99_ms": "p99", "max_ms": "max"}
    return {**harness.summarize(values, keys, digits=2), "values_ms": [round(v, 2) for v in values]}


def healthy_steps(outcome) -> dict:
    """The healthy run: per step the slowest rank's time, and how many steps saw a mask."""
    by_step: dict[str, list[float]] = {}
    masked = 0
    for _, rec in outcome.records():
        if rec.get("phase") != "healthy":
            continue
        by_step.setdefault(rec["tag"], []).append((rec["t1"] - rec["t0"]) * 1e3)
        masked += int(rec.get("ranks") is not None and 0 in rec["ranks"])
    times = [max(v) for v in by_step.values()]
    events = sum(
        len(p.get("info", {}).get("healthy_events") or []) for p in outcome.processes.values()
    )
    return {"steps": len(times), "step": stats(times), "masked_steps": masked, "events": events}


def landed_late(fault: dict) -> bool:
    """Whether a kill meant to land inside an all_reduce landed after it: the survivors'
    sum counted the victim and they finished before it died (a kill after its part was
    in, but before the op's end, still leaves them something to notice)."""
    return bool(fault.get("victim_counted")) and (fault.get("next_ms") or 0.0) <= 0.0


def rows_of(launch: dict) -> list[dict]:
    """The table's rows of one launch: per scenario, ``(measure, the fault times' key,
    target)``; a row's statistics are over the scenario's faults."""
    from chaos_parent import STOP_SLACK_MS

    world, tmo, faults = launch["world"], launch["timeout_us"], launch["faults"]
    if not faults and not launch.get("healthy"):
        return []  # not run, or ended before its first fault (its problems say why)
    groups = []
    if launch["scenario"] == "graph":
        kib = launch["ar_bytes"] >> 10
        groups += [
            ("graph", faults, [(f"kill → survivors' replay of a captured {kib} KiB all_reduce "
                                "returned", "next_ms", TARGETS_MS["graph"]),
                               (f"{kib} KiB all_reduce replay at full strength", "step_ms", None),
                               ("kill → replacement joined → first full replay", "full_ms",
                                None)]),
        ]  # fmt: skip
    elif launch["scenario"] == "allreduce":
        mib = launch["ar_mib"]
        # A kill that landed after the victim's part was in leaves nothing to recover
        # from (the survivors' sum counts it): not a sample of the target, shown apart.
        late = [f for f in faults if landed_late(f)]
        inside = [f for f in faults if not landed_late(f)]
        groups += [
            ("allreduce", inside, [(f"kill inside {mib} MiB all_reduce → survivors' "
                                    "all_reduce returned", "next_ms", TARGETS_MS["allreduce"])]),
            ("allreduce", late, [(f"kill after the {mib} MiB all_reduce had ended on the "
                                  "survivors → its return (before the kill)", "next_ms", None)]),
            ("allreduce", faults, [(f"{mib} MiB all_reduce at full strength", "step_ms", None),
                                   ("kill → replacement joined → first full all_reduce",
                                    "full_ms", None)]),
        ]  # fmt: skip
    else:
        for mode in ("between", "inside"):
            sel = [f for f in faults if f["fault"] == "kill" and f["where"] == mode]
            measures = [
                (
                    f"kill {mode} → survivors' next dispatch + combine",
                    "next_ms",
                    TARGETS_MS["kill"],
                ),
                (f"kill {mode} → the first survivor's step returned", "first_ms", None),
                (f"kill {mode} → the last survivor's step began", "start_ms", None),
                (f"kill {mode} → the first survivor's host told it gone", "host_first_ms", None),
                (f"kill {mode} → the last survivor's host told it gone", "host_ms", None),
                (f"kill {mode} → replacement joined → first full step", "full_ms", None),
                (f"kill {mode}: join_group() → first full step", "join_full_ms", None),
                (f"kill {mode}: dispatch + combine at full strength", "step_ms", None),
            ]
            groups.append((f"kill {mode}", sel, measures))
        hang = launch["hang_ms"]
        measures = [
            (f"SIGSTOP → survivors' next step (hang limit {hang} ms)", "next_ms",
             hang + STOP_SLACK_MS),
            ("SIGSTOP → the last survivor's host told it silent", "host_ms", None),
            ("SIGSTOP → replacement joined → first full step", "full_ms", None),
            ("SIGCONT → the stopped rank's op raises LeftOutError", "told_ms", None),
        ]  # fmt: skip
        groups.append(("stop", [f for f in faults if f["fault"] == "stop"], measures))
    rows = []
    for scenario, sel, measures in groups:
        rank0 = sum(1 for f in sel if f["victim"] == 0)
        for measure, key, target in measures:
            values = [f[key] for f in sel if f.get(key) is not None]
            if values:  # (rank 0's count: of the faults; a full-strength step has none)
                extra = {} if key == "step_ms" else {"rank0": rank0}
                rows.append(row(measure, scenario, world, tmo, values, target, **extra))
    h = launch.get("healthy")
    if h and h["steps"]:
        busy = f"rank {launch['busy_rank']} busy {launch['busy_ms']:g} ms between steps"
        masked = h["masked_steps"] + h["events"]
        values = h["step"]["values_ms"]
        rows.append(row(f"healthy: a step, {busy}", "healthy", world, tmo, values, masked=masked))
    return rows


def row(measure: str, scenario: str, world: int, tmo: int, values, target=None, **extra) -> dict:
    r = {"measure": measure, "scenario": scenario, "world": world, "timeout_us": tmo}
    r.update(stats(values), target_ms=target, **extra)
    r["met"] = None if target is None else r["p99_ms"] <= target
    return r


def fmt_ms(v) -> str:
    return fmt_fixed(v, 1e4)


def fmt_timeout(t: int) -> str:
    return "-1" if t == -1 else f"{t / 1e6:g} s"


def print_table(rows: list[dict]) -> None:
    say()
    say(
        f"# {'measure':<62} {'world':>5} {'timeout':>7} {'n':>4} {'rank0':>5} "
        f"{'median':>8} {'p99':>8} {'max':>8} {'target':>7}"
    )
    say(
        f"# {'':<62} {'':>5} {'':>7} {'':>4} {'':>5} {'(ms)':>8} {'(ms)':>8} {'(ms)':>8} "
        f"{'(p99)':>7}"
    )
    for r in rows:
        met = "" if r["met"] is None else ("  met" if r["met"] else "  MISS")
        masked = f"  masked {r['masked']}" if "masked" in r else ""
        say(
            f"  {r['measure']:<62} {r['world']:>5} {fmt_timeout(r['timeout_us']):>7} "
            f"{r['n']:>4} {r.get('rank0', ''):>5} {fmt_ms(r['median_ms']):>8} "
            f"{fmt_ms(r['p99_ms']):>8} {fmt_ms(r['max_ms']):>8} {fmt_ms(r['target_ms']):>7}"
            f"{met}{masked}"
        )


def markdown(rows: list[dict], meta: dict, problems: list[str], cut: list[str] = ()) -> str:
    lines = [
        f"{meta['what']}, {meta['started']}, library {meta['mooncake']['commit']}; load "
        f"average {meta['loadavg_start'][0]:.1f} at the start; {meta['duration_s']:.0f} s in "
        "all. Times from the fault's stamp (`time.monotonic()`, taken in the victim just "
        "before it fails) to the step's synchronised end on the slowest process; p99 is "
        "the nearest rank.",
        "",
    ]
    header = ["measure", "world", "timeout_us", "n", "rank 0", "median (ms)", "p99 (ms)"]
    header += ["max (ms)", "target p99 (ms)", "met"]
    cells = [
        [
            r["measure"] + (f" (masked: {r['masked']})" if "masked" in r else ""),
            str(r["world"]),
            fmt_timeout(r["timeout_us"]),
            str(r["n"]),
            str(r.get("rank0", "")),
            *(fmt_ms(r[k]) for k in ("median_ms", "p99_ms", "max_ms", "target_ms")),
            "" if r["met"] is None else ("yes" if r["met"] else "**no**"),
        ]
        for r in rows
    ]
    lines += harness.markdown_table(header, cells, "lrrrrrrrrl")
    lines += [f"\n{c}" for c in cut]
    lines += [f"\nPROBLEM: {p}" for p in problems]
    return "\n".join(lines) + "\n"


# --- main ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = harness.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--worlds", default="4,8", help="comma-separated process counts")
    p.add_argument("--timeouts-us", default="10000000,-1", help="EP timeout_us values")
    p.add_argument("--kills", type=int, default=50, help="kills per mode, world and timeout")
    p.add_argument("--modes", default="between,inside", help="where kills strike")
    p.add_argument("--stops", type=int, default=5, help="SIGSTOPs per world and timeout")
    p.add_argument("--hang-ms", type=int, default=2000, help="MOONCAKE_HANG_MS")
    for s in SCENARIOS:
        p.add_argument(f"--{s}", action="store_true", help=f"run the {s} scenario (see above)")
    p.add_argument("--healthy-steps", type=int, default=200)
    p.add_argument("--busy-ms", type=float, default=50.0)
    p.add_argument("--busy-rank", type=int, default=0)
    p.add_argument("--ar-world", type=int, default=4)
    p.add_argument("--ar-mib", type=int, default=64)
    p.add_argument("--ar-kills", type=int, default=None, help="(default: --kills; 0: none)")
    p.add_argument("--graph-kib", type=int, default=4, help="the captured all_reduce's KiB")
    p.add_argument("--tokens", type=int, default=0, help="T per rank (0: 64 on cuda, 16 on cpu)")
    p.add_argument(
        "--hidden", type=int, default=0, help="H, a multiple of 128 (0: 2048 on cuda, 512 on cpu)"
    )
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--fp8", type=int, default=1, help="the timed dispatch in FP8 (1) or BF16")
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--launch-timeout", type=float, default=0, help="seconds (0: estimated)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=0,
        help="seconds for the whole run (0: none): a launch gets at most what is left, and "
        "one that runs out fails like a hang (with its processes' stacks)",
    )
    p.add_argument("--log-dir", default=None, help="each process's output, one file each")
    harness.add_output_args(p, "world 4, 5 kills, 2 stops, 40 healthy steps")
    harness.add_if_gpu(p)
    return p


def save(out_dir: str, meta: dict, launches: list[dict]) -> tuple[list[dict], list[str]]:
    """Writes the JSON and the table of the launches so far; returns their rows and
    problems."""
    rows = [r for launch in launches for r in rows_of(launch)]
    problems = [p for launch in launches for p in launch["problems"]]
    doc = {"meta": meta, "targets_ms": TARGETS_MS, "rows": rows, "launches": launches,
           "problems": problems}  # fmt: skip
    cut = [f"{launch['scenario']}, world {launch['world']}, timeout_us "
           f"{fmt_timeout(launch['timeout_us'])}: {len(launch['cycles'])} of "
           f"{launch['faults_planned']} faults, as many as fit the --time-limit"
           for launch in launches if launch.get("faults_planned")]  # fmt: skip
    files = {"ep_failover.json": doc, "ep_failover_table.md": markdown(rows, meta, problems, cut)}
    harness.write_outputs(out_dir, files)
    return rows, problems


def fit_to_time(plan: dict, left: float, rate: float | None, label: str) -> dict:
    """``plan`` with as many of its faults as fit ``left`` seconds at ``rate`` seconds a
    fault (what a finished launch of the same scenario and world took, its start-up
    included), so that the time limit ends no launch in the middle, which would read
    as a hang. Unchanged without a rate, or with a healthy-steps part (timed apart)."""
    n = len(plan["cycles"])
    if rate is None or plan.get("healthy") or n == 0:
        return plan
    fit = max(1, int(0.8 * left / rate))
    if fit >= n:
        return plan
    log(f"# {label}: {fit} of {n} faults fit the time left ({left:.0f} s at {rate:.1f} s each)")
    return {**plan, "cycles": plan["cycles"][:fit], "faults_planned": n}


def run_launch(scenario: str, plan: dict, env: dict, args, rates: dict) -> dict:
    """One launch of ``plan``; ``rates``: seconds a fault took in this run's finished
    launches, by (scenario, world), which it adds to."""
    from chaos_parent import fault_times, problems_of, run

    budget = args.launch_timeout or launch_budget(plan, args.device)
    t0 = time.monotonic()
    label = f"{scenario}, world {plan['world']}, timeout_us {plan['timeout_us']}"
    if args.time_limit:
        left = args.time_limit - (t0 - args.t_start)
        if left < 15:
            # a bound the caller chose, not a fault: said (here and in the JSON), no problem
            log(f"# {label}: not run, the --time-limit is spent")
            return {"scenario": scenario, "world": plan["world"], "timeout_us": plan["timeout_us"],
                    "faults": [], "error": "not run: --time-limit spent",
                    "problems": []}  # fmt: skip
        budget = min(budget, left)
        plan = fit_to_time(plan, left, rates.get((scenario, plan["world"])), label)
    log(f"# {label}: {len(plan['cycles'])} faults (budget {budget:.0f} s) ...")
    o = run(plan, env, budget, args.log_dir)
    problems = [f"{label}: {p}" for p in problems_of(o)]
    launch = {
        "scenario": scenario,
        "world": plan["world"],
        "timeout_us": plan["timeout_us"],
        "hang_ms": plan["hang_ms"],
        "ar_mib": plan["ar_bytes"] >> 20,
        "ar_bytes": plan["ar_bytes"],
        "cycles": plan["cycles"],
        "faults": fault_times(o),
        "error": o.error,
        "wall_s": round(time.monotonic() - t0, 1),
        "problems": problems,
    }
    if plan.get("faults_planned"):
        launch["faults_planned"] = plan["faults_planned"]
    if not o.error and plan["cycles"]:
        rates[(scenario, plan["world"])] = launch["wall_s"] / len(plan["cycles"])
    late = [f for f in launch["faults"] if landed_late(f)]
    if scenario == "allreduce" and launch["faults"] and len(late) == len(launch["faults"]):
        problems.append(f"{label}: every kill landed after the all_reduce had the victim's "
                        "part (the survivors finished first): nothing measured the target")  # fmt: skip
    if plan.get("healthy"):
        launch["healthy"] = healthy_steps(o)
        launch.update(busy_rank=plan["healthy"]["busy_rank"], busy_ms=plan["healthy"]["busy_ms"])
    log(
        f"#   done in {launch['wall_s']:.0f} s"
        + (f"; {len(problems)} problems" if problems else "")
    )
    for p in problems[:20]:
        log(f"#   PROBLEM: {p[:2000]}")
    return launch


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = harness.parse_args(
        parser,
        argv,
        {"worlds": "4"},
        {"kills": 5, "stops": 2, "healthy_steps": 40, "ar_kills": 5},
    )
    args.t_start = time.monotonic()
    # `timeout` sends SIGTERM: leave through the launch's cleanup, which kills its ranks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    named = [s for s in SCENARIOS if getattr(args, s)]
    chosen = named or [s for s in SCENARIOS if s != "graph" or args.device == "cuda"]
    if "graph" in chosen and args.device != "cuda":
        parser.error("--graph: CUDA graphs need --device cuda")
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in ("between", "inside") for m in modes):
        parser.error(f"--modes: between and/or inside, not {args.modes!r}")
    worlds = harness.csv_ints(args.worlds)
    if not worlds or min(worlds) < 2:
        parser.error("--worlds: process counts of at least 2")
    if args.device == "cuda":
        status = harness.no_gpu_status("bench_ep_failover", args.if_gpu)
        if status is not None:
            return status
        from mooncake.ep import device as device_path

        if not device_path.available():
            print(
                "bench_ep_failover: error: this build of mooncake has no EP device path",
                file=sys.stderr,
            )
            return 0 if args.if_gpu else 1
    from chaos_parent import env_for, make_plan

    started, load = time.time(), os.getloadavg()
    cores = os.cpu_count()
    harness.say_host(f"EP failover ({args.device})", cores, load)
    T = args.tokens or (64 if args.device == "cuda" else 16)
    H = args.hidden or (2048 if args.device == "cuda" else 512)
    spec = {"T": T, "H": H, "K": args.topk, "epr": args.experts_per_rank}
    spec["ns"] = (T, T - T // 4, T // 2, T - 1)  # tokens of rank r: ns[r % 4]
    env = env_for(args.hang_ms, {"OMP_NUM_THREADS": "1"})
    common = {"spec": spec, "hang_ms": args.hang_ms, "fp8": bool(args.fp8), "settle": 2}
    # The all_reduce launch first: it is short, and its row is a target of its own,
    # which a --time-limit spent on the EP launches would leave unmeasured.
    todo = []
    kills = args.kills if args.ar_kills is None else args.ar_kills
    # (scenario, measure, its cycles, the all_reduce's bytes)
    ar_like = (
        ("allreduce", "ar", ar_cycles(args.seed, args.ar_world, kills), args.ar_mib << 20),
        ("graph", "graph", graph_cycles(args.seed + 1, args.ar_world, kills), args.graph_kib << 10),
    )
    for scenario, measure, cycles, nbytes in ar_like:
        if scenario in chosen and kills > 0:
            plan = make_plan(
                args.device,
                args.ar_world,
                cycles,
                measure=measure,
                ar_bytes=nbytes,
                timeout_us=-1,
                seed=args.seed,
                label=f"failover-{measure}",
                **common,
            )
            todo.append((scenario, plan))
    for world in worlds:
        for tmo in harness.csv_ints(args.timeouts_us):
            kills = args.kills if "kill" in chosen else 0
            stops = args.stops if "stop" in chosen else 0
            cycles = ep_cycles(args.seed + world, world, modes, kills, stops)
            healthy = None
            if "healthy" in chosen and args.healthy_steps > 0:
                busy = args.busy_rank % world
                healthy = {"steps": args.healthy_steps, "busy_rank": busy, "busy_ms": args.busy_ms}
            if not cycles and not healthy:
                continue
            plan = make_plan(
                args.device,
                world,
                cycles,
                timeout_us=tmo,
                healthy=healthy,
                seed=args.seed,
                label=f"failover-{world}",
                **common,
            )
            todo.append(("ep", plan))
    what = (
        f"EP failover on {args.device} ({cores} cores"
        + (f", {gpu_name()}" if args.device == "cuda" else "")
        + f"), worlds {args.worlds}, scenarios {','.join(chosen)}, modes {args.modes}"
    )

    def meta() -> dict:
        return {**harness.run_meta(started, cores, load, args), "what": what}

    launches, rates = [], {}
    for scenario, plan in todo:
        launches.append(run_launch(scenario, plan, env, args, rates))
        save(args.out_dir, meta(), launches)  # after each: a run cut short keeps what it has
    rows, problems = save(args.out_dir, meta(), launches)
    print_table(rows)
    for p in problems:
        say(f"# PROBLEM: {p[:4000]}")
    say(f"# results in {args.out_dir}")
    return 1 if problems else 0


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
