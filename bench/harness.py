"""What the benchmark programs share: launching ranks, timing loops, statistics,
number formats, Markdown tables, JSON output and the run's metadata.

Only the standard library at module level: ranks spawned from a program re-import it
(and a replacement's start-up time is measured), and ``bench_ep_upstream.py`` runs it
beside upstream's own ``mooncake`` package, so nothing here may import ours (or torch)
before a function that needs it is called.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# --- printing ---------------------------------------------------------------------------


def say(line: str = "") -> None:
    """A line of the program's report (stdout)."""
    print(line, flush=True)


def log(text: str) -> None:
    """Progress and trouble (stderr), kept apart from the report."""
    print(text, file=sys.stderr, flush=True)


def say_host(
    what: str, cores: int, load: tuple[float, ...], noisy: str = "times are noisy"
) -> None:
    """The report's first line: what runs, on how many cores, and how busy the host was."""
    say(f"# {what} on {cores} cores; load average at start {load[0]:.2f}")
    if load[0] > 0.5 * cores:
        say(f"# WARNING: the host is busy; {noisy}")


# --- statistics -------------------------------------------------------------------------


def add_if_gpu(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--if-gpu",
        action="store_true",
        help="on a machine without a CUDA GPU, say so and succeed (make bench); without "
        "it, that is an error: asked to measure the GPU, nothing was measured",
    )


def no_gpu_status(name: str, if_gpu: bool) -> int | None:
    """None where a CUDA GPU is visible; else the exit status (0 with ``--if-gpu``)."""
    import torch

    if torch.cuda.is_available():
        return None
    if if_gpu:
        print(f"{name}: no CUDA GPU here; nothing to measure (--if-gpu)")
        return 0
    print(f"{name}: error: no CUDA GPU visible to torch; nothing was measured", file=sys.stderr)
    return 1


def percentile(values, q: float, method: str = "nearest") -> float | None:
    """The ``q``-th percentile (``q`` in [0, 100]) of ``values`` (any order); None when empty.

    ``method`` (each program keeps the one its tables have always used):

    * ``"nearest"``: the nearest rank, the smallest value with at least q% of the
      values at or below it (with fewer than 100 values, p99 is the maximum);
    * ``"above"``: the smallest value with more than q% of the values at or below it
      (the maximum where there is none);
    * ``"linear"``: linear interpolation between the two nearest ranks (numpy's default).
    """
    s = sorted(values)
    if not s:
        return None
    if method == "nearest":
        return s[max(0, math.ceil(q / 100 * len(s)) - 1)]
    if method == "above":
        return s[min(len(s) - 1, int(q / 100 * len(s)))]
    if method == "linear":
        pos = (len(s) - 1) * q / 100.0
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)
    raise ValueError(f"percentile: unknown method {method!r}")


def median(values, empty: Any = None) -> Any:
    """The median of the values that are not None; ``empty`` when there are none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else empty


def summarize(
    values,
    stats: dict[str, str],
    *,
    method: str = "nearest",
    scale: float = 1.0,
    digits: int | None = None,
) -> dict:
    """``{key: statistic}`` of ``values`` for each ``key: name`` of ``stats``, in that order.

    Names: ``n``, ``median``, ``mean``, ``min``, ``max`` and ``pNN`` (the NN-th
    percentile by ``method``). Every statistic but ``n`` is multiplied by ``scale``
    after it is taken, then rounded to ``digits`` if given; None when ``values`` is empty.
    """
    v = list(values)

    def stat(name: str):
        if name == "n":
            return len(v)
        if not v:
            return None
        if name == "median":
            x = statistics.median(v)
        elif name == "mean":
            x = statistics.fmean(v)
        elif name == "min":
            x = min(v)
        elif name == "max":
            x = max(v)
        elif name.startswith("p"):
            x = percentile(v, float(name[1:]), method)
        else:
            raise ValueError(f"summarize: unknown statistic {name!r}")
        x = x * scale if scale != 1.0 else x
        return x if digits is None else round(x, digits)

    return {key: stat(name) for key, name in stats.items()}


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Per loop (or call), the slowest rank's time: what the group as a whole took."""
    n = min((len(c) for c in per_rank), default=0)
    return [max(c[i] for c in per_rank) for i in range(n)]


# --- timing -----------------------------------------------------------------------------
# torch is imported inside the functions that need it (see the module docstring).


