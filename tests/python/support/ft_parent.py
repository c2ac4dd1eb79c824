"""Parent-side helpers of the fault-tolerance tests: environments, failure plans, waiting
on ranks, and the checks of what the ranks recorded (see ft_ranks.py for the records)."""

from __future__ import annotations

import random
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from ft_ranks import KINDS, MASK_KINDS, ROOTED_KINDS, bits, elastic_rank, ranks_of
from mooncake.launch import LocalGroup

# Every variable the tests depend on is set explicitly, so a MOONCAKE_* variable in the
# caller's environment does not change what a test means.
BASE_ENV = {
    "MOONCAKE_RECOVER": "1",
    "MOONCAKE_HANG_MS": "2000",
    "MOONCAKE_TRANSPORT": "auto",
    "MOONCAKE_PG_TIMEOUT_MS": "0",
    "MOONCAKE_CHUNK_BYTES": "262144",
    "MOONCAKE_SMALL_MSG_BYTES": "65536",
    "OMP_NUM_THREADS": "1",
}
# Small message slots, so that the modest tensors of ft_ranks take many chunks.
CHUNKED = {"MOONCAKE_CHUNK_BYTES": "4096", "MOONCAKE_SMALL_MSG_BYTES": "2048"}


def env(*parts: dict[str, str], **extra: str) -> dict[str, str]:
    out = dict(BASE_ENV)
    for p in parts:
        out.update(p)
    out.update(extra)
    return out


def wait_key(group: LocalGroup, key: str, timeout_s: float = 120.0, extra=None, setters=()) -> bool:
    """Waits until a rank sets ``key`` in the launch's store; on timeout, raises with what
    the ranks reported (a rank that failed early shows its traceback). With ``extra`` (a
    launch's), never waits past the launch's deadline. ``setters``: the ranks that would
    set it; once all of them have ended without setting it, returns False at once (their
    records tell why) instead of waiting out the launch."""
    deadline = time.monotonic() + timeout_s
    if extra is not None:
        deadline = min(deadline, extra["deadline"])
    while not group.store.check([key]):
        if setters and all(group.exited(str(r)) for r in setters):
            return group.store.check([key])
        if time.monotonic() > deadline:
            try:
                group.results(timeout_s=3)
            except RuntimeError as e:
                raise TimeoutError(f"store key {key!r} not set within {timeout_s} s; {e}") from e
            raise TimeoutError(f"store key {key!r} not set within {timeout_s} s")
        time.sleep(0.005)
    return True


def wait_keys(group: LocalGroup, keys, timeout_s: float = 120.0, extra=None) -> None:
    deadline = time.monotonic() + timeout_s
    for key in keys:
        wait_key(group, key, max(0.1, deadline - time.monotonic()), extra)


def is_gone(pid: int) -> bool:
    """Whether a child has exited (a zombie counts: it is not reaped, so its pid is safe)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or the read
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not is_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def mark_dead(group: LocalGroup, key: str, timeout_s: float = 10.0) -> None:
    """For a rank that kills itself: waits for it to be gone, then tells the group (kill
    -9 of a zombie is harmless), so that ``results`` does not wait for it."""
    gone = wait_gone(group.pid(key), timeout_s)
    try:
        group.kill(key)
    except ProcessLookupError:
        pass
    assert gone, f"process {key} armed its own kill but was still alive after {timeout_s} s"


@dataclass
class Launch:
    """What a launch produced, for tests that share one launch through a fixture."""

    results: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def get(self) -> dict[str, Any]:
        if self.error is not None:
            raise AssertionError(f"the launch failed:\n{self.error[-6000:]}")
        return self.results


def launch(world_size, fn, plan, env_vars, conduct=None, timeout_s=120.0, **where) -> Launch:
    """Starts ``fn(rank, world_size, port, plan)`` on every rank, runs ``conduct(group,
    extra)`` in the parent (kills, stops, replacements), and collects the results.
    ``where``: ``LocalGroup``'s ``placement`` and ``store_host`` (ranks on other hosts)."""
    out = Launch()
    t0 = time.monotonic()
    out.extra["deadline"] = t0 + timeout_s
    try:
        with LocalGroup(world_size, env=env_vars, **where) as group:
            group.start(fn, args=(plan,))
            if conduct is not None:
                conduct(group, out.extra)
            out.results = group.results(timeout_s=max(1.0, timeout_s - (time.monotonic() - t0)))
    except Exception as e:  # noqa: BLE001  (reported by the tests that use it)
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - t0
    return out


