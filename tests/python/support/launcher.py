"""Runs many test cases inside one launch of N ranks, the way torchrun does.

Starting a rank costs seconds (python, torch, the backend's rendezvous), so a
launch starts its N ranks once and runs a whole list of cases in them. The
ranks are the processes of a ``mooncake.launch.LocalGroup`` (the launcher
the package, the demo and the other tests use): the parent (the pytest
process) hosts the ``torch.distributed.TCPStore``, as torchrun's agent does,
so that no rank is special; each rank runs ``worker.rank_main``, which
connects to the store, calls ``init_process_group`` (``mooncake-cpu`` unless
the launch names another backend), runs the cases in order and
appends one JSON line per event to its own result file. After every case
the ranks compare verdicts through the store; a case that raised on some
rank is followed by a probe all_reduce, and the launch stops if the group
no longer works.

Each case becomes one pytest item (see :func:`parametrize`); the first item
of a launch pays for the launch, and every item reports its own case with
the verdict and messages of every rank. A launch is bounded: ranks that are
still running at the deadline, or a grace period after another rank died,
are killed, and the case each one was in is named.

Environment knobs that change the data path (``MOONCAKE_CHUNK_BYTES``, ...)
are taken from :attr:`Launch.env` only, never from the caller's
environment, so that case names mean the same thing on every run.
"""

from __future__ import annotations

import json
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import mooncake.launch

# DDP and the functional collectives import torch._dynamo in each rank that uses them
# (3 s of CPU a rank, 11 s of an 8-rank launch on 2 cores): the forkserver does it once.
# Not where there is a GPU: the server's children use CUDA there, and whether that import
# leaves the CUDA driver touched in the server (a fork could not use it) is untried.
if not torch.cuda.is_available() and "torch._dynamo" not in mooncake.launch.FORKSERVER_PRELOAD:
    mooncake.launch.FORKSERVER_PRELOAD.append("torch._dynamo")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

#: Knobs a launch must set explicitly (stripped from the inherited environment).
CONTROLLED_ENV = (
    "MOONCAKE_TRANSPORT",
    "MOONCAKE_CHUNK_BYTES",
    "MOONCAKE_SMALL_MSG_BYTES",
    "MOONCAKE_PG_TIMEOUT_MS",
    "MOONCAKE_SPIN_US",
    "MOONCAKE_ASYNC_DELAY_US",
    "MOONCAKE_HANG_MS",
    "MOONCAKE_RECOVER",
    "MOONCAKE_P2P_UNCLAIMED_BYTES",
    "MOONCAKE_EP_WAIT_CAP_MS",
    "MOONCAKE_EP_FORCE_FALLBACK",
    "MOONCAKE_CUDA_SEGMENT_BYTES",
    "MOONCAKE_CUDA_PLANE_MIN_BYTES",
    "MOONCAKE_CUDA_DIRECT",
    "MOONCAKE_CUDA_DIRECT_BYTES",
)
#: Environment of the chunked launches: 4 KiB slots make "larger than the
#: internal buffer" cheap, and a 2 KiB threshold sends mid-size all_reduce,
#: reduce and broadcast through reduce-scatter + all-gather.
SMALL_CHUNKS = (("MOONCAKE_CHUNK_BYTES", "4096"), ("MOONCAKE_SMALL_MSG_BYTES", "2048"))
TEARDOWN = "<teardown>"


def read_run_files(folder: Path, stem: str) -> tuple[list[dict], str]:
    """A process's JSON-lines results (``<stem>.jsonl``; a line cut short by a kill is
    skipped) and its log (``<stem>.log``), from ``folder``; missing files read as empty."""
    records = []
    path = folder / f"{stem}.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    log = folder / f"{stem}.log"
    return records, log.read_text(errors="replace") if log.exists() else ""


@dataclass(frozen=True)
class Case:
    """One test case: ``fn(ctx)`` runs on every rank (``ctx`` is a ``worker.RankContext``)."""

    name: str
    fn: Callable


