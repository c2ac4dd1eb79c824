"""Parent side of the chaos soak (test_gpu_chaos.py) and the failover benchmark
(bench/bench_ep_failover.py): plans of faults, the launch that lives through one (with
its pre-started replacements, resumed and slowed processes), and the checks and times
of what the processes recorded (the processes are ``chaos_ranks.member``).

Nothing here waits without a bound: a launch that outlives its deadline, or a process
that fails or exits unplanned, ends the launch (the others are told through the store's
``abort`` key, then killed); the Python stacks of the processes still running are kept
(they dump them on SIGUSR1).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_ranks import member, pkey_of

FAULTS = ("kill", "kill", "stop", "slow")  # a kill half the time


# --- plans -------------------------------------------------------------------------------


def make_cycles(
    seed: int,
    world: int,
    count: int,
    faults=FAULTS,
    wheres=("between", "inside"),
    never=(),
    slow_s=(0.3, 0.8),
    first_victim: int | None = 0,
    cover=(),
) -> list[dict]:
    """``count`` cycles: each a random fault of ``faults`` (a kill ``between`` steps or
    ``inside`` one, by ``wheres``) on a random rank (rank 0 included; never one of
    ``never``), the first on ``first_victim`` when given. ``cover``: ``(fault, where)``
    pairs the first cycles take in turn (so that a short run has each). ``slow_s``: the
    range of a slow rank's stop (keep it under the hang limit)."""
    rng = random.Random(seed)
    victims = [r for r in range(world) if r not in never]
    out = []
    for k in range(count):
        v = first_victim if k == 0 and first_victim in victims else rng.choice(victims)
        fault = rng.choice(list(faults))
        where = rng.choice(list(wheres)) if fault == "kill" else "between"
        if k < len(cover):
            fault, where = cover[k]
        cy = {"victim": v, "fault": fault, "where": where, "frac": round(rng.uniform(0.1, 0.9), 3)}
        if fault == "slow":
            cy["slow_s"] = round(rng.uniform(*slow_s), 3)
        out.append(cy)
    return out


def make_plan(device: str, world: int, cycles: list[dict], **kw) -> dict:
    """The plan every process of a launch follows (see chaos_ranks). ``kw`` overrides:
    ``spec`` (the EP calls' shape), ``timeout_us``, ``fp8`` (the measured EP step's),
    ``hang_ms`` (the launch's MOONCAKE_HANG_MS, for the checks), ``measure`` (``"ep"``,
    ``"ar"`` or ``"graph"``: chaos_ranks.measured), ``ar_bytes`` (of the last two),
    ``settle`` (full steps per cycle), ``battery`` (of ``"ep"``, ``"eep"`` and ``chaos_steps.COLLECTIVES``), ``healthy``
    (``{"steps", "busy_rank", "busy_ms"}``), ``seed``, ``label``, ``pg_s`` (the group's op
    timeout), ``wait_s`` (any wait for another process), ``eep_timeout_ms``."""
    plan = {
        "device": device,
        "world": world,
        "backend": "mooncake" if device == "cuda" else "mooncake-cpu",
        "spec": {"T": 16, "H": 256, "K": 4, "epr": 2, "ns": (16, 11, 14, 7)},
        "timeout_us": 10_000_000,
        "hang_ms": 2000,
        "fp8": True,
        "measure": "ep",
        "ar_bytes": 64 << 20,
        "settle": 1,
        "battery": (),
        "healthy": None,
        "seed": 39,
        "label": "chaos",
        "pg_s": 60.0,
        "wait_s": 120.0,
        "eep_timeout_ms": 10_000,
        "cycles": cycles,
    }
    plan.update(kw)
    plan["eep"] = "eep" in plan["battery"]
    plan["ep_buffer"] = plan["measure"] == "ep" or "ep" in plan["battery"]
    return plan