# --- chaos plans -------------------------------------------------------------------------

TIMER_KIND = {
    "in_small": "ar",
    "in_big": "ar_big",
    "in_p2p": "p2p",
    "in_ag": "ag",
    "in_a2a": "a2a",
    "in_ep": "ep",
}
STOPS = ("stop", "stop_between")


def chaos_plan(
    seed: int,
    events,
    kinds=KINDS,
    timeout_s=15.0,
    detect_bound_s=8.0,
    phase_limit_s=40.0,
    warmup_rounds=2,
):
    """``events``: ``(victims, mode)`` or ``(victims, mode, (min_gap_s, max_gap_s))``.

    Modes: ``random`` (the parent kills at a random time), ``between`` (right after an
    op), ``in_small`` / ``in_big`` / ``in_p2p`` / ``in_ag`` / ``in_a2a`` (a timer inside
    that kind of op), ``stop`` (the parent sends SIGSTOP at a random time, and SIGCONT once
    the others moved on), ``stop_between`` (the same, between two ops of the victim),
    ``slow`` (the parent stops the rank for 0.3-0.8 s, well under the tests'
    MOONCAKE_HANG_MS of 2 s, at a random moment of the phase's first round: a slow rank,
    not a failed one, which must not be left out; the phase removes nobody).
    Several victims: the parent kills them a random gap apart.
    """
    rng = random.Random(seed)
    n = len(kinds)
    out = []
    for victims, mode, *gap in events:
        ev = {"victims": list(victims), "label": mode}
        if mode in TIMER_KIND:
            assert len(victims) == 1, mode
            ev.update(
                mode="timer",
                arm_at=kinds.index(TIMER_KIND[mode]) + n * rng.randint(0, 1),
                delay_frac=rng.uniform(0.05, 0.9),
            )
        elif mode == "between":
            assert len(victims) == 1, mode
            ev.update(mode="between", arm_at=rng.randrange(2 * n))
        elif mode == "slow":
            assert len(victims) == 1, mode
            ev.update(
                victims=[],
                slowed=list(victims),
                mode="slow",
                # Within the phase's first round: the phase ends one round after the
                # first op over everyone, so a later op might never come.
                arm_at=rng.randrange(n),
                delay_s=rng.uniform(0, 0.05),
                slow_s=rng.uniform(0.3, 0.8),
            )
        elif mode == "stop_between":
            assert len(victims) == 1, mode
            ev.update(mode="pause", arm_at=rng.randrange(2 * n), pause_s=1.5, delay_s=0.1)
        else:
            assert mode in ("random", "stop"), mode
            ev.update(
                mode="parent",
                arm_at=rng.randrange(2 * n),
                delay_s=rng.uniform(0, 0.05),
                gap_s=rng.uniform(*gap[0]) if gap else 0.0,
            )
        out.append(ev)
    return {
        "kinds": tuple(kinds),
        "timeout_s": timeout_s,
        "detect_bound_s": detect_bound_s,
        "phase_limit_s": phase_limit_s,
        "warmup_rounds": warmup_rounds,
        "events": out,
        "seed": seed,
    }


def conduct_chaos(plan):
    """The parent's part of a chaos launch: arms, kills, stops and resumes."""

    def conduct(group: LocalGroup, extra):
        world = group.world_size
        members = set(range(world))
        extra["kills"] = []
        for e, ev in enumerate(plan["events"], start=1):
            survivors = members - set(ev["victims"])
            setters = ev["victims"] or ev.get("slowed", [])
            if not wait_key(group, f"arm/{e}", 180, extra, setters=setters):
                extra["unarmed"] = e  # check_chaos reports what the victims did instead
                return
            if ev["mode"] == "slow":
                time.sleep(ev["delay_s"])
                for v in ev["slowed"]:
                    group.kill(v, signal.SIGSTOP)
                time.sleep(ev["slow_s"])
                for v in ev["slowed"]:
                    group.kill(v, signal.SIGCONT)
                group.store.set(f"resumed/{e}", "1")
                extra.setdefault("slows", []).append((e, ev["slowed"], ev["slow_s"]))
            elif ev["mode"] in ("parent", "pause"):
                time.sleep(ev["delay_s"])
                sig = signal.SIGSTOP if ev["label"] in STOPS else signal.SIGKILL
                for k, v in enumerate(ev["victims"]):
                    if k:
                        time.sleep(ev.get("gap_s", 0.0))
                    try:
                        group.kill(v, sig)
                    except ProcessLookupError:  # already gone: the checks will tell
                        pass
                    extra["kills"].append((e, v, time.monotonic()))
                if ev["label"] in STOPS:
                    wait_keys(group, [f"done/{e}/{r}" for r in sorted(survivors)], 180, extra)
                    for v in ev["victims"]:
                        group.kill(v, signal.SIGCONT)
            else:
                for v in ev["victims"]:
                    mark_dead(group, str(v))
            members = survivors

    return conduct


