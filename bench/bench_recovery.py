"""How fast the ``mooncake-cpu`` backend recovers from a failed rank, and takes in a new one.

Each scenario launches one group with :class:`mooncake.launch.LocalGroup`
(the store hosted here, the ranks spawned) and injects faults into it, one
repetition after another, without restarting it:

* ``kill``: a rank kills itself with SIGKILL (kill -9) at a time it records
  just before; each survivor times the first all_reduce that returns over
  the survivor set. Run over shared memory (``MOONCAKE_TRANSPORT=auto``) and
  over tcp (``kill-tcp``).
* ``hang``: a rank stops itself with SIGSTOP; the survivors drop it once its
  heartbeat stands still for ``MOONCAKE_HANG_MS``. The stopped rank is then
  resumed (SIGCONT) and must learn that it was left out.
* after every fault a replacement process is started for the failed rank
  (``is_extension=True``); the members poll ``get_peer_state`` and admit it
  with ``recover_ranks``; the time from its ``join_group()`` call to the first
  full-strength collective completing on every rank is the join time.

All times are ``time.time()`` on this one host, taken in the ranks
themselves. Results go to ``<out-dir>/recovery.json`` and
``recovery_table.md``; see "Recovery benchmark" in ``bench/README.md``.

    .venv/bin/python bench/bench_recovery.py           # worlds 4 and 8, 2-4 minutes
    .venv/bin/python bench/bench_recovery.py --quick   # world 4, fewer repetitions
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import statistics
import struct
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

# Only the standard library (and harness, which imports nothing else) at the top: the
# ranks are spawned processes that re-import this file, and a replacement's start-up
# time is measured.
import harness
from harness import fmt_fixed, log, say

SCENARIOS = ("kill", "hang", "kill-tcp")
KILL_TARGET_MS = 250.0  # the target for a process death on one host
UPSTREAM = {
    "op_timeout_s": 10.0,
    "reconciliation_window_s": 30.0,
    "text": "upstream Mooncake notices a failed rank only when an op times out (10 s) and "
    "then waits out a 30 s reconciliation window: about 40 s before the survivors go on",
}
# Ranks in the measured loop re-read the control key this often (busy mode).
CHECK_S = 0.02
# Between iterations while a replacement starts: members poll get_peer_state
# once per iteration and sleep this long, leaving the CPU to the newcomer.
IDLE_SLEEP_S = 0.002


# --- one rank -------------------------------------------------------------------------


def rank_key(rank: int, incarnation: int) -> str:
    """LocalGroup's key for a process: "2" for the first of rank 2, "2.1" for its replacement."""
    return str(rank) if incarnation == 0 else f"{rank}.{incarnation}"


