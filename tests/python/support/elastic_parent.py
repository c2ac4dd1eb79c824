"""Parent-side helpers of test_ep_elastic.py: the timeline runner (processes of
``elastic_ranks.py`` that meet through a store hosted here), helpers for buffers in the
test process, and a runner for small scripts that must run in a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from elastic_round import SPEC, play_round
from ep_cases import Checks
from launcher import CONTROLLED_ENV, read_run_files

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SEED = int(os.environ.get("MOONCAKE_EP_SEED", "7"))

# --- the timeline runner --------------------------------------------------------------------


@dataclass
class Proc:
    """One process of a timeline: slot ``slot``'s ``gen``-th process."""

    slot: int
    gen: int
    role: dict
    group_key: str  # the process's key in the LocalGroup ("2", "2.1", ...)
    killed: str = ""  # why the parent killed it ("planned": a rank asked)
    returncode: int | None = None
    records: list[dict] = field(default_factory=list)
    log: str = ""

    @property
    def key(self) -> str:
        return f"{self.slot}.{self.gen}"

    def collect(self, folder: Path) -> None:
        self.records += read_run_files(folder, self.key)[0]
        self.log = read_run_files(folder, self.group_key)[1]

    def trouble(self) -> str:
        """Why this process did not end well ("" if it did, or was killed as planned)."""
        err = next((r for r in self.records if r["event"] in ("error", "aborted")), None)
        if err is not None:
            detail = err.get("traceback") or err.get("reason")
            return f"process {self.key} {err['event']} in phase {err['phase']}:\n{detail}"
        if self.killed == "planned":
            return ""
        if (
            self.killed
            or self.returncode != 0
            or not any(r["event"] == "done" for r in self.records)
        ):
            tail = "\n".join(self.log.rstrip().splitlines()[-20:])
            return (
                f"process {self.key}: exit code {self.returncode}, killed: {self.killed or 'no'}"
                f"\n--- log tail ---\n{tail}"
            )
        return ""