# --- checks ------------------------------------------------------------------------------

_RANK_RE = re.compile(r"\brank (\d+)\b")
_ERROR_RE = re.compile(r"^(\w+)(?: ranks=\[([\d, ]*)\])?: ")


def names_rank(message: str, rank: int) -> bool:
    return str(rank) in _RANK_RE.findall(message)


def error_of(detail: str) -> tuple[str, list[int] | None]:
    """The exception class and ``.ranks`` (None for other classes) of a record's
    ``"Type: message"`` (see ``ft_ranks.describe``)."""
    m = _ERROR_RE.match(detail)
    if m is None:
        return ("?", None)
    ranks = m.group(2)
    if ranks is None:
        return (m.group(1), None)
    return (m.group(1), [int(r) for r in ranks.split(",") if r.strip()])


def check_chaos(results: dict[str, Any], world: int, plan) -> list[str]:
    """Checks the records of a chaos launch; returns the problems found (empty: passed).

    * the survivors return, with identical op sequences, and agree op by op on status,
      root and (for ops every rank can read it from) the set of ranks covered;
    * every set covers every survivor, lies within the phase's starting set, and never
      grows within a phase; each phase ends with a full round of ops over exactly the
      survivors (the failure was noticed and every kind of op works among them);
    * errors: a rooted op raises only when its root is a victim, on every survivor, with a
      PeerFailedError naming the root (``.ranks == [root]``); p2p raises only with a
      victim, naming it (a PeerFailedError with ``.ranks == [victim]``, or a
      TimeoutError), in time; no op returns wrong data;
    * each phase converged in time; ``active_ranks`` and ``get_num_synced_ranks`` match;
    * a stopped rank (mode ``stop``) agrees with the survivors on every op it completed,
      and learns it was left out (a LeftOutError with ``.ranks == [itself]``);
    * a slowed rank (mode ``slow``) is an ordinary survivor: left out of nothing, every
      op of its phase over everyone (the rules above, with nobody removed);
    * on CUDA tensors (``plan["device"] == "cuda"``), every survivor's device plane served
      ops both in the warm-up and after it (``pg.get_op_paths``).
    """
    problems: list[str] = []
    events = plan["events"]
    stopped = {v for ev in events if ev["label"] in STOPS for v in ev["victims"]}
    victims = {v for ev in events for v in ev["victims"]}
    survivors = sorted(set(range(world)) - victims)
    sets = [set(range(world))]
    for ev in events:
        sets.append(sets[-1] - set(ev["victims"]))
    got = sorted(int(k) for k in results)
    expected_keys = sorted(set(survivors) | stopped)
    if got != expected_keys:
        problems.append(f"results from ranks {got}, expected {expected_keys}")
        for r in sorted(set(got) - set(expected_keys)):
            tail = results[str(r)]["log"][-3:]
            problems.append(f"rank {r}, a victim, returned; its last records: {tail}")
    logs = {r: results[str(r)]["log"] for r in survivors if str(r) in results}
    if not logs:
        return problems + ["no survivor returned"]
    if plan.get("device") == "cuda":
        for r in logs:
            warm, end = results[str(r)]["op_paths"]
            if not 0 < warm["device"] < end["device"]:
                problems.append(
                    f"rank {r}: device plane ops {warm} after warm-up, {end} at the end"
                )
    ref_rank = min(logs)
    ref = logs[ref_rank]
    for r, log in logs.items():
        shape = [(p, i, rec[0]) for p, i, rec in log]
        ref_shape = [(p, i, rec[0]) for p, i, rec in ref]
        if shape != ref_shape:
            common = min(len(shape), len(ref_shape))
            first = next((k for k in range(common) if shape[k] != ref_shape[k]), common)
            problems.append(
                f"rank {r} ran a different op sequence than rank {ref_rank} ({len(shape)} vs "
                f"{len(ref_shape)} ops; first difference at op {first})"
            )
    if problems:
        return problems
    last_mask: dict[int, int] = {}
    for k, (p, i, rec0) in enumerate(ref):
        kind = rec0[0]
        before, after = sets[max(p - 1, 0)], sets[p]
        recs = {r: logs[r][k][2] for r in logs}
        where = f"phase {p} op {i} ({kind})"
        for r, rec in recs.items():
            if rec[1] == "bad":
                problems.append(f"{where}: rank {r} got wrong data: {rec[4]}")
            if rec[1] == "err" and kind != "p2p":
                if error_of(rec[4])[0] != "PeerFailedError":
                    problems.append(f"{where}: rank {r} raised {rec[4]!r} (want PeerFailedError)")
        if kind == "p2p":
            for r, rec in recs.items():
                if rec[1] != "err":
                    continue
                for direction, peer, msg in rec[4][2]:
                    if peer in after:
                        problems.append(
                            f"{where}: rank {r} {direction} with live rank {peer} failed: {msg}"
                        )
                    elif not names_rank(msg, peer):
                        problems.append(
                            f"{where}: rank {r} {direction} with dead rank {peer}: the error "
                            f"does not name it: {msg}"
                        )
                    elif error_of(msg) not in (("PeerFailedError", [peer]), ("TimeoutError", None)):
                        problems.append(
                            f"{where}: rank {r} {direction} with dead rank {peer}: want "
                            f"PeerFailedError with ranks [{peer}] or TimeoutError: {msg}"
                        )
                if rec[4][3] > plan["timeout_s"] + 5:
                    problems.append(f"{where}: rank {r} p2p took {rec[4][3]:.1f} s")
            continue
        statuses = {r: (rec[1], rec[2]) for r, rec in recs.items()}
        if len(set(statuses.values())) > 1:
            problems.append(f"{where}: survivors disagree on status/root: {statuses}")
            continue
        status, root = next(iter(statuses.values()))
        if status == "err":
            if kind not in ROOTED_KINDS or root in after:
                problems.append(f"{where}: raised on the survivors: {next(iter(recs.values()))[4]}")
            else:
                for r, rec in recs.items():
                    if not names_rank(rec[4], root) or error_of(rec[4])[1] != [root]:
                        problems.append(
                            f"{where}: rank {r}'s error does not name root {root} (in its "
                            f"message and .ranks): {rec[4]}"
                        )
        masks = {r: rec[3] for r, rec in recs.items() if rec[3] is not None}
        if kind in MASK_KINDS and status == "ok" and len(set(masks.values())) > 1:
            problems.append(
                f"{where}: survivors got results over different sets: "
                + ", ".join(f"rank {r}: {ranks_of(m)}" for r, m in masks.items())
            )
        for r, m in masks.items():
            if m & bits(after) != bits(after) or m & ~bits(before):
                problems.append(
                    f"{where}: rank {r}'s result covers {ranks_of(m)}; the survivors are "
                    f"{sorted(after)}, the phase started with {sorted(before)}"
                )
            if p in last_mask and m & ~last_mask[p]:
                problems.append(
                    f"{where}: rank {r}'s result covers {ranks_of(m)}, more than an earlier op "
                    f"of the phase ({ranks_of(last_mask[p])})"
                )
        for m in masks.values():
            last_mask[p] = m & last_mask.get(p, m)
    # Each phase ends with a full round over exactly the survivors.
    n = len(plan["kinds"])
    for p in range(1, len(sets)):
        tail = [rec for q, _, rec in ref if q == p][-n:]
        if len(tail) < n:
            problems.append(f"phase {p}: only {len(tail)} ops")
            continue
        for rec in tail:
            if rec[1] == "skip" and rec[0] == "p2p" and len(sets[p]) < 2:
                continue
            if rec[1] != "ok" or (rec[0] in MASK_KINDS and rec[3] != bits(sets[p])):
                problems.append(
                    f"phase {p}: after convergence, {rec[0]} gave {rec[1]} "
                    f"{ranks_of(rec[3]) if rec[3] is not None else rec[4]} "
                    f"(want every op ok over {sorted(sets[p])})"
                )
    final = sets[-1]
    want_active = [1 if r in final else 0 for r in range(world)]
    for r in logs:
        res = results[str(r)]
        if res["active"] != want_active:
            problems.append(f"rank {r}: active_ranks {res['active']}, want {want_active}")
        if res["synced"] != len(final):
            problems.append(f"rank {r}: get_num_synced_ranks {res['synced']}, want {len(final)}")
        if len(res["phase_s"]) != len(events):
            problems.append(f"rank {r}: converged in {len(res['phase_s'])} of {len(events)} phases")
        for p, s in enumerate(res["phase_s"], start=1):
            if s > plan["detect_bound_s"]:
                problems.append(
                    f"rank {r}: phase {p} ({events[p - 1]['label']}) took {s:.2f} s to converge "
                    f"(bound {plan['detect_bound_s']} s)"
                )
    # A stopped rank: whatever it completed agrees with the survivors; then it is left out.
    index = {(p, i): rec for p, i, rec in ref}
    for v in stopped:
        if str(v) not in results:
            continue
        log = results[str(v)]["log"]
        last = log[-1][2] if log else None
        if (
            last is None
            or last[1] != "err"
            or "left out" not in last[4]
            or error_of(last[4]) != ("LeftOutError", [v])
        ):
            problems.append(
                f"stopped rank {v}: its last op did not raise LeftOutError with ranks [{v}] "
                f"saying it was left out: {last}"
            )
        for p, i, rec in log:
            other = index.get((p, i))
            if other is None or rec[0] == "p2p" or rec[1] != "ok":
                continue
            if rec[0] in MASK_KINDS and (other[1] != "ok" or other[3] != rec[3]):
                problems.append(
                    f"stopped rank {v}: phase {p} op {i} ({rec[0]}) returned a result over "
                    f"{ranks_of(rec[3])}, the survivors got {other[1]} "
                    f"{ranks_of(other[3]) if other[3] is not None else other[4]}"
                )
    return problems