def _fault_waiter(port: int, key: str, stamp_path: str) -> None:
    """Waits for the parent's order, then records time.time() and signals this process.

    A store client of its own: the main one is busy in the loop. The stamp is
    written with one pwrite to a file the parent reads later (it survives the
    SIGKILL), so nothing but the syscall lies between the stamp and the signal.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(hours=1))
    fd = os.open(stamp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    store.wait([f"fault/{key}"])
    kind = store.get(f"fault/{key}").decode()
    if kind not in ("kill", "stop"):
        os.close(fd)
        return
    sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
    os.pwrite(fd, struct.pack("<d", time.time()), 0)
    os.kill(os.getpid(), sig)
    os.close(fd)  # after SIGCONT


def member(rank: int, world: int, port: int, cfg: dict) -> None:
    """One rank: back-to-back small all_reduce, admitting replacements when told to idle.

    Every op all-reduces [1, stop, poll] with SUM: [0] is the number of ranks
    the op ran over, [1] and [2] carry the parent's orders so that every member
    acts on them at the same op. Each change of [0] is an event, published at
    once under ``state/<key>`` (a rank may be killed later).
    """
    t_entry = time.time()
    key = rank_key(rank, cfg["incarnation"])
    # SIGUSR1 dumps every thread's Python stack: the launcher asks for it when stuck.
    stacks = open(os.path.join(cfg["stamp_dir"], f"{key}.stacks"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    ctl = None
    state: dict = {"key": key, "rank": rank, "events": [], "admits": [], "info": {}}
    try:
        import torch
        import torch.distributed as dist

        from mooncake import pg
        from mooncake.launch import init_rank, process_resources

        t_import = time.time()
        torch.set_num_threads(1)
        ctl = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        if cfg["incarnation"] == 0:
            # The first ranks meet after their imports, which take seconds and vary with
            # the host's load: the rendezvous in init_process_group is bounded by the
            # op timeout, and importing torch is not what is measured.
            harness.store_barrier(ctl, "imported", world)
        waiter = threading.Thread(
            target=_fault_waiter,
            args=(port, key, os.path.join(cfg["stamp_dir"], key)),
            daemon=True,
        )
        waiter.start()
        active = init_rank(
            rank,
            world,
            port,
            max_world_size=world,
            is_extension=cfg["incarnation"] > 0,
            timeout_s=cfg["op_timeout_s"],
        )
        t_ready = time.time()
        info = state["info"]
        info.update(t_entry=t_entry, t_import=t_import, t_ready=t_ready)

        def publish() -> None:
            harness.publish(ctl, f"state/{key}", state)

        if cfg["incarnation"] > 0:
            publish()  # ready: for the diagnosis of a join that stalls
            info["t_join_call"] = time.time()
            pg.join_group()
            info["t_joined"] = time.time()

        buf = torch.zeros(3)
        flags = buf.numpy()  # the same memory, without torch's per-element cost
        prev, mode, next_check, it = -1, "", 0.0, 0
        busy_since = (time.time(), 0)  # for the mean op time of the busy loop
        polls: list[float] = []  # start times of the get_peer_state calls that found no one
        while True:
            now = time.time()
            if now >= next_check:
                new_mode = ctl.get("ctl").decode()
                if new_mode == "busy" and mode != "busy":
                    busy_since = (now, it)
                mode = new_mode
                next_check = now + CHECK_S
            want_poll = mode == "idle" and prev != world
            flags[0], flags[1], flags[2] = 1.0, float(mode == "stop"), float(want_poll)
            t0 = time.time()
            dist.all_reduce(buf)
            t1 = time.time()
            it += 1
            n = int(round(flags[0]))
            if n != prev:
                ops = it - 1 - busy_since[1]
                state["events"].append(
                    {
                        "t_start": t0,
                        "t_end": t1,
                        "count": n,
                        "active": [int(a) for a in active.tolist()],
                        "iter": it,
                        # mean time of the busy loop's ops before this one
                        "busy_op_us": (t0 - busy_since[0]) / ops * 1e6
                        if mode == "busy" and ops > 0
                        else None,
                        # fds, threads, RSS: a long run must not grow them
                        "res": process_resources(),
                    }
                )
                prev = n
                publish()
            if flags[1] > 0:
                break
            if flags[2] > 0:
                # Agreed through the op above: every member polls, in the same order.
                missing = [r for r, a in enumerate(active.tolist()) if a == 0]
                if missing:
                    t_poll = time.time()
                    ready = pg.get_peer_state(None, missing)
                    todo = [r for r, ok in zip(missing, ready, strict=True) if ok]
                    if todo:
                        t_admit = time.time()
                        pg.recover_ranks(None, todo)
                        state["admits"].append(
                            {
                                "ranks": todo,
                                "t_poll": t_poll,
                                "t_start": t_admit,
                                "t_end": time.time(),
                                "polls_before": len(polls),
                                # the last polls that found no one waiting (start times)
                                "last_polls": polls[-5:],
                            }
                        )
                        polls = []
                        publish()  # not timed: for the diagnosis of a join that stalls
                    else:
                        polls.append(t_poll)
            if mode == "idle":
                time.sleep(IDLE_SLEEP_S)
        state["iterations"] = it
        publish()
        ctl.set(f"fault/{key}", "none")  # releases the waiter
        waiter.join(timeout=5)
        t_destroy = time.time()
        dist.destroy_process_group()
        state["destroy_s"] = time.time() - t_destroy
        state["ok"] = True
    except BaseException as e:  # noqa: BLE001  (reported to the parent through the store)
        state["error"] = f"{type(e).__name__}: {e}"
        state["traceback"] = traceback.format_exc()
        state["t_error"] = time.time()
    if ctl is not None:
        harness.publish(ctl, f"result/{key}", state)


# --- the parent -----------------------------------------------------------------------


class BenchError(RuntimeError):
    pass


def read_stamp(stamp_dir: str, key: str) -> float | None:
    try:
        data = Path(stamp_dir, key).read_bytes()
    except OSError:
        return None
    return struct.unpack("<d", data[:8])[0] if len(data) >= 8 else None


def exit_status(pid: int) -> str | None:
    """None while ``pid`` runs as a child of this process; else how it ended.

    Read from /proc (a zombie keeps its exit code there), so that multiprocessing,
    which reaps the children, is left alone.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone (exited and reaped)"
    fields = stat.rsplit(")", 1)[1].split()  # fields[0] is field 3, the state
    if int(fields[1]) != os.getpid():
        return "gone (exited and reaped)"
    if fields[0] != "Z":
        return None
    code = int(fields[-1])  # field 52: the wait status
    if code & 0x7F:
        name = signal.Signals(code & 0x7F).name
        return f"killed by {name}" + (" (core dumped)" if code & 0x80 else "")
    return f"exited with code {code >> 8}"