class Timeline:
    """One launch of a scenario of ``elastic_ranks.py``.

    The parent hosts the TCPStore; processes ask through it for a process in a slot
    (``spawn``) or for a kill (``kill`` after ``delay_s``; the parent then sets
    ``tl/killed/<slot>/<gen>``). When a process fails, ``tl/abort`` tells the others to
    stop; ``grace_s`` later, or at ``timeout_s``, whatever runs is killed.
    """

    def __init__(self, scenario, params, initial, env=None, timeout_s=150.0, grace_s=20.0):
        self.scenario, self.params, self.initial = scenario, params, list(initial)
        self.env: dict[str, str | None] = {k: None for k in CONTROLLED_ENV}
        self.env.update(
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONFAULTHANDLER="1",
            MOONCAKE_TRANSPORT="auto",
            MOONCAKE_HANG_MS="10000",
            MOONCAKE_CHUNK_BYTES="262144",
            MOONCAKE_LOG_LEVEL="error",
        )
        self.env.update(env or {})
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.procs: list[Proc] = []
        self.requests: list[dict] = []
        self.error = ""
        self.seconds = 0.0

    def run(self) -> Timeline:
        from mooncake.launch import LocalGroup

        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="mooncake-elastic-") as tmp:
            self.dir = Path(tmp)
            capacity = max(self.initial, default=0) + 1
            with LocalGroup(capacity, env=self.env, log_dir=tmp) as group:
                self.group = group
                cfg = {"port": group.port, "scenario": self.scenario, "params": self.params}
                cfg["dir"] = tmp
                self.config = self.dir / "config.json"
                self.config.write_text(json.dumps(cfg))
                try:
                    for slot in self.initial:
                        self._spawn(slot, {})
                    self._supervise(group.store, t0 + self.timeout_s)
                finally:
                    for p in self.procs:
                        if not group.exited(p.group_key):
                            p.killed = p.killed or "left running when the timeline ended"
                    codes = group.reap(p.group_key for p in self.procs)
                    for p, code in zip(self.procs, codes, strict=True):
                        p.returncode = code
            for p in self.procs:
                p.collect(self.dir)
        self.seconds = time.monotonic() - t0
        return self

    def _spawn(self, slot: int, role: dict) -> None:
        from elastic_ranks import process_main

        gen = sum(1 for p in self.procs if p.slot == slot)
        (key,) = self.group.start(
            process_main, ranks=[slot], args=(str(self.config), gen, json.dumps(role))
        )
        self.procs.append(Proc(slot, gen, role, key))

    def current(self, slot: int) -> Proc:
        return [p for p in self.procs if p.slot == slot][-1]

    def _supervise(self, store, deadline: float) -> None:
        next_req, kills, failed_at = 0, [], None
        while True:
            running = any(not self.group.exited(p.group_key) for p in self.procs)
            now = time.monotonic()
            while store.check([f"tl/req/{next_req}"]):
                req = json.loads(store.get(f"tl/req/{next_req}"))
                req["at"] = now
                self.requests.append(req)
                next_req += 1
                if req["op"] == "spawn":
                    self._spawn(req["slot"], req.get("role", {}))
                    running = True
                elif req["op"] == "resume":  # a process that stopped itself (SIGSTOP)
                    proc = [q for q in self.procs if q.slot == req["slot"]][req["gen"]]
                    self.group.kill(proc.group_key, signal.SIGCONT)
                else:
                    kills.append((now + req["delay_s"], req["slot"]))
            for due in [k for k in kills if k[0] <= now]:
                kills.remove(due)
                victim = self.current(due[1])
                victim.killed = "planned"
                self.group.kill(victim.group_key)
                self.group.wait(victim.group_key)
                store.set(f"tl/killed/{victim.slot}/{victim.gen}", "1")
            for p in self.procs:
                rc = self.group.exitcode(p.group_key)
                if rc not in (None, 0) and not p.killed and failed_at is None:
                    failed_at = now
                    store.set("tl/abort", f"process {p.key} exited with code {rc}")
            if not running and not kills:
                return
            if now > deadline:
                self.error = f"the timeline ran past its deadline ({self.timeout_s:.0f} s)"
                return
            if failed_at is not None and now - failed_at > self.grace_s:
                self.error = f"a process failed; the others did not stop within {self.grace_s} s"
                return
            time.sleep(0.01)

    # --- what the processes recorded ---

    def records(self, phases=None, event=None):
        for p in self.procs:
            for r in p.records:
                if (phases is None or r.get("phase") in phases) and (
                    event is None or r["event"] == event
                ):
                    yield p, r

    def troubles(self) -> list[str]:
        out = [self.error] if self.error else []
        return out + [t for t in (p.trouble() for p in self.procs) if t]

    def problems(self, phases, slots=None, rounds=None) -> list[str]:
        """Failed expectations of ``phases``; and, unless every slot of ``slots`` finished
        each phase (with at least ``rounds`` rounds), what went wrong in the timeline."""
        problems = [
            f"process {p.key}: {f}"
            if r["event"] == "round"
            else f"process {p.key}: {r['what']}: {f}"
            for p, r in self.records(phases)
            if r["event"] in ("round", "check")
            for f in r["failures"]
        ]
        missing = []
        for phase in phases:
            for s in slots if slots is not None else []:
                done = [p for p, r in self.records([phase], "phase") if p.slot == s]
                n = sum(1 for p, _ in self.records([phase], "round") if p.slot == s)
                if not done or (rounds is not None and n < rounds):
                    missing.append(f"slot {s} did not finish phase {phase} ({n} rounds)")
        if missing:
            problems += missing + self.troubles()
        return problems

    def checks(self, phase: str, what: str) -> dict[int, dict]:
        """The ``what`` check records of ``phase``, per slot (the latest process's)."""
        return {p.slot: r for p, r in self.records([phase], "check") if r["what"] == what}

    def rounds_of(self, phase: str):
        return [(p, r) for p, r in self.records([phase], "round")]