# --- elastic launches ------------------------------------------------------------------------


def elastic_plans(world, max_world, full, battery, survivor, **extra):
    """The member plan and the joiner plan of an elastic launch (see ft_ranks.elastic_rank);
    ``bad_input`` applies to the members only."""
    base = {
        "timeout_s": 10.0,
        "max_world_size": max_world,
        "full": list(full),
        "battery": tuple(battery),
        "survivor": survivor,
        "idle_s": 0.01,
        **extra,
    }
    return dict(base, role="member"), dict(base, role="joiner", bad_input=False)


def conduct_steps(steps):
    """The parent's part of an elastic launch: a list of steps, run in order.

    * ``("wait_looping", rank)``: the first process of ``rank`` entered its loop;
    * ``("start", rank, plan)``: starts a joiner for ``rank`` (it becomes the latest);
      ``("start", rank, plan, where)``: on another host than the rank's (``where``: an
      entry of ``LocalGroup``'s ``placement``);
    * ``("doomed", rank, plan)``: starts a joiner that kills itself, waits until it is gone;
    * ``("wait_full",)``: the latest process of every rank finished a battery together;
    * ``("sleep", seconds)``; ``("kill", rank)``: kill -9 of the latest process;
    * ``("sigstop", rank)``: SIGSTOP to the latest process, which then counts as gone;
      ``("wait_dropped", rank)``: the survivor saw it leave (``dropped/<rank>`` went up
      since the SIGSTOP); ``("sigcont", rank)``: resumes it and waits until it has ended
      (it must learn it was left out and return; its key goes to ``extra["resumed"]``);
    * ``("slow", rank, seconds)``: the latest process stopped for ``seconds``, then resumed;
    * ``("wait_probed", rank)``; ``("stop",)``;
    * ``("call", fn)``: ``fn()`` here (such as cutting a host's link, see hosts.py).

    Kills, stops and slows are noted in ``extra["faults"]`` as ``(time.time(), what,
    rank)`` just before the signal.
    """

    def conduct(group: LocalGroup, extra):
        latest = {r: str(r) for r in range(group.world_size)}
        stopped: dict[int, tuple[str, int]] = {}  # rank: (key, dropped/<rank> at the stop)
        extra["started"], extra["faults"], extra["resumed"] = [], [], []

        def dropped(rank: int) -> int:
            return group.store.add(f"dropped/{rank}", 0)

        for step in steps:
            op = step[0]
            if op == "wait_looping":
                wait_key(group, f"looping/{step[1]}/{group.pid(latest[step[1]])}", 180, extra)
            elif op in ("start", "doomed"):
                rank, plan = step[1], step[2]
                place = {"placement": [step[3]]} if len(step) > 3 else {}
                (key,) = group.start(elastic_rank, ranks=[rank], args=(plan,), **place)
                extra["started"].append((key, op, plan.get("doom")))
                if op == "start":
                    latest[rank] = key
                else:
                    wait_key(group, f"joining/{rank}/{group.pid(key)}", 120, extra)
                    mark_dead(group, key, 60)
            elif op == "wait_full":
                keys = [f"full/{r}/{group.pid(k)}" for r, k in sorted(latest.items())]
                wait_keys(group, keys, step[1] if len(step) > 1 else 120, extra)
            elif op == "sleep":
                time.sleep(step[1])
            elif op == "kill":
                extra["faults"].append((time.time(), "kill", step[1]))
                group.kill(latest.pop(step[1]))
            elif op == "sigstop":
                rank = step[1]
                stopped[rank] = (latest.pop(rank), dropped(rank))
                extra["faults"].append((time.time(), "stop", rank))
                group.kill(stopped[rank][0], signal.SIGSTOP)
            elif op == "wait_dropped":
                rank = step[1]
                deadline = time.monotonic() + 60
                while dropped(rank) <= stopped[rank][1]:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"rank {rank} stopped, still in the group after 60 s")
                    time.sleep(0.01)
            elif op == "sigcont":
                key = stopped.pop(step[1])[0]
                group.kill(key, signal.SIGCONT)
                group.result(key, 60)  # taken off the queue, or its exit could wait on it
                if group.wait_all([key], 30):
                    raise AssertionError(f"process {key}, resumed, returned but did not exit")
                extra["resumed"].append(key)
            elif op == "slow":
                rank, seconds = step[1], step[2]
                extra["faults"].append((time.time(), "slow", rank))
                group.kill(latest[rank], signal.SIGSTOP)
                time.sleep(seconds)
                group.kill(latest[rank], signal.SIGCONT)
            elif op == "wait_probed":
                wait_key(group, f"probed/{step[1]}", 120, extra)
            elif op == "stop":
                group.store.set("stop", "1")
            elif op == "call":
                step[1]()
            else:
                raise ValueError(step)

    return conduct