def mean_seconds(fn, calls: int, finish=None) -> float:
    """Mean seconds per call of ``calls`` back-to-back calls of ``fn`` (then
    ``finish()``, inside the timed span: a device synchronise, say)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if finish is not None:
        finish()
    return (time.perf_counter() - t0) / max(calls, 1)


def call_seconds(fn, calls: int) -> list[float]:
    """Seconds of each of ``calls`` calls of ``fn``, one after another."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def rank_max(value: float, dtype=None) -> float:
    """``value`` as the slowest rank has it: its maximum over the default group.
    ``dtype``: None is torch's default (float32), as the callers have always sent it."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value]) if dtype is None else torch.tensor([value], dtype=dtype)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def calls_in_budget(per_call_s: float, cfg: dict, dtype=None) -> int:
    """How many calls every rank times: as many as fit in ``cfg["point_seconds"]`` at
    the slowest rank's ``per_call_s`` (agreed through an all_reduce), held between
    ``cfg["min_iters"]`` and ``cfg["max_iters"]``. Every rank makes the same calls."""
    estimate = rank_max(per_call_s, dtype)
    total = int(cfg["point_seconds"] / max(estimate, 1e-7))
    return max(cfg["min_iters"], min(cfg["max_iters"], total))


def cuda_span_ms(fn, calls: int = 1, host: list | None = None) -> float:
    """Milliseconds on the GPU from before ``calls`` back-to-back calls of ``fn`` to
    after them, by CUDA events; ``host`` gets the host's microseconds in the calls."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    if host is None:  # nothing but the calls between the events
        for _ in range(calls):
            fn()
    else:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) * 1e6)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


# --- launching ranks --------------------------------------------------------------------

FAILURE_GRACE_S = 30  # a rank that dies should make the others fail fast


@dataclass
class Launch:
    """How a group of ranks ended, and what they published in its store."""

    world: int
    error: str | None
    timed_out: bool
    codes: list[int | None]
    returned: dict[str, Any]  # fn's return values by process key (where every one returned)
    store: Any  # the group's store, still open after the group: read it with store_json
    wall_s: float
    loadavg: list[float]  # the 1-minute load average before and after

    def per_rank(self, prefix: str, default: Any = None) -> list:
        """What each rank published under ``<prefix>/<rank>`` (``default`` where none)."""
        return [store_json(self.store, f"{prefix}/{r}", default) for r in range(self.world)]


def launch(
    world: int,
    fn,
    args: tuple = (),
    *,
    env: dict[str, str] | None = None,
    timeout_s: float,
    grace_s: float | None = FAILURE_GRACE_S,
    start_method: str = "forkserver",
    more: tuple = (),
    **group_kw,
) -> Launch:
    """Runs ``fn(rank, world, port, *args)`` on ``world`` ranks of a
    ``mooncake.launch.LocalGroup`` (this process hosts the store) until all end, at
    most ``timeout_s``, or ``grace_s`` after one failed (None: no grace), then kills
    what still runs. ``more``: further ``(ranks, args)`` started beside them (as extra
    processes of those ranks, such as standbys). ``group_kw`` go to ``LocalGroup``.
    ``error`` is None when every process returned.

    A return value is read only after its process ended, and waits in a pipe until
    then: keep it small (a process blocks on exit behind a full pipe); publish
    points in the store instead."""
    from mooncake.launch import LocalGroup

    started, load = time.monotonic(), os.getloadavg()[0]
    error, returned = None, {}
    with LocalGroup(world, env=env, start_method=start_method, **group_kw) as group:
        keys = group.start(fn, args=args)
        for ranks, more_args in more:
            keys += group.start(fn, ranks=ranks, args=more_args)
        timed_out = group.wait_all(keys, timeout_s, grace_s) == "deadline"
        if timed_out:
            error = f"timed out after {timeout_s:.0f} s"
        codes = group.reap(keys)
        if error is None:
            try:  # every process ended: its return value, or why it has none (a traceback)
                returned = group.results(timeout_s=5)
            except RuntimeError as e:
                error = str(e)
    return Launch(
        world=world,
        error=error,
        timed_out=timed_out,
        codes=codes,
        returned=returned,
        store=group.store,
        wall_s=round(time.monotonic() - started, 1),
        loadavg=[load, os.getloadavg()[0]],
    )


def store_json(store, key: str, default: Any = None) -> Any:
    """What a process published under ``key`` with :func:`publish`; ``default`` if nothing."""
    return json.loads(store.get(key)) if store.check([key]) else default


def publish(store, key: str, value: Any) -> None:
    """Puts ``value`` (JSON) in the store, where the parent reads it even after this
    process dies."""
    store.set(key, json.dumps(value))


def store_barrier(
    store, name: str, n: int, timeout_s: float | None = None, abort_key: str | None = None
) -> None:
    """Waits until ``n`` processes have reached the barrier ``name`` (once per name).
    ``abort_key``: raises as soon as that key is set (see :func:`store_wait`)."""
    if store.add(f"sync/{name}", 1) == n:
        store.set(f"sync/{name}/done", "1")
    if abort_key is not None:
        store_wait(store, f"sync/{name}/done", 120 if timeout_s is None else timeout_s, abort_key)
    elif timeout_s is None:
        store.wait([f"sync/{name}/done"])
    else:
        store.wait([f"sync/{name}/done"], timedelta(seconds=timeout_s))


class Aborted(RuntimeError):
    """Raised by :func:`store_wait` when another process set the abort key."""