def report(problems: list[str], tl: Timeline) -> str:
    return f"{tl.scenario} ({tl.seconds:.1f} s):\n" + "\n".join(problems[:30])


# --- buffers of the test process ----------------------------------------------------------


def in_threads(*calls, timeout_s=60.0) -> list:
    """Runs each call on its own thread; returns their results (an exception is returned)."""
    out: list = [None] * len(calls)

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a call did not return"
    return out


def verified_rounds(bufs, plan, phase, n=2) -> list[str]:
    """``n`` rounds among ``bufs`` (one thread each), checked against the model; the
    failures (empty: all correct)."""

    def run(buf):
        chk = Checks(buf.rank, buf.num_ranks, phase)
        stats = tuple(torch.zeros(buf.num_experts_per_rank, dtype=torch.int32) for _ in range(2))
        failures = []
        for i in range(n):
            _, rec = play_round(chk, buf, SEED, phase, i, plan, stats=stats)
            failures += [f"slot {buf.rank} {rec['tag']}: {f}" for f in rec["failures"]]
        return failures

    out = in_threads(*[lambda b=b: run(b) for b in bufs])
    return [f for r in out for f in (r if isinstance(r, list) else [f"raised {r!r}"])]


def raises(kind, fn, *words):
    """Calls ``fn``; it must raise ``kind`` with every word in its message."""
    with pytest.raises(kind) as info:
        fn()
    text = str(info.value)
    missing = [w for w in words if w.lower() not in text.lower()]
    assert not missing, f"{kind.__name__} does not mention {missing}: {text}"
    return text


def tiny_dispatch(buf, num_experts: int, tokens: int = 2):
    x = torch.zeros(tokens, SPEC.H, dtype=torch.bfloat16)
    idx = torch.zeros(tokens, 1, dtype=torch.int64)
    return buf.dispatch(x, idx, None, SPEC.T, num_experts, -1, use_fp8=False)


# --- scripts in a fresh interpreter -------------------------------------------------------

#: The head of the scripts below: a store, and buffers of capacity 4 in this process.
PRELUDE = """
import gc, json, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from mooncake.mooncake_ep_buffer import Buffer

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))

def make(rank, **kw):
    b = Buffer.create_elastic(
        rank=rank, tcp_store_group=store, store_prefix="p/", metadata_timeout_ms=2500, **kw
    )
    b.update_memory_buffers(num_ranks=4, num_experts_per_rank=2)
    return b

def both(*calls):
    out = [None] * len(calls)
    def run(i, f):
        try:
            out[i] = f()
        except Exception as e:
            out[i] = f"{type(e).__name__}: {e}"
    ts = [threading.Thread(target=run, args=(i, f), daemon=True) for i, f in enumerate(calls)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    return out

def pair():
    b0, b1 = make(0), make(1)
    b0.connect_ranks([1], activate=False)
    b1.connect_ranks([0], activate=True)
    b0.update_mask_buffer(1, mask=False)
    assert both(b0.barrier, b1.barrier) == [[0, 1], [0, 1]]
    return b0, b1
"""


def run_script(body: str, env=None, timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    """Runs PRELUDE + body in a fresh interpreter (a crash or a transport setting stays
    there)."""
    full = {k: v for k, v in os.environ.items() if k not in CONTROLLED_ENV}
    full.update(OMP_NUM_THREADS="1", MOONCAKE_LOG_LEVEL="error", **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def script_result(proc: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"exit code {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


def device_problems(tl: Timeline) -> list[str]:
    """Every failed expectation and trouble of the timeline, and every round of a
    process whose buffer had every active slot mapped that did not run on the device."""
    problems = [
        f"process {p.key}: {r.get('what', r.get('tag'))}: {f}"
        for p, r in tl.records()
        if r["event"] in ("round", "check")
        for f in r["failures"]
    ]
    problems += tl.troubles()
    portable = [
        f"process {p.key}: round {r['tag']} ran the {r['path']} path"
        for p, r in tl.records(event="round")
        if r["path"] != "device"
    ]
    return problems + portable[:10]