def check_elastic(results: dict[str, Any], full, battery_kinds, tolerated=()) -> list[str]:
    """Checks an elastic launch (``tolerated``: keys of joiners expected to give up).

    * every process agrees, iteration by iteration, on the mask of the small all_reduce
      and on what recover_ranks did;
    * every battery (the collectives after a join) succeeded over exactly ``full`` on
      every process, joiners included;
    * every process ended in the full group: last mask, active_ranks, synced ranks.
    """
    problems = []
    full_mask = bits(full)
    by_it: dict[int, dict[str, Any]] = {}
    recover_by_it: dict[int, dict[str, Any]] = {}
    for key, res in sorted(results.items()):
        if key in tolerated:
            continue
        if "error" in res:
            problems.append(f"process {key}: {res['error']}")
            continue
        for it, rec in res["log"]:
            if rec[1] != "ok":
                problems.append(f"process {key}: iteration {it}: {rec[0]} {rec[1]}: {rec[4]}")
            by_it.setdefault(it, {})[key] = rec[3]
        for it, ranks, outcome in res["recover"]:
            recover_by_it.setdefault(it, {})[key] = (ranks, outcome)
        if not res["batteries"]:
            problems.append(f"process {key}: never ran a battery in the full group")
        for it, recs in res["batteries"]:
            kinds = [rec[0] for rec in recs]
            for kind in battery_kinds:
                if kind not in kinds:
                    problems.append(f"process {key}: battery at {it} lacks {kind}")
            for rec in recs:
                if rec[1] == "skip":
                    continue
                if rec[1] != "ok":
                    problems.append(
                        f"process {key}: battery at {it}: {rec[0]} root {rec[2]}: {rec[1]} {rec[4]}"
                    )
                elif rec[3] is not None and rec[3] != full_mask:
                    problems.append(
                        f"process {key}: battery at {it}: {rec[0]} root {rec[2]} covered "
                        f"{ranks_of(rec[3])}, want {sorted(full)}"
                    )
        last = [rec for _, rec in res["log"] if rec[1] == "ok"]
        if not last or last[-1][3] != full_mask:
            problems.append(f"process {key}: last mask {last and ranks_of(last[-1][3])}")
        cap = len(res["active"])
        want = [1 if r in full else 0 for r in range(cap)]
        if res["active"] != want:
            problems.append(f"process {key}: active_ranks {res['active']}, want {want}")
        if res["synced"] != len(full):
            problems.append(f"process {key}: get_num_synced_ranks {res['synced']}")
    for it, masks in sorted(by_it.items()):
        if len(set(masks.values())) > 1:
            problems.append(
                f"iteration {it}: processes disagree on the set: "
                + ", ".join(f"{k}: {ranks_of(m) if m is not None else m}" for k, m in masks.items())
            )
    for it, outcomes in sorted(recover_by_it.items()):
        if len({repr(v) for v in outcomes.values()}) > 1:
            problems.append(f"iteration {it}: processes disagree on recover_ranks: {outcomes}")
    return problems