# --- one launch ----------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a launch left: every process's records and info (by pkey), the faults'
    stamps (by cycle), when the parent resumed each stopped or slowed process, and why
    the launch failed (None: it ran to its end)."""

    plan: dict
    processes: dict[str, dict] = field(default_factory=dict)
    stamps: dict[int, dict] = field(default_factory=dict)
    resumed: dict[int, float] = field(default_factory=dict)
    error: str | None = None
    stacks: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0

    def records(self):
        """``(pkey, record)`` of every process."""
        for key, p in self.processes.items():
            for rec in p.get("records", []):
                yield key, rec


def proc_state(pid: int) -> str:
    """The state letter of a child in /proc ("T": stopped; "Z" or "X": gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "X"


def run(plan: dict, env: dict, timeout_s: float, log_dir: str | None = None) -> Outcome:
    """Launches ``plan``'s world of ``chaos_ranks.member`` processes (this process hosts
    the store) and conducts it: pre-starts each replacement (one at a time, the next once
    the last has joined), resumes a slowed process after its ``slow_s`` and a stopped one
    after its replacement joined. Returns once every process ended, at most ``timeout_s``."""
    from mooncake.launch import LocalGroup

    world, cycles = plan["world"], plan["cycles"]
    stamp_dir = tempfile.mkdtemp(prefix="mooncake-chaos-")
    plan = dict(plan, stamp_dir=stamp_dir)
    out = Outcome(plan)
    t_start = time.monotonic()
    deadline = t_start + timeout_s
    replaced = [c for c, cy in enumerate(cycles) if cy["fault"] in ("kill", "stop")]
    with LocalGroup(world, env=env, log_dir=log_dir) as group:
        store = group.store
        lg: dict[str, str] = {}  # pkey -> the launcher's key
        for r, key in enumerate(group.start(member, args=(plan, None))):
            lg[pkey_of(r, None)] = key
        gone: set[str] = set()  # processes that died on purpose
        handled: set[int] = set()  # cycles whose fault the parent has dealt with
        slow_until: dict[int, float] = {}
        standby = 0  # index into `replaced` of the next replacement to pre-start

        def start_standby() -> None:
            nonlocal standby
            c = replaced[standby]
            (key,) = group.start(member, ranks=[cycles[c]["victim"]], args=(plan, c))
            lg[pkey_of(cycles[c]["victim"], c)] = key
            standby += 1

        if replaced:
            start_standby()

        def scan_faults(t: float) -> None:
            """Acts on the faults that happened: the next few pending cycles (they come in
            order; a stop's or a slow rank's stays pending until it is resumed)."""
            for c in [c for c in range(len(cycles)) if c not in handled][:3]:
                cy = cycles[c]
                if not store.check([f"fault/{c}"]):
                    continue
                pk = pkey_of(cy["victim"], _incarnation(plan, c))
                if cy["fault"] == "kill":
                    gone.add(pk)
                    group.expect_exit(lg[pk])
                    handled.add(c)
                elif proc_state(group.pid(lg[pk])) == "T":  # it stopped itself
                    if cy["fault"] == "slow":
                        slow_until.setdefault(c, t + cy["slow_s"])
                        if t >= slow_until[c]:
                            group.kill(lg[pk], signal.SIGCONT)
                            out.resumed[c] = time.monotonic()
                            handled.add(c)
                    elif store.check([f"joined/{c}"]):
                        group.kill(lg[pk], signal.SIGCONT)
                        out.resumed[c] = time.monotonic()
                        handled.add(c)

        try:
            while True:
                t = time.monotonic()
                if t > deadline:
                    raise TimeoutError(f"the launch ran past its deadline of {timeout_s:.0f} s")
                scan_faults(t)
                if store.add("errors", 0):  # a process failed: its error/<pkey> says why
                    k = next(k for k in lg if store.check([f"error/{k}"]))
                    raise RuntimeError(f"process {k} failed: {store.get(f'error/{k}').decode()}")
                for pk, key in lg.items():
                    code = group.exitcode(key)
                    if code not in (None, 0) and pk not in gone:
                        scan_faults(time.monotonic())  # it may have stamped since the scan
                        if pk not in gone:
                            raise RuntimeError(f"process {pk} exited with code {code} unplanned")
                # The next replacement is pre-started once the last one has joined.
                if standby < len(replaced) and store.check([f"joined/{replaced[standby - 1]}"]):
                    start_standby()
                if all(group.exitcode(key) is not None for key in lg.values()):
                    break
                time.sleep(0.002)
            if len(handled) < len(cycles) and not out.error:
                out.error = f"only {len(handled)} of {len(cycles)} faults happened"
        except Exception as e:  # noqa: BLE001  (the launch's verdict)
            out.error = f"{type(e).__name__}: {e}"
            store.set("abort", out.error[:500])
            out.stacks = dump_stacks(group, lg, stamp_dir)
        finally:
            for key in lg.values():
                if group.exitcode(key) is None:
                    group.kill(key, signal.SIGCONT)
                    group.kill(key)
            group.reap(list(lg.values()))
        for pk in lg:
            doc = json.loads(store.get(f"rec/{pk}")) if store.check([f"rec/{pk}"]) else {}
            out.processes[pk] = doc
        for c in range(len(cycles)):
            if store.check([f"fault/{c}"]):
                out.stamps[c] = json.loads(store.get(f"fault/{c}"))
    shutil.rmtree(stamp_dir, ignore_errors=True)  # the stacks are read by now
    out.wall_s = time.monotonic() - t_start
    return out


def dump_stacks(group, lg: dict[str, str], stamp_dir: str) -> dict[str, str]:
    """The Python stacks of the processes still running (SIGUSR1: faulthandler)."""
    running = [pk for pk, key in lg.items() if group.exitcode(key) is None]
    for pk in running:
        group.kill(lg[pk], signal.SIGCONT)
        group.kill(lg[pk], signal.SIGUSR1)
    time.sleep(1.0)
    out = {}
    for pk in running:
        path = Path(stamp_dir, f"{pk}.stacks")
        if path.exists():
            out[pk] = path.read_text()[-6000:]
    return out


# --- checks --------------------------------------------------------------------------------


def problems_of(o: Outcome) -> list[str]:
    """Everything wrong with a launch: its error, a process's error or failed check, a
    tag whose processes disagree on the ranks it covered, a fault step that masked other
    than its victim (nobody for a slow rank), a stopped process not told it was left out,
    a healthy phase in which anybody was masked."""
    plan, world = o.plan, o.plan["world"]
    out: list[str] = []
    if o.error:
        out.append(f"launch: {o.error}")
        out += [f"  stacks of {pk}:\n{s}" for pk, s in o.stacks.items()]
    for pk, p in o.processes.items():
        info = p.get("info", {})
        if info.get("error"):
            out.append(f"process {pk}: {info['error']}\n{info.get('traceback', '')[-3000:]}")
    by_tag: dict[str, dict[str, Any]] = {}
    for pk, rec in o.records():
        for f in rec["failures"]:
            out.append(f"process {pk}: {f}")
        if rec.get("ranks") is not None:
            by_tag.setdefault(rec["tag"], {})[pk] = rec["ranks"]
    for tag, seen in by_tag.items():
        if len({tuple(v) for v in seen.values()}) > 1:
            out.append(f"{tag}: the processes disagree on the ranks it covered: {seen}")
    everyone = [1] * world
    for c, cy in enumerate(plan["cycles"]):
        v = cy["victim"]
        want = everyone if cy["fault"] == "slow" else [int(r != v) for r in range(world)]
        seen = by_tag.get(f"c{c}/fault", {})
        if not seen and c in o.stamps:
            out.append(f"cycle {c}: no process recorded the step after the fault")
        for pk, got in seen.items():
            if got != want and not (plan["measure"] == "ar" and cy["where"] == "inside"):
                out.append(f"cycle {c} ({cy['fault']} of {v}): process {pk} ended with {got}")
        for tag, seen in by_tag.items():  # every op after the fault, before the join
            if tag == f"c{c}/after" or tag.startswith(f"c{c}/after/"):
                for pk, got in seen.items():
                    if got != want:
                        out.append(f"{tag} ({cy['fault']} of {v}): process {pk} covered {got}")
        for pk, got in by_tag.get(f"c{c}/rejoin", {}).items():
            if got != everyone:
                out.append(f"cycle {c}: process {pk}'s first step after the join covered {got}")
        if cy["fault"] == "stop" and c in o.stamps:
            out += stop_problems(o, c)
            p = o.processes.get(pkey_of(v, _incarnation(plan, c)), {})
            told = p.get("info", {}).get("left_out")
            if not told or not told.get("told"):
                out.append(f"cycle {c}: rank {v}, stopped and resumed, was not told: {told}")
    for pk, p in o.processes.items():
        events = p.get("info", {}).get("healthy_events")
        if events:
            out.append(f"healthy steps: process {pk} masked peers: {events}")
    return out


#: How long past the hang limit a stopped rank may take to be masked (the heartbeat's
#: period, the agreement, a busy host).
STOP_SLACK_MS = 2000


def stop_problems(o: Outcome, c: int) -> list[str]:
    """A stopped rank is masked after the hang limit, not sooner (nothing else may take
    it for failed) and not much later, and never only at the EP deadline."""
    plan = o.plan
    hang, timeout_us = plan["hang_ms"], plan["timeout_us"]
    t = o.stamps[c]["t"]
    ends = [rec["t1"] for _, rec in o.records() if rec["tag"] == f"c{c}/fault"]
    if not ends:
        return []
    ms = (max(ends) - t) * 1e3
    out = []
    if ms < 0.9 * hang:
        out.append(f"cycle {c}: a stopped rank masked after {ms:.0f} ms, before the hang limit")
    if ms > hang + STOP_SLACK_MS:
        out.append(f"cycle {c}: a stopped rank masked after {ms:.0f} ms (hang limit {hang} ms)")
    if timeout_us != -1 and ms >= timeout_us / 1e3:
        out.append(f"cycle {c}: a stopped rank masked at the EP deadline ({ms:.0f} ms)")
    return out


def _incarnation(plan: dict, c: int) -> int | None:
    """The cycle whose replacement is the process that cycle ``c``'s victim is (None:
    the original one)."""
    v = plan["cycles"][c]["victim"]
    last = None
    for k, cy in enumerate(plan["cycles"][:c]):
        if cy["victim"] == v and cy["fault"] in ("kill", "stop"):
            last = k
    return last


def fault_times(o: Outcome) -> list[dict]:
    """Per cycle: the fault, its stamp, and in ms from the stamp: the slowest survivor's
    end of the next step (``next_ms``), the fastest's (``first_ms``) and the last
    survivor's start of it (``start_ms``: where the time went, the step or its start;
    negative where every survivor began before the fault), the slowest process's end of
    the first full-strength step after the join (``full_ms``, kill and stop), and from the
    replacement's join_group call to that (``join_full_ms``); when the slowest and the
    fastest survivor's transport told of the victim (``host_ms``, ``host_first_ms``: its
    death or, stopped, its silence; pg.watch_loss_times), and each survivor's
    (``host_told_ms``, by process key); ``step_ms``: the median
    full-strength step of the cycle before the fault; ``told_ms``: a stopped process's
    LeftOutError after it was resumed."""
    plan = o.plan
    out = []
    for c, cy in enumerate(plan["cycles"]):
        if c not in o.stamps:
            continue
        t = o.stamps[c]["t"]
        row = {"c": c, **cy, "t": t}
        faults = [(key, rec) for key, rec in o.records() if rec["tag"] == f"c{c}/fault"]
        fault_recs = [rec for _, rec in faults]
        ends = [rec["t1"] for rec in fault_recs]
        row["next_ms"] = (max(ends) - t) * 1e3 if ends else None
        if ends:
            row["first_ms"] = (min(ends) - t) * 1e3
            row["start_ms"] = (max(rec["t0"] for rec in fault_recs) - t) * 1e3
        told = [rec["t_told"] for rec in fault_recs if "t_told" in rec]
        if told and all(x is not None for x in told):  # (a survivor not told: no value)
            row["host_ms"] = (max(told) - t) * 1e3
            row["host_first_ms"] = (min(told) - t) * 1e3
            # Which process was told when (pkey "rank" or "rank@cycle" for a replacement),
            # so that a late one can be looked for in its log.
            row["host_told_ms"] = {
                key: round((rec["t_told"] - t) * 1e3, 3) for key, rec in faults if "t_told" in rec
            }
        # Whether a survivor's step counted the victim (its part was in before it died):
        # then the step did not recover from anything.
        counted = [rec["ranks"] for rec in fault_recs if rec.get("ranks")]
        if counted:
            row["victim_counted"] = any(r[cy["victim"]] for r in counted)
        fulls = [rec["t1"] - rec["t0"] for _, rec in o.records() if rec["tag"] == f"c{c}/full0"]
        row["step_ms"] = sorted(fulls)[len(fulls) // 2] * 1e3 if fulls else None
        rejoin = [rec["t1"] for _, rec in o.records() if rec["tag"] == f"c{c}/rejoin"]
        if cy["fault"] in ("kill", "stop") and rejoin:
            row["full_ms"] = (max(rejoin) - t) * 1e3
            joiner = o.processes.get(pkey_of(cy["victim"], c), {}).get("info", {})
            if "t_join_call" in joiner:
                row["join_full_ms"] = (max(rejoin) - joiner["t_join_call"]) * 1e3
                row["init_ms"] = (joiner["t_join_call"] - joiner["t_init"]) * 1e3
        if cy["fault"] == "stop":
            p = o.processes.get(pkey_of(cy["victim"], _incarnation(plan, c)), {})
            lo = p.get("info", {}).get("left_out")
            if lo:
                row["told_ms"] = lo.get("op_ms")
        out.append(row)
    return out


#: Kinds of library thread that run on demand, one per object while its requests run (a
#: store's worker: one per store, ending 200 ms after its last request; a long wait for a
#: key keeps it): how many more of them a sample may find without a leak.
ON_DEMAND_THREADS = {"mc-store": 1}


def thread_growth(samples: list[dict]) -> list[str]:
    """Threads that grew (the last three samples' least against the third), by name: a
    kind of thread present at the third sample that is more at the end (threads that pile
    up; beyond ON_DEMAND_THREADS for the kinds that come and go with requests), or more
    than two threads in all. One new kind of thread is no growth: the library starts some
    on first use (a group's op queue on its first async op, the store's worker while
    requests come, the CUDA driver's own), and a leak of them shows as a second."""
    ref, tail = samples[2], samples[-3:]
    out = []
    names = ref.get("thread_names")
    if names is not None:
        for name, n in sorted(names.items()):
            end = min(s.get("thread_names", {}).get(name, 0) for s in tail)
            if end > n + ON_DEMAND_THREADS.get(name, 0):
                out.append(f"threads named {name!r} grew from {n} to {end}")
    end = min(s["threads"] for s in tail)
    if end > ref["threads"] + (2 if names is not None else 0):
        out.append(f"threads grew from {ref['threads']} to {end}")
    return out


def growth_problems(o: Outcome, slack_mib: float = 256.0) -> list[str]:
    """Resource growth: per process with at least five samples (one per cycle), fds past
    its third sample, threads as ``thread_growth`` says, RSS by more than 24 MiB, and on
    CUDA its allocated bytes by more than 8 MiB and the GPU's used bytes by more than
    ``slack_mib`` (each measure's least over the last three samples against the third)."""
    from ft_parent import resource_growth

    out = []
    for pk, p in o.processes.items():
        samples = p.get("info", {}).get("samples", [])
        if len(samples) < 5:
            continue
        # threads stand still here (thread_growth judges them)
        host = [{"fds": s["fds"], "threads": 0, "rss_kib": s["rss_kib"]} for s in samples]
        out += [f"process {pk}: {q}" for q in resource_growth(host, 2, settle=3)]
        out += [f"process {pk}: {q}" for q in thread_growth(samples)]
        if "cuda_used" in samples[0]:
            ref, tail = samples[2], samples[-3:]
            for k, slack in (("cuda_allocated", 8 << 20), ("cuda_used", int(slack_mib * 2**20))):
                end = min(s[k] for s in tail)
                if end > ref[k] + slack:
                    out.append(
                        f"process {pk}: {k} grew from {ref[k] >> 20} MiB (cycle "
                        f"{ref['c']}) to {end >> 20} MiB"
                    )
    return out


def env_for(hang_ms: int, extra: dict | None = None) -> dict:
    """A launch's environment: the library's knobs that the checks depend on, set."""
    from ft_parent import env

    out = env(MOONCAKE_HANG_MS=str(hang_ms), PYTHONUNBUFFERED="1")
    out.update(extra or {})
    return out