def wait_counts(group, store, keys: list[str], count: int, timeout_s: float, what: str) -> dict:
    """Waits until every process in ``keys`` has completed an op over ``count`` ranks.

    Returns each one's published state. Raises BenchError when one reports an
    error or ends without a result, or after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        states = {}
        for k in keys:
            result = harness.store_json(store, f"result/{k}")
            if result and "error" in result:
                raise BenchError(f"{what}: process {k} failed: {result['traceback']}")
            ended = exit_status(group.pid(k)) if result is None else None
            if ended and harness.store_json(store, f"result/{k}") is None:
                raise BenchError(f"{what}: process {k} {ended} without a result")
            states[k] = harness.store_json(store, f"state/{k}")
        if all(s and s["events"] and s["events"][-1]["count"] == count for s in states.values()):
            return states
        if time.monotonic() > deadline:
            seen = {
                k: (s["events"][-1]["count"] if s and s["events"] else None)
                for k, s in states.items()
            }
            raise BenchError(
                f"{what}: not every process reached {count} ranks within {timeout_s:g} s "
                f"(last counts {seen})"
            )
        time.sleep(0.05)


def first_event(state: dict, count: int, after: float) -> dict | None:
    for e in state["events"]:
        if e["count"] == count and e["t_end"] > after:
            return e
    return None


def victims_for(scenario: str, world: int, reps: int) -> list[int]:
    """Which rank fails in each repetition: rank 0 in some, spread over the others."""
    order = [1, 0, world - 1, 2, 0, world - 2] if scenario != "hang" else [2, 0, world - 1, 1]
    return [order[i % len(order)] for i in range(reps)]


def scenario_env(scenario: str, args) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["MOONCAKE_TRANSPORT"] = "tcp" if scenario == "kill-tcp" else "auto"
    if scenario == "hang":
        env["MOONCAKE_HANG_MS"] = str(args.hang_ms)
    return env


def run_scenario(scenario: str, world: int, reps: int, args) -> dict:
    """One group of ``world`` ranks; ``reps`` faults, each followed by a replacement."""
    from mooncake.launch import LocalGroup

    started = time.time()
    env = scenario_env(scenario, args)
    stamp_dir = tempfile.mkdtemp(prefix="mc-recovery-")
    cfg = {"op_timeout_s": args.op_timeout, "stamp_dir": stamp_dir, "incarnation": 0}
    kind = "stop" if scenario == "hang" else "kill"
    out: dict = {
        "scenario": scenario,
        "world": world,
        "env": env,
        "op_timeout_s": args.op_timeout,
        "faults": [],
        "joins": [],
        "problems": [],
        "error": None,
    }
    incarnation = dict.fromkeys(range(world), 0)
    live = {r: rank_key(r, 0) for r in range(world)}
    # A replacement in a deployment is a fresh interpreter: measure that, not a fork.
    group = LocalGroup(world, env, start_method="spawn")
    store = group.store
    try:
        store.set("ctl", "busy")
        group.start(member, args=(cfg,))
        wait_counts(group, store, list(live.values()), world, args.launch_timeout, "launch")
        out["launch_s"] = round(time.time() - started, 2)
        log(f"# {scenario} world {world}: launched in {out['launch_s']:.1f} s")
        for rep, victim in enumerate(victims_for(scenario, world, reps)):
            # --- the fault, in the busy loop ---
            store.set("ctl", "busy")
            time.sleep(args.settle)
            vkey = live[victim]
            survivors = [k for r, k in live.items() if r != victim]
            store.set(f"fault/{vkey}", kind)
            states = wait_counts(
                group, store, survivors, world - 1, args.fault_timeout, f"{kind} {vkey}"
            )
            t_fault = read_stamp(stamp_dir, vkey)
            if t_fault is None:
                raise BenchError(f"{kind} {vkey}: no time stamp was written")
            per = {}
            for k in survivors:
                e = first_event(states[k], world - 1, t_fault)
                if e is None:
                    raise BenchError(
                        f"{kind} {vkey}: {k} has no op over {world - 1} ranks after it"
                    )
                per[k] = {
                    "ms": (e["t_end"] - t_fault) * 1e3,
                    "op_started_ms": (e["t_start"] - t_fault) * 1e3,
                    "busy_op_us": e["busy_op_us"],
                    "active": e["active"],
                }
            slowest = max(per, key=lambda k: per[k]["ms"])
            fault = {
                "scenario": scenario,
                "world": world,
                "rep": rep,
                "victim": victim,
                "victim_key": vkey,
                "signal": "SIGKILL" if kind == "kill" else "SIGSTOP",
                "t_fault": t_fault,
                "survivors": per,
                "slowest_ms": per[slowest]["ms"],
                "slowest_key": slowest,
                "busy_op_us": max((p["busy_op_us"] or 0.0) for p in per.values()) or None,
            }
            expected_active = [0 if r == victim else 1 for r in range(world)]
            wrong = [k for k, p in per.items() if p["active"] != expected_active]
            if wrong:
                fault["wrong_active"] = {k: per[k]["active"] for k in wrong}
                out["problems"].append(
                    f"{scenario} world {world} rep {rep}: get_active_ranks after the failure of "
                    f"rank {victim} is wrong on {wrong}: {fault['wrong_active']}"
                )
            log(
                f"#   rep {rep}: {fault['signal']} rank {victim} -> survivors' next op after "
                f"{fault['slowest_ms']:.1f} ms (slowest: {slowest}; loop before it: "
                f"{fault['busy_op_us'] or 0:.0f} us/op)"
            )
            if kind == "stop":
                fault["resumed"] = resume_stopped(group, store, vkey, args)
                if not fault["resumed"]["learned"]:
                    out["problems"].append(
                        f"{scenario} world {world} rep {rep}: the stopped rank {vkey}, resumed, "
                        f"did not fail with a left-out error: {fault['resumed']}"
                    )
            out["faults"].append(fault)

            # --- the replacement, with the members idling ---
            store.set("ctl", "idle")
            incarnation[victim] += 1
            rcfg = dict(cfg, incarnation=incarnation[victim])
            t_spawn = time.time()
            (nkey,) = group.start(member, ranks=[victim], args=(rcfg,))
            if nkey != rank_key(victim, incarnation[victim]):
                raise BenchError(
                    f"LocalGroup named the replacement {nkey}, expected "
                    f"{rank_key(victim, incarnation[victim])}"
                )
            live[victim] = nkey
            states = wait_counts(
                group, store, list(live.values()), world, args.join_timeout, f"join {nkey}"
            )
            out["joins"].append(join_record(scenario, world, rep, nkey, t_spawn, t_fault, states))
            j = out["joins"][-1]
            log(
                f"#   rep {rep}: replacement {nkey}: start -> ready {j['start_to_ready_ms']:.0f} ms"
                f" (import {j['import_ms']:.0f}), join_group -> full-strength op "
                f"{j['join_to_full_ms']:.1f} ms"
            )
        # --- the end: every member stops at the same op ---
        store.set("ctl", "stop")
        deadline = time.monotonic() + 30
        for k in live.values():
            while not store.check([f"result/{k}"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            result = harness.store_json(store, f"result/{k}")
            if result is None:
                raise BenchError(f"process {k} did not finish after the stop order")
            if "error" in result:
                raise BenchError(f"process {k} failed: {result['traceback']}")
        out["final_states"] = {k: harness.store_json(store, f"result/{k}") for k in live.values()}
        out["problems"] += check_membership(store, scenario, world, incarnation)
        out["growth"] = resource_growth(out["final_states"])
    except BenchError as e:
        out["error"] = str(e)
        log(f"# {scenario} world {world}: ERROR {e}")
        out["at_error"] = diagnose(group, store, stamp_dir, incarnation)
    finally:
        # Stop whatever still runs (a failed scenario), then release the group.
        store.set("ctl", "stop")
        group.close()
        for p in Path(stamp_dir).iterdir():
            p.unlink()
        os.rmdir(stamp_dir)
    out["wall_s"] = round(time.time() - started, 1)
    return out


def resource_growth(final_states: dict) -> dict | None:
    """The longest-lived process's fds, threads and RSS: at its third membership change
    (after the first failure and replacement it saw: connections to a new process made
    once) and at its last; None when no process saw four changes."""
    best = None
    for key, st in final_states.items():
        samples = [e["res"] for e in st["events"] if "res" in e]
        if len(samples) >= 4 and (best is None or len(samples) > best["changes"]):
            best = {"key": key, "changes": len(samples), "from": samples[2], "to": samples[-1]}
    return best


def growth_line(g: dict) -> str:
    grow = g["growth"]
    a, b = grow["from"], grow["to"]
    return (
        f"Resources, {g['scenario']} world {g['world']}: process {grow['key']}, the "
        f"longest-lived, went through {grow['changes']} membership changes; from its third to its "
        f"last: fds {a['fds']} -> {b['fds']}, threads {a['threads']} -> {b['threads']}, RSS "
        f"{a['rss_kib']} -> {b['rss_kib']} KiB."
    )


def diagnose(group, store, stamp_dir: str, incarnation: dict[int, int]) -> dict:
    """After a failure: every process's published state, and the Python stacks of those
    still running without a result (they dump them on SIGUSR1)."""
    found: dict = {}
    for rank, last in incarnation.items():
        for inc in range(last + 1):
            key = rank_key(rank, inc)
            result = harness.store_json(store, f"result/{key}")
            found[key] = {"result": result, "state": harness.store_json(store, f"state/{key}")}
            found[key]["status"] = exit_status(group.pid(key)) or "running"
            if result is None and found[key]["status"] == "running":
                group.kill(key, signal.SIGUSR1)
                found[key]["running"] = True
    time.sleep(1.0)
    for key, entry in found.items():
        path = Path(stamp_dir, f"{key}.stacks")
        if entry.get("running") and path.exists():
            entry["stacks"] = path.read_text()
            log(f"# {key} has not finished; its threads:\n{entry['stacks']}")
    return found


def check_membership(store, scenario: str, world: int, incarnation: dict[int, int]) -> list[str]:
    """Every process's ops must have run over all ranks or all but the failed one, in turn.

    Anything else (a live rank taken for failed, say) is reported as a problem.
    """
    problems = []
    for rank, last in incarnation.items():
        for inc in range(last + 1):
            key = rank_key(rank, inc)
            state = harness.store_json(store, f"state/{key}")
            counts = [e["count"] for e in state["events"]] if state else []
            expected = [world if i % 2 == 0 else world - 1 for i in range(len(counts))]
            if counts != expected:
                problems.append(
                    f"{scenario} world {world}: process {key} saw its ops run over {counts} ranks "
                    f"in turn (expected {world} and {world - 1} alternating)"
                )
    return problems


def resume_stopped(group, store, key: str, args) -> dict:
    """SIGCONTs a stopped rank that the others left out; it must fail its op and say so."""
    t_cont = time.time()
    group.kill(key, signal.SIGCONT)
    deadline = time.monotonic() + args.op_timeout + 5
    while not store.check([f"result/{key}"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    result = harness.store_json(store, f"result/{key}")
    if result is None:
        group.kill(key)  # SIGKILL: it did not learn in time
        log(f"#   resumed {key}: no error within {args.op_timeout + 5:.0f} s; killed it")
        return {"learned": False, "killed": True}
    learned = {
        "learned": "error" in result,
        "after_ms": (result.get("t_error", time.time()) - t_cont) * 1e3,
        "error": result.get("error", "(returned normally)"),
    }
    log(f"#   resumed {key}: failed after {learned['after_ms']:.0f} ms: {learned['error'][:160]}")
    return learned


def join_record(
    scenario: str, world: int, rep: int, key: str, t_spawn: float, t_fault: float, states: dict
) -> dict:
    info = states[key]["info"]
    t_join = info["t_join_call"]
    firsts = {k: first_event(s, world, t_fault) for k, s in states.items()}
    full = {k: (e["t_end"] - t_join) * 1e3 for k, e in firsts.items()}
    admits = [a for k, s in states.items() if k != key for a in s["admits"] if a["t_end"] > t_fault]
    return {
        "scenario": scenario,
        "world": world,
        "rep": rep,
        "rank": int(key.split(".")[0]),
        "key": key,
        "start_to_ready_ms": (info["t_ready"] - t_spawn) * 1e3,
        "spawn_to_entry_ms": (info["t_entry"] - t_spawn) * 1e3,
        "import_ms": (info["t_import"] - info["t_entry"]) * 1e3,
        "init_ms": (info["t_ready"] - info["t_import"]) * 1e3,
        "join_group_ms": (info["t_joined"] - t_join) * 1e3,
        "join_to_full_ms": max(full.values()),
        "per_rank_full_ms": full,
        "recover_ranks_ms": max(((a["t_end"] - a["t_start"]) * 1e3 for a in admits), default=None),
        # when the members' successful get_peer_state started, after the newcomer was ready,
        # and how many of their polls in between found no one waiting
        "ready_to_admit_poll_ms": min(
            ((a["t_poll"] - info["t_ready"]) * 1e3 for a in admits), default=None
        ),
        "empty_polls_after_ready": max(
            (sum(1 for t in a["last_polls"] if t > info["t_ready"]) for a in admits), default=None
        ),
        "admitted_before_join_call": bool(admits) and min(a["t_end"] for a in admits) < t_join,
    }


# --- summary --------------------------------------------------------------------------


def stats(values: list[float]) -> dict:
    """Over repetitions; p99 is the nearest rank (with fewer than 100 values, the maximum)."""
    keys = {"n": "n", "median_ms": "median", "p99_ms": "p99", "max_ms": "max", "min_ms": "min"}
    return {**harness.summarize(values, keys), "values_ms": [round(v, 2) for v in values]}


def summarize(groups: list[dict], args) -> list[dict]:
    """Table rows: per measure and world size, median and max over repetitions."""
    hang = f"hang {args.hang_ms} ms, timeout {args.op_timeout:g} s"
    hang_target = args.op_timeout * 1e3 + 500
    shm, tcp = ("kill", "hang"), ("kill-tcp",)
    # (measure, the scenarios it pools, part, field, target in ms)
    measures = [
        ("kill -9 → survivors' next op (shm)", ("kill",), "faults", "slowest_ms", KILL_TARGET_MS),
        ("kill -9 → survivors' next op (tcp)", tcp, "faults", "slowest_ms", KILL_TARGET_MS),
        (f"SIGSTOP → survivors' next op ({hang})", ("hang",), "faults", "slowest_ms", hang_target),
        ("SIGCONT → the stopped rank's op fails (left out)", ("hang",), "faults", "resumed", None),
        (
            "join_group() → full-strength op on every rank (shm)",
            shm,
            "joins",
            "join_to_full_ms",
            None,
        ),
        (
            "join_group() → full-strength op on every rank (tcp)",
            tcp,
            "joins",
            "join_to_full_ms",
            None,
        ),
        (
            "replacement start → ready (init_process_group)",
            SCENARIOS,
            "joins",
            "start_to_ready_ms",
            None,
        ),
        ("… of which importing torch + mooncake", SCENARIOS, "joins", "import_ms", None),
    ]
    worlds = sorted({g["world"] for g in groups})
    rows = []
    for name, scenarios, part, field, target in measures:
        for world in worlds:
            recs = [
                rec
                for g in groups
                if g["world"] == world and g["scenario"] in scenarios
                for rec in g[part]
            ]
            if field == "resumed":
                values = [r["resumed"].get("after_ms") for r in recs if "resumed" in r]
                values = [v for v in values if v is not None]
            else:
                values = [r[field] for r in recs]
            if not values:
                continue
            row = {"measure": name, "world": world, **stats(values), "target_ms": target}
            row["met"] = None if target is None else row["max_ms"] <= target
            row["rank0"] = sum(1 for r in recs if r.get("victim", r.get("rank")) == 0)
            rows.append(row)
    return rows


def fmt_ms(v: float | None) -> str:
    return fmt_fixed(v, 1e4)


def markdown_table(rows: list[dict], meta: dict, problems: list[str], errors: list[dict]) -> str:
    lines = [
        f"mooncake-cpu on one host ({meta['cores']} cores), {meta['worlds_note']}, "
        f"{meta['started']}, library {meta['mooncake']['commit']}; load average "
        f"{meta['loadavg_start'][0]:.1f} at the start, {meta['loadavg_end'][0]:.1f} at the end; "
        f"{meta['duration_s']:.0f} s in all. Times are `time.time()` taken in the ranks; a "
        "repetition's time is its slowest rank's; `rank 0` counts the repetitions in which "
        "rank 0 was the one that failed (or was replaced).",
        "",
    ]
    header = ["measure", "world", "reps", "rank 0", "median (ms)", "p99 (ms)", "max (ms)"]
    header += ["target (ms)", "met"]
    table = [
        [
            r["measure"],
            str(r["world"]),
            str(r["n"]),
            str(r["rank0"]),
            *(fmt_ms(r[k]) for k in ("median_ms", "p99_ms", "max_ms", "target_ms")),
            "" if r["met"] is None else ("yes" if r["met"] else "**no**"),
        ]
        for r in rows
    ]
    lines += harness.markdown_table(header, table, "l" + "r" * 7 + "l")
    loops = ", ".join(f"{k} {v:.0f} µs" for k, v in meta["busy_op_us"].items())
    lines += [
        "",
        f"Before each fault the survivors ran back-to-back 12-byte all_reduce (per op: {loops}).",
        "",
    ]
    lines += [f"{line}\n" for line in meta.get("growth", [])]
    lines += [
        f"For comparison: {UPSTREAM['text']}.",
    ]
    lines += [f"\nPROBLEM: {p}" for p in problems]
    lines += [f"\nERROR: {e['scenario']} world {e['world']}: {e['error']}" for e in errors]
    return "\n".join(lines) + "\n"


def print_table(rows: list[dict]) -> None:
    say()
    say(
        f"# {'measure':<56} {'world':>5} {'reps':>4} {'rank0':>5} {'median':>8} {'p99':>8} "
        f"{'max':>8} {'target':>8}"
    )
    say(f"# {'':<56} {'':>5} {'':>4} {'':>5} {'(ms)':>8} {'(ms)':>8} {'(ms)':>8} {'(ms)':>8}")
    for r in rows:
        met = "" if r["met"] is None else ("  met" if r["met"] else "  MISS")
        say(
            f"  {r['measure']:<56} {r['world']:>5} {r['n']:>4} {r['rank0']:>5} "
            f"{fmt_ms(r['median_ms']):>8} {fmt_ms(r['p99_ms']):>8} {fmt_ms(r['max_ms']):>8} "
            f"{fmt_ms(r['target_ms']):>8}{met}"
        )
    say(f"# for comparison: {UPSTREAM['text']}")


# --- main -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = harness.arg_parser(
        "Recovery benchmark of mooncake-cpu: kill -9, SIGSTOP and rejoin (see bench/README.md).",
        world_sizes="4,8",
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated scenarios")
    p.add_argument("--reps", type=int, default=5, help="faults per kill scenario and world size")
    p.add_argument(
        "--hang-reps", type=int, default=3, help="faults per hang / kill-tcp scenario and world"
    )
    p.add_argument("--op-timeout", type=float, default=10.0, help="backend op timeout, seconds")
    p.add_argument("--hang-ms", type=int, default=500, help="MOONCAKE_HANG_MS for hang")
    p.add_argument(
        "--settle", type=float, default=0.2, help="seconds of busy loop before each fault"
    )
    p.add_argument("--launch-timeout", type=float, default=90, help="seconds for a launch")
    p.add_argument("--fault-timeout", type=float, default=40, help="seconds for a recovery")
    p.add_argument("--join-timeout", type=float, default=60, help="seconds for a replacement")
    harness.add_output_args(p, "world 4, 3 kills, 2 hangs, 2 tcp kills: under a minute")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = harness.parse_args(parser, argv, {"world_sizes": "4"}, {"reps": 3, "hang_reps": 2})
    worlds = sorted(set(harness.csv_ints(args.world_sizes)))
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        parser.error(f"unknown scenario {', '.join(bad)}; choose from {', '.join(SCENARIOS)}")
    if not worlds or min(worlds) < 3:
        parser.error("world sizes must be >= 3 (rank 2 is among the victims)")

    started = time.time()
    load_start = os.getloadavg()
    cores = os.cpu_count()
    log(f"# recovery benchmark on {cores} cores; load average at start {load_start[0]:.2f}")
    groups = []
    for world in worlds:
        for scenario in scenarios:
            reps = args.reps if scenario == "kill" else args.hang_reps
            log(f"# {scenario}, world {world}: {reps} faults, each followed by a replacement ...")
            groups.append(run_scenario(scenario, world, reps, args))
    rows = summarize(groups, args)
    problems = [p for g in groups for p in g["problems"]]
    errors = [
        {"scenario": g["scenario"], "world": g["world"], "error": g["error"]}
        for g in groups
        if g["error"]
    ]
    meta = {
        **harness.run_meta(started, cores, load_start, args),
        "check_s": CHECK_S,
        "idle_sleep_s": IDLE_SLEEP_S,
        "worlds_note": f"world {' and '.join(map(str, worlds))}"
        + (" (--quick)" if args.quick else ""),
        "method": "see the module docstring and bench/README.md, 'Recovery benchmark'",
        "growth": [growth_line(g) for g in groups if g.get("growth")],
        "busy_op_us": {
            f"{g['scenario']} world {g['world']}": round(
                statistics.median(f["busy_op_us"] for f in g["faults"] if f["busy_op_us"]), 1
            )
            for g in groups
            if any(f["busy_op_us"] for f in g["faults"])
        },
    }
    print_table(rows)
    for line in meta["growth"]:
        say(f"# {line}")
    for p in problems:
        say(f"# PROBLEM: {p}")
    for e in errors:
        say(f"# ERROR: {e['scenario']} world {e['world']}: {e['error']}")
    document = {
        "meta": meta,
        "upstream": UPSTREAM,
        "targets": {
            "kill_ms": KILL_TARGET_MS,
            "hang_ms": args.op_timeout * 1e3 + 500,
            "hang_expected": "about MOONCAKE_HANG_MS + agreement",
        },
        "summary": rows,
        "problems": problems,
        "errors": errors,
        "groups": groups,
    }
    files = {
        "recovery.json": document,
        "recovery_table.md": markdown_table(rows, meta, problems, errors),
    }
    say(f"# {harness.write_outputs(args.out_dir, files)}")
    log(f"# total {time.time() - started:.0f} s")
    return 1 if errors or problems else 0


if __name__ == "__main__":
    sys.exit(main())