def check_churn(results: dict[str, Any], extra, full, survivor) -> tuple[list[str], dict]:
    """Checks a churn launch's membership changes against its faults (``extra["faults"]``,
    see :func:`conduct_steps`), as ``survivor`` saw them; returns the problems and the
    resume times: seconds from each kill or stop to the end of the survivor's first op
    without that rank, by kind.

    * a slowed rank (stopped for less than the hang limit) is never left out: nothing
      changes between its stop and the next fault;
    * after a kill or a stop of rank ``v`` the first change leaves out exactly ``v``, and
      every later mask until the next fault is either that or the full group (a joiner
      that dies while joining leaves again), ending with the full group;
    * a stopped process, resumed, ends with the "left out" error.
    """
    problems: list[str] = []
    full_mask = bits(full)
    changes = results.get(str(survivor), {}).get("changes", [])
    faults = extra["faults"]
    resume: dict[str, list[float]] = {"kill": [], "stop": []}
    for k, (t, what, v) in enumerate(faults):
        end = faults[k + 1][0] if k + 1 < len(faults) else float("inf")
        window = [(tc, m) for tc, m in changes if t <= tc < end]
        seen = [ranks_of(m) for _, m in window]
        if what == "slow":
            if window:
                problems.append(f"fault {k}: rank {v} only slowed, but the group became {seen}")
            continue
        want = full_mask & ~(1 << v)
        if not window or window[0][1] != want:
            problems.append(f"fault {k}: {what} of rank {v}: the group became {seen}")
            continue
        if any(m not in (want, full_mask) for _, m in window) or window[-1][1] != full_mask:
            problems.append(f"fault {k}: {what} of rank {v}: then {seen}")
        resume[what].append(window[0][0] - t)
    for key in extra["resumed"]:
        log = results.get(key, {}).get("log", [])
        last = log[-1][1] if log else None
        if last is None or last[1] != "err" or "left out" not in last[4]:
            problems.append(f"process {key}, stopped and resumed: its last op was {last}")
    return problems, resume


def resource_growth(
    samples, ref_index, fd_slack=0, thread_slack=0, rss_slack_kib=24 * 1024, settle=1
):
    """Compares the last sample with ``samples[ref_index]``; returns the problems. With
    ``settle`` > 1, each measure's least over the last ``settle`` samples stands for the
    last: something that comes and goes (a connection being replaced as a sample is
    taken) is no growth; something that stays shows in all of them."""
    ref = samples[ref_index]
    end = {k: min(s[k] for s in samples[-settle:]) for k in samples[-1]}
    problems = []
    if end["fds"] > ref["fds"] + fd_slack:
        problems.append(f"fds grew from {ref['fds']} to {end['fds']}")
    if end["threads"] > ref["threads"] + thread_slack:
        problems.append(f"threads grew from {ref['threads']} to {end['threads']}")
    if end["rss_kib"] > ref["rss_kib"] + rss_slack_kib:
        problems.append(f"RSS grew from {ref['rss_kib']} KiB to {end['rss_kib']} KiB")
    return problems