@dataclass(frozen=True)
class Launch:
    """One launch of ``world_size`` ranks that runs the cases ``builder`` lists.

    ``builder(world_size, **params)`` must return the same list of
    :class:`Case` in the parent and in every rank (it is called in each).
    """

    builder: Callable[..., list[Case]]
    world_size: int
    label: str
    env: tuple[tuple[str, str], ...] = ()
    params: tuple[tuple[str, object], ...] = ()
    #: False: the worker does not create the default group (cases do).
    init_pg: bool = True
    #: The backend of the default group (``mooncake`` also takes CUDA tensors).
    backend: str = "mooncake-cpu"
    #: Rank r runs on ``cuda:(r % device_count)`` (made current before any group), as
    #: ``mooncake.launch.init_rank`` places ranks; False: every rank on the first GPU.
    spread_gpus: bool = False
    #: Default deadline of one collective (``init_process_group(timeout=...)``).
    op_timeout_s: float = 60.0
    #: Deadline of the whole launch.
    timeout_s: float = 300.0
    #: How long the other ranks may run on after one rank died.
    grace_s: float = 20.0
    stress: bool = False
    #: Per rank, the host it runs on (``hosts.Fabric``: its own network namespace); empty:
    #: all on this one. Only inside ``hosts.run_inside``.
    hosts: tuple[int, ...] = ()

    def cases(self) -> list[Case]:
        return self.builder(self.world_size, **dict(self.params))


@dataclass
class RankRun:
    """What one rank left behind."""

    rank: int
    returncode: int | None = None
    killed: str = ""
    records: list[dict] = field(default_factory=list)
    log: str = ""

    def collect(self, tmp: Path) -> None:
        """Reads the rank's result file and log from the launch folder."""
        records, self.log = read_run_files(tmp, str(self.rank))
        self.records += records

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.rstrip().splitlines()[-lines:])

    def end_of(self, case: str) -> dict | None:
        return next((r for r in self.records if r["event"] == "end" and r["case"] == case), None)

    def started(self, case: str) -> bool:
        return any(r["event"] == "start" and r["case"] == case for r in self.records)

    def has(self, event: str) -> dict | None:
        return next((r for r in self.records if r["event"] == event), None)

    def why_stopped(self) -> str:
        abort = self.has("abort")
        if abort:
            return f"rank {self.rank} stopped the launch: {abort['reason']}"
        if self.killed:
            return f"rank {self.rank} was killed ({self.killed})"
        return f"rank {self.rank} exited with code {self.returncode}"


@dataclass
class LaunchResult:
    launch: Launch
    ranks: list[RankRun]
    seconds: float
    #: Set when the launch itself could not be run.
    error: str = ""

    def verdict(self, case: str) -> tuple[bool, str]:
        """(passed, explanation naming the case and each failing rank)."""
        if self.error:
            return False, f"launch {self.launch.label} could not run:\n{self.error}"
        if case == TEARDOWN:
            return self._teardown()
        problems = []
        for run in self.ranks:
            end = run.end_of(case)
            if end is None:
                if run.started(case):
                    problems.append(
                        f"rank {run.rank} did not finish the case: {run.why_stopped()}\n"
                        f"--- rank {run.rank} log tail ---\n{run.log_tail()}"
                    )
                else:
                    problems.append(f"rank {run.rank} did not run the case: {run.why_stopped()}")
            elif end["status"] != "ok":
                text = "\n".join(end["messages"])
                problems.append(f"rank {run.rank} {end['status']}:\n{text}")
        if not problems:
            return True, ""
        head = f"case {case!r} of launch {self.launch.label} (world {self.launch.world_size})"
        return False, head + "\n" + "\n".join(problems)

    def _teardown(self) -> tuple[bool, str]:
        problems = []
        for run in self.ranks:
            if run.returncode != 0 or run.killed or not run.has("exit"):
                problems.append(
                    f"rank {run.rank}: {run.why_stopped()}; finished all cases: "
                    f"{bool(run.has('done'))}, returned from destroy_process_group: "
                    f"{bool(run.has('exit'))}\n--- log tail ---\n{run.log_tail()}"
                )
        return not problems, "\n".join(problems)


def parametrize(launches: Iterable[Launch]) -> list:
    """One ``pytest.param(launch, case_name)`` per case, plus one teardown item per launch.

    Use with ``@pytest.mark.parametrize(("launch", "case"), parametrize(...))``
    and call :func:`check` in the test. Launches with ``stress=True`` get the
    ``stress`` mark.
    """
    params = []
    for launch in launches:
        marks = [pytest.mark.stress] if launch.stress else []
        names = [c.name for c in launch.cases()] + [TEARDOWN]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"launch {launch.label}: duplicate case names {dups[:5]}")
        for name in names:
            params.append(pytest.param(launch, name, id=f"{launch.label}:{name}", marks=marks))
    return params