def store_wait(store, key: str, timeout_s: float, abort_key: str) -> None:
    """Waits for ``key``, at most ``timeout_s``, and raises :class:`Aborted` as soon as
    ``abort_key`` is set: a run whose processes wait for each other ends when one of
    them failed (it sets the key), not at the deadline. Polls every 0.2 s."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if store.check([abort_key]):
            why = store.get(abort_key).decode(errors="replace")
            raise Aborted(f"waiting for {key!r}: another process failed ({why})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waiting for {key!r}: not set within {timeout_s:.0f} s")
        time.sleep(0.2)


# --- numbers and tables -----------------------------------------------------------------


def fmt_bytes(n: int) -> str:
    """4096 -> "4 KiB": the largest binary unit that divides ``n``, else bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def fmt_fixed(v: float | None, whole_from: float) -> str:
    """One decimal below ``whole_from``, whole from it up; "-" for None and NaN."""
    if v is None or v != v:
        return "-"
    return f"{v:.1f}" if v < whole_from else f"{v:.0f}"


def fmt_ratio(r: float | None) -> str:
    if r is None:
        return "-"
    return f"{r:.2f}" if r < 100 else f"{r:.0f}"


def markdown_table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """The lines of a Markdown table; ``align``: one letter a column, ``l`` or ``r``
    (right: numbers), ``l`` for the columns past its end."""
    align = align.ljust(len(header), "l")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


# --- command line -----------------------------------------------------------------------


def arg_parser(description: str, world_sizes: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser (defaults shown in --help), with ``--world-sizes`` if given."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    if world_sizes is not None:
        p.add_argument("--world-sizes", default=world_sizes, help="comma-separated world sizes")
    return p


def add_output_args(p: argparse.ArgumentParser, quick: str) -> None:
    """``--out-dir`` and ``--quick`` (``quick``: what a quick run does)."""
    p.add_argument("--out-dir", default=str(RESULTS), help="where results go")
    p.add_argument("--quick", action="store_true", help=quick)


def add_loop_args(
    p: argparse.ArgumentParser,
    per: str,
    warmup: int,
    min_iters: int,
    max_iters: int,
    point_seconds: float = 0.2,
    warmup_note: str = "",
) -> None:
    """The options of :func:`calls_in_budget`'s loops (``per``: what one loop times)."""
    help_warmup = f"untimed calls before each {per}{warmup_note}"
    p.add_argument("--warmup", type=int, default=warmup, help=help_warmup)
    p.add_argument("--min-iters", type=int, default=min_iters, help=f"fewest timed calls per {per}")
    p.add_argument("--max-iters", type=int, default=max_iters, help=f"most timed calls per {per}")
    p.add_argument(
        "--point-seconds", type=float, default=point_seconds, help=f"timed seconds per {per}"
    )


def parse_bytes(text: str) -> int:
    """'8', '4K', '4KiB', '64M', '1G' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if scale != 1 else t) * scale)


def csv_ints(text: str) -> list[int]:
    """'2,4,8' -> [2, 4, 8], in the order given."""
    return [int(w) for w in text.split(",") if w.strip()]


def parse_args(parser, argv, quick_sets: dict | None = None, quick_caps: dict | None = None):
    """``parser.parse_args(argv)``; with ``--quick``, the options of ``quick_sets`` take
    those values and those of ``quick_caps`` at most those (a quick run only shortens)."""
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in (quick_sets or {}).items():
            setattr(args, name, value)
        for name, cap in (quick_caps or {}).items():
            setattr(args, name, min(getattr(args, name), cap))
    return args


# --- output files and the run's metadata ------------------------------------------------


def write_json(path, data: Any, indent: int = 1) -> None:
    """Writes ``data`` as JSON, replacing ``path`` at once (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    os.replace(tmp, path)


def read_json(path) -> dict | None:
    """A JSON object from ``path``; None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_outputs(out_dir, files: dict[str, Any]) -> str:
    """Writes each ``name: content`` under ``out_dir`` (a str as text, anything else as
    JSON); returns "wrote <out_dir>/<first>, <second>, ..." for the report."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if isinstance(content, str):
            (out / name).write_text(content)
        else:
            write_json(out / name, content)
    return f"wrote {out}/" + ", ".join(files)


def library_version() -> dict:
    """Which mooncake was measured: the checkout's commit and the extension's build time."""
    repo = HERE.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except OSError:
        commit = ""
    built = sorted((repo / "python" / "mooncake").glob("_pg_torch*.so"))
    return {
        "commit": commit,
        "extensions": {
            p.name: time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(p.stat().st_mtime))
            for p in built
        },
    }


def run_meta(started: float, cores: int, load_start, args) -> dict:
    """What every benchmark's JSON says about its run: when, where, with what."""
    import torch

    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cores": cores,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "args": vars(args),
        "mooncake": library_version(),
        # The knobs this run was given (a side-by-side run differs only there).
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOONCAKE_")},
    }