_selected: dict[Launch, list[str]] = {}
_results: dict[Launch, LaunchResult] = {}


def note_selected(items) -> None:
    """Records which cases of each launch the session will run (from conftest)."""
    _selected.clear()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or not isinstance(callspec.params.get("launch"), Launch):
            continue
        launch, case = callspec.params["launch"], callspec.params["case"]
        if case != TEARDOWN:
            _selected.setdefault(launch, []).append(case)
        else:
            _selected.setdefault(launch, [])


def _cuda_reason() -> str:
    """Why the CUDA tests cannot run here ('' when they can)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (make gpu-check runs these)"
    from mooncake._loader import load_extension

    if not load_extension().build_info()["cuda"]:
        return "this build of mooncake has no CUDA"
    return ""


#: Marks a test that needs a GPU and a CUDA build (skipped with the reason otherwise).
needs_cuda = pytest.mark.skipif(bool(_cuda_reason()), reason=_cuda_reason() or "-")


def ucx_built() -> bool:
    """Whether this build has the ucx transport (``make`` installs libucx-dev for it)."""
    from mooncake._loader import load_extension

    return "ucx" in load_extension().TransferEngine.available_transports()


def check(launch: Launch, case: str) -> None:
    """Fails the calling test unless ``case`` passed on every rank of ``launch``."""
    if launch not in _results:
        try:
            _results[launch] = run(launch, _selected.get(launch))
        except Exception:  # every case of the launch reports it
            _results[launch] = LaunchResult(launch, [], 0.0, traceback.format_exc())
    passed, why = _results[launch].verdict(case)
    if not passed:
        pytest.fail(why, pytrace=False)


def results() -> dict[Launch, LaunchResult]:
    """The launches run so far in this session."""
    return _results


def _child_env(launch: Launch) -> dict[str, str | None]:
    """The ranks' environment: the knobs of CONTROLLED_ENV only as the launch sets them."""
    env: dict[str, str | None] = {k: None for k in CONTROLLED_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.update(dict(launch.env))
    return env


def run(launch: Launch, selected: list[str] | None = None) -> LaunchResult:
    """Starts ``launch.world_size`` ranks, runs the (selected) cases, collects every rank's records.

    The ranks are processes of a ``mooncake.launch.LocalGroup`` (which hosts the
    store, as torchrun's agent does) running ``worker.rank_main``. Never hangs:
    ranks are killed at ``launch.timeout_s``, or ``launch.grace_s`` after another
    rank exited with an error.
    """
    from mooncake.launch import LocalGroup
    from worker import rank_main

    n = launch.world_size
    with tempfile.TemporaryDirectory(prefix="mooncake-launch-") as tmpdir:
        tmp = Path(tmpdir)
        config = {
            "launch": launch,  # pickled by reference: the builder is a module-level function
            "selected": selected,
            "out": str(tmp / "{rank}.jsonl"),
        }
        (tmp / "config.pkl").write_bytes(pickle.dumps(config))
        runs = [RankRun(rank) for rank in range(n)]
        start = time.monotonic()
        where = {}
        if launch.hosts:
            from hosts import fabric

            f = fabric()
            where = {"placement": f.placement(launch.hosts), "store_host": f.gateway}
        with LocalGroup(n, env=_child_env(launch), log_dir=str(tmp), **where) as group:
            try:
                group.start(rank_main, args=(str(tmp / "config.pkl"),))
                why = group.wait_all(
                    [str(rr.rank) for rr in runs], launch.timeout_s, launch.grace_s
                )
                reason = {
                    "deadline": "the launch ran past its deadline",
                    "grace": f"another rank died and this one did not exit within "
                    f"{launch.grace_s:.0f} s",
                }.get(why, "")
                for rr in runs:
                    if reason and not group.exited(str(rr.rank)):
                        group.kill(str(rr.rank))
                        rr.killed = reason
            finally:
                for rr in runs:
                    if not group.exited(str(rr.rank)):
                        rr.killed = rr.killed or "the test session was interrupted"
                codes = group.reap(str(rr.rank) for rr in runs)
                for rr, code in zip(runs, codes, strict=True):
                    rr.returncode = code
        for rr in runs:
            rr.collect(tmp)
    return LaunchResult(launch, runs, time.monotonic() - start)
