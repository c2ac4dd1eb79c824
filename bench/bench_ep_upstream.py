"""Latency of the upstream Mooncake EP kernels (PyPI wheel 0.3.14) on one GPU, world size 1.

A reference column for our own EP numbers: it drives the ``Buffer`` of the
published ``mooncake-transfer-engine-cuda13==0.3.14`` wheel
(``mooncake.mooncake_ep_buffer.Buffer``) at DeepEP low-latency decode shapes:
T=128 tokens, hidden H=7168, top-8, E in {256, 288} experts (all local, since
the world has one rank), dispatch in FP8 and in BF16, combine in BF16.

Per case it times, with CUDA events around each call on the current stream:

- ``dispatch_us``: ``Buffer.dispatch`` (send and receive in one call);
- ``combine_us``: ``Buffer.combine`` called again and again with the handle of one dispatch;
- ``send_half_us``: ``Buffer.dispatch(..., return_recv_hook=True)``, i.e. the send phase;
- ``recv_hook_us``: calling the hook that dispatch returned, i.e. the receive phase.

Each timed call starts on an idle GPU (the device is synchronised first), so a
time covers the Python wrapper, the launch and the kernel; ``--hide-launch``
queues a short GPU spin before the start event so that only GPU time is left.
Inputs rotate among 4 sets so that the same bytes are not read every call.
Warm-up calls come first (the first call of a shape also JIT-compiles kernels).
The table shows median [p10, p90] in microseconds; the JSON (``--out``) holds
the same per case.

This script imports only torch, the standard library and upstream's
``mooncake`` package, which must come first on ``sys.path``: our own Python
package has the same name. Upstream builds its process-group adapter and its
EP kernels with a JIT on first use (ninja, nvcc and a C++ compiler needed);
its native modules are built for CPython 3.12 and need rdma-core's
``libibverbs.so.1`` and ``libmlx5.so.1`` to load, even without an RDMA NIC.

    PYTHONPATH=/tmp/upstream-site CXX=/usr/bin/g++ python3 bench/bench_ep_upstream.py
    PYTHONPATH=/tmp/upstream-site CXX=/usr/bin/g++ python3 bench/bench_ep_upstream.py --quick
    ... bench/bench_ep_upstream.py --cases E256-fp8 --out /tmp/up.json

The measuring runs in a child process under a deadline (``--deadline-s``), so
a crash or a hang in native code still ends with a JSON file and exit status
0. Anything that fails (import, JIT build, process group, buffer) leaves
``"error"`` in the JSON, together with whatever cases did finish; a case that
fails on its own carries its own ``"error"``. ``--inline`` measures in this
process, without the watchdog.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

# Only the standard library at module level (harness imports nothing else, none of our
# mooncake package in particular): the watchdog parent never loads torch.
import harness
from harness import read_json, write_json

IMPL = "upstream-0.3.14"
DEFAULT_OUT = harness.RESULTS / "ep_upstream.json"
UPSTREAM_DISTS = ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine")
NATIVE_LIBS = ("libcuda.so.1", "libcudart.so.13", "libibverbs.so.1", "libmlx5.so.1", "libnuma.so.1")
NUM_INPUT_SETS = 4
SPIN_CYCLES = 200_000  # ~100 us of GPU spin at H200 clocks: longer than one call's launch
PENDING = "the run did not finish (results, if any, are partial)"
NOT_STARTED = "worker did not start"


# --- small helpers (stdlib only) -------------------------------------------------------


def summarize(times_us: list[float]) -> dict:
    """Percentiles interpolated between ranks (the median too), to the nanosecond."""
    stats = {"median": "p50", "p10": "p10", "p90": "p90", "min": "min", "mean": "mean", "n": "n"}
    return harness.summarize(times_us, stats, method="linear", digits=3)


def case_id(num_experts: int, use_fp8: bool) -> str:
    return f"E{num_experts}-{'fp8' if use_fp8 else 'bf16'}"


def selected_cases(args: argparse.Namespace) -> list[tuple[int, bool]]:
    """(E, fp8) pairs; ``--cases`` keeps those whose id contains one of its words."""
    cases = [(e, fp8) for e in args.experts for fp8 in (True, False)]
    if args.cases:
        words = [w.strip() for w in args.cases.split(",") if w.strip()]
        cases = [c for c in cases if any(w in case_id(*c) for w in words)]
    return cases


def print_table(data: dict) -> None:
    def cell(stats: dict | None) -> str:
        if not stats:
            return "-"
        return f"{stats['median']:.1f} [{stats['p10']:.1f}, {stats['p90']:.1f}]"

    cols = ("dispatch_us", "combine_us", "send_half_us", "recv_hook_us")
    print(f"\n{data.get('impl')} on {data.get('gpu')} (torch {data.get('torch')})")
    print("times in us: median [p10, p90]")
    header = f"{'case':<12}" + "".join(f"{c:>26}" for c in cols)
    print(header)
    print("-" * len(header))
    for case in data.get("cases", []):
        name = f"E{case.get('E')}-{'fp8' if case.get('fp8') else 'bf16'}"
        if case.get("error"):
            print(f"{name:<12}  error: {case['error']}")
            continue
        print(f"{name:<12}" + "".join(f"{cell(case.get(c)):>26}" for c in cols))
    if data.get("error"):
        print(f"error: {data['error']}")
    sys.stdout.flush()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_parent_death_signal() -> None:
    """Have Linux kill this worker if the watchdog parent dies first (best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


def native_lib_report() -> str:
    """Which shared libraries upstream's native modules need are missing here."""
    import ctypes

    missing = []
    for name in NATIVE_LIBS:
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return f"missing shared libraries: {', '.join(missing)}" if missing else "shared libraries ok"


# --- the worker: everything that touches torch and upstream ----------------------------


class Upstream:
    """Handles on upstream's modules, checked to come from its wheel."""

    def __init__(self, args: argparse.Namespace, rec: dict) -> None:
        import importlib

        if args.site:
            sys.path.insert(0, args.site)
        # pip puts ninja next to the interpreter; torch's JIT looks for it on PATH.
        exe_dir = str(Path(sys.executable).parent)
        if exe_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = exe_dir + os.pathsep + os.environ.get("PATH", "")

        buf_mod = importlib.import_module("mooncake.mooncake_ep_buffer")
        self.pkg_dir = Path(buf_mod.__file__).resolve().parent
        rec["upstream_path"] = str(self.pkg_dir)
        print(f"[upstream] mooncake package: {self.pkg_dir}", flush=True)
        if not (self.pkg_dir / "_pg_jit").is_dir() or not list(self.pkg_dir.glob("_ep*.so")):
            raise RuntimeError(
                f"mooncake was imported from {self.pkg_dir}, which is not the upstream wheel "
                "(no _pg_jit/ or _ep*.so there); put the wheel's site dir first on PYTHONPATH"
            )
        ext = list(self.pkg_dir.glob("_ep*.so"))[0].name
        tag = sys.implementation.cache_tag  # e.g. cpython-312, as in _ep.cpython-312-...so
        if ".cpython-" in ext and f".{tag}-" not in ext:
            raise RuntimeError(
                f"upstream's native module {ext} was not built for this interpreter "
                f"(Python {sys.version.split()[0]}, {tag})"
            )
        self.Buffer = buf_mod.Buffer
        rec["upstream_version"] = self._version()

        # The PG adapter JIT-builds on import and registers the "mooncake" backends then.
        self.pg = None
        self.pg_error = None
        try:
            print("[upstream] importing mooncake.pg (JIT build on first use)", flush=True)
            self.pg = importlib.import_module("mooncake.pg")
        except Exception as exc:
            traceback.print_exc()
            self.pg_error = f"{type(exc).__name__}: {exc}"
            rec["pg_import_error"] = self.pg_error

        try:
            self.ep = importlib.import_module("mooncake.ep")
        except Exception as exc:
            raise RuntimeError(f"cannot import mooncake.ep ({native_lib_report()})") from exc
        if Path(self.ep.__file__).resolve().parent != self.pkg_dir:
            raise RuntimeError(f"mooncake.ep came from {self.ep.__file__}, not {self.pkg_dir}")
        device_type = getattr(self.ep, "DEVICE_TYPE", "cuda")
        if device_type != "cuda":
            raise RuntimeError(f"upstream's EP module was built for {device_type!r}, not cuda")

    @staticmethod
    def _version() -> str | None:
        from importlib import metadata

        for dist_name in UPSTREAM_DISTS:
            try:
                return metadata.version(dist_name)
            except metadata.PackageNotFoundError:
                continue
        return None

    def backend_options(self, active_ranks):
        # The options class moved from mooncake.ep to mooncake.pg across releases.
        for mod in (self.pg, self.ep):
            cls = getattr(mod, "MooncakeBackendOptions", None) if mod is not None else None
            if cls is not None:
                return cls(active_ranks)
        raise RuntimeError("upstream exposes no MooncakeBackendOptions")


def init_group(torch, dist, up: Upstream, args: argparse.Namespace, rec: dict):
    """A world-1 default group: NCCL, else (auto) upstream's "mooncake" backend.

    At world size 1 the EP buffer exchanges nothing through the group when
    RDMA is off, so a stand-in group does not change what the kernels do; the
    backend used is recorded as ``pg_backend``. NCCL comes first: on the GPU
    machine (2026-12-01) upstream's own backend did not finish initialising
    (its world-1 all_reduce probe) within 300 s.
    """
    from datetime import timedelta

    order = ["nccl", "mooncake"] if args.pg_backend == "auto" else [args.pg_backend]
    errors = []
    for name in order:
        try:
            if name == "mooncake" and up.pg is None:
                raise RuntimeError(f"mooncake.pg did not import: {up.pg_error}")
            store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=120))
            kwargs = {}
            keep = None
            if name == "mooncake":
                # Only the tensor's storage is used; upstream's coordinator fills it in.
                keep = torch.ones(1, dtype=torch.int32, device="cuda")
                kwargs["pg_options"] = up.backend_options(keep)
            print(f"[setup] init_process_group(backend={name!r}, world_size=1)", flush=True)
            dist.init_process_group(
                backend=name,
                store=store,
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=120),
                **kwargs,
            )
            probe = torch.ones(1, device="cuda")
            dist.all_reduce(probe)
            torch.cuda.synchronize()
            if probe.item() != 1.0:
                raise RuntimeError(f"all_reduce at world 1 gave {probe.item()}")
            rec["pg_backend"] = name
            return store, keep
        except Exception as exc:
            traceback.print_exc()
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:
                    pass
    rec["pg_errors"] = errors
    raise RuntimeError("no process group could be made: " + "; ".join(errors))


class Case:
    """Inputs and timing loops of one (E, fp8) case on one buffer."""

    def __init__(self, torch, buffer, args: argparse.Namespace, num_experts: int, fp8: bool):
        self.torch = torch
        self.buffer = buffer
        self.args = args
        self.E = num_experts
        self.fp8 = fp8
        T, H, K = args.tokens, args.hidden, args.topk
        dev = "cuda"
        self.active = torch.ones(1, dtype=torch.int32, device=dev)
        self.sets = []
        for _ in range(NUM_INPUT_SETS):
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            vals, idx = torch.topk(torch.randn(T, num_experts, device=dev), K, dim=-1)
            weights = torch.softmax(vals, dim=-1).float().contiguous()
            self.sets.append((x.contiguous(), idx.contiguous(), weights))
        # Stand-in expert outputs for combine: BF16 [E/R, R*T, H] with R = 1.
        self.expert_out = [
            torch.randn(num_experts, T, H, device=dev, dtype=torch.bfloat16)
            for _ in range(NUM_INPUT_SETS)
        ]
        self.spin = SPIN_CYCLES if args.hide_launch else 0

    # One call of each kind. Keyword arguments, so that a renamed parameter fails loudly.

    def dispatch(self, i: int, hook: bool):
        x, idx, _ = self.sets[i % NUM_INPUT_SETS]
        return self.buffer.dispatch(
            x=x,
            topk_idx=idx,
            active_ranks=self.active,
            num_max_dispatch_tokens_per_rank=self.args.tokens,
            num_experts=self.E,
            timeout_us=self.args.timeout_us,
            use_fp8=self.fp8,
            async_finish=False,
            return_recv_hook=hook,
        )

    def combine(self, i: int, handle, set_index: int):
        _, idx, weights = self.sets[set_index]
        return self.buffer.combine(
            x=self.expert_out[i % NUM_INPUT_SETS],
            topk_idx=idx,
            topk_weights=weights,
            active_ranks=self.active,
            timeout_us=self.args.timeout_us,
            handle=handle,
            async_finish=False,
            return_recv_hook=False,
        )

    # Timing.

    def _events(self, n: int):
        ev = self.torch.cuda.Event
        return [(ev(enable_timing=True), ev(enable_timing=True)) for _ in range(n)]

    def _timed(self, pair, fn, *fn_args):
        """Run ``fn`` once from an idle GPU; record events around it if ``pair``."""
        torch = self.torch
        torch.cuda.synchronize()
        if pair is not None and self.spin:
            torch.cuda._sleep(self.spin)
        if pair is not None:
            pair[0].record()
        out = fn(*fn_args)
        if pair is not None:
            pair[1].record()
        wait_event(out)
        return out

    def _elapsed_us(self, pairs) -> list[float]:
        self.torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1000.0 for s, e in pairs]

    def check_counts(self, recv_count) -> str:
        """At world 1 every token reaches each of its top-k experts: counts sum to T*K."""
        got = int(recv_count.sum().item())
        want = self.args.tokens * self.args.topk
        return "ok" if got == want else f"recv_count sums to {got}, expected {want}"

    def run(self) -> dict:
        torch = self.torch
        warmup, iters = self.args.warmup, self.args.iters
        result = {
            "E": self.E,
            "T": self.args.tokens,
            "H": self.args.hidden,
            "topk": self.args.topk,
            "fp8": self.fp8,
        }
        name = case_id(self.E, self.fp8)

        # First call: JIT compiles this shape's kernels; also a sanity check.
        t0 = time.perf_counter()
        out = self._timed(None, self.dispatch, 0, False)
        torch.cuda.synchronize()
        result["first_dispatch_s"] = round(time.perf_counter() - t0, 3)
        result["check_dispatch"] = self.check_counts(out[1])
        del out
        print(f"[{name}] first dispatch {result['first_dispatch_s']} s", flush=True)

        # dispatch alone
        pairs = self._events(iters)
        for i in range(warmup + iters):
            self._timed(pairs[i - warmup] if i >= warmup else None, self.dispatch, i, False)
        result["dispatch_us"] = summarize(self._elapsed_us(pairs))

        # combine alone, every call with the handle of one dispatch (input set 0)
        _, _, handle, _, _ = self._timed(None, self.dispatch, 0, False)
        torch.cuda.synchronize()
        pairs = self._events(iters)
        for i in range(warmup + iters):
            pair = pairs[i - warmup] if i >= warmup else None
            self._timed(pair, self.combine, i, handle, 0)
        result["combine_us"] = summarize(self._elapsed_us(pairs))
        del handle

        # hook mode: the dispatch call launches the send phase, the hook the receive phase
        send_pairs, hook_pairs = self._events(iters), self._events(iters)
        check = None
        for i in range(warmup + iters):
            timed = i >= warmup
            out = self._timed(send_pairs[i - warmup] if timed else None, self.dispatch, i, True)
            hook = out[4]
            if hook is None:
                raise RuntimeError("dispatch(return_recv_hook=True) returned no hook")
            self._timed(hook_pairs[i - warmup] if timed else None, hook)
            if check is None:
                torch.cuda.synchronize()
                check = self.check_counts(out[1])
            del out, hook
        result["send_half_us"] = summarize(self._elapsed_us(send_pairs))
        result["recv_hook_us"] = summarize(self._elapsed_us(hook_pairs))
        result["check_hook"] = check
        return result


def wait_event(out) -> None:
    """Have the current stream wait on the EventOverlap a call returned, if it holds an event.

    Synchronous calls return an EventOverlap without an event (the native
    code already joined its stream back); waiting on that would assert.
    """
    if not isinstance(out, tuple):
        return
    for item in out:
        if type(item).__name__ == "EventOverlap" and getattr(item, "event", None) is not None:
            item.current_stream_wait()


def worker(args: argparse.Namespace) -> None:
    out_path = Path(args.out)
    rec: dict = {
        "impl": IMPL,
        "gpu": None,
        "torch": None,
        "cases": [],
        "error": PENDING,
        "complete": False,
        "stage": "start",
        "iters": args.iters,
        "warmup": args.warmup,
        "timeout_us": args.timeout_us,
        "hide_launch": args.hide_launch,
        "timing": "CUDA events around each call, the device synchronised before each; "
        + ("a GPU spin queued before the start event" if args.hide_launch else "launch included"),
        "python": sys.version.split()[0],
    }

    def run_cases(torch, dist, up, stage) -> None:
        cases = selected_cases(args)
        if not cases:
            raise RuntimeError(f"--cases {args.cases!r} selects no case")
        hints = [
            up.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, 1, e) for e, _ in cases
        ]
        num_bytes = max(int(h) for h in hints)
        rec["num_ep_buffer_bytes"] = num_bytes
        stage(f"create Buffer ({num_bytes / 2**20:.1f} MiB)")
        buffer = up.Buffer(dist.group.WORLD, num_bytes)
        rec["ibgda_disabled"] = bool(buffer.runtime.ibgda_disabled())
        rec["python_fallback"] = bool(getattr(buffer, "_use_fallback", False))
        if rec["python_fallback"]:
            raise RuntimeError("upstream Buffer chose its torch.distributed fallback, not kernels")

        for num_experts, fp8 in cases:
            stage(f"case {case_id(num_experts, fp8)}")
            try:
                result = Case(torch, buffer, args, num_experts, fp8).run()
            except Exception as exc:
                traceback.print_exc()
                result = {
                    "E": num_experts,
                    "T": args.tokens,
                    "H": args.hidden,
                    "topk": args.topk,
                    "fp8": fp8,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            rec["cases"].append(result)
            torch.cuda.empty_cache()
            write_json(out_path, rec, indent=2)

    run_worker(args, out_path, rec, run_cases)


def run_worker(args: argparse.Namespace, out_path: Path, rec: dict, run_cases) -> None:
    """A worker's frame (bench_ep_upstream_elastic.py's too): torch on a GPU, upstream's
    package and a process group of one, then ``run_cases(torch, dist, up, stage)``, which adds
    to ``rec["cases"]``; whatever happens, ``rec`` is left in ``out_path``, saying how far
    the worker got (``stage``) and why it stopped."""

    def stage(text: str) -> None:
        rec["stage"] = text
        print(f"[stage] {text}", flush=True)
        write_json(out_path, rec, indent=2)

    try:
        set_parent_death_signal()
        stage("import torch")
        import torch
        import torch.distributed as dist

        rec["torch"] = torch.__version__
        stage("check CUDA")
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available to torch")
        torch.cuda.set_device(0)
        rec["gpu"] = torch.cuda.get_device_name(0)
        torch.manual_seed(0)

        stage("import upstream mooncake")
        up = Upstream(args, rec)

        stage("init process group")
        keep_alive = init_group(torch, dist, up, args, rec)

        run_cases(torch, dist, up, stage)

        failed = [c for c in rec["cases"] if c.get("error")]
        if len(failed) == len(rec["cases"]):
            rec["error"] = f"every case failed; first: {failed[0]['error']}"
        else:
            rec.pop("error", None)
        rec["complete"] = True
        rec["stage"] = "done"
        del keep_alive
    except (Exception, KeyboardInterrupt) as exc:
        traceback.print_exc()
        rec["error"] = f"{rec['stage']}: {type(exc).__name__}: {exc}"
    write_json(out_path, rec, indent=2)


# --- the watchdog parent ---------------------------------------------------------------


def supervise(args: argparse.Namespace, impl: str = IMPL, script: str = __file__, show=None) -> int:
    """Run the worker (``script --worker``, this one's by default) in a child process;
    whatever happens, leave a JSON file behind, and print it with ``show`` (this
    module's print_table by default). bench_ep_upstream_elastic.py uses it too.
    Returns the exit status: 1 when the run as a whole failed (no GPU, no wheel, every
    case failed, the worker died), which the JSON's "error" says."""
    show = show or print_table
    out_path = Path(args.out)
    write_json(
        out_path,
        {"impl": impl, "gpu": None, "torch": None, "cases": [], "error": NOT_STARTED},
        indent=2,
    )
    cmd = [sys.executable, str(Path(script).resolve()), *sys.argv[1:], "--worker"]
    proc = subprocess.Popen(cmd)

    def forward(signum, _frame):
        # The caller is giving up: stop the worker, then fall through to the summary.
        proc.send_signal(signal.SIGTERM)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, forward)
    problem = None
    try:
        rc = proc.wait(timeout=args.deadline_s if args.deadline_s > 0 else None)
        if rc != 0:
            problem = f"worker exited with status {rc}"
    except subprocess.TimeoutExpired:
        problem = f"worker ran past --deadline-s {args.deadline_s:g} s and was stopped"
    except KeyboardInterrupt as exc:
        problem = f"interrupted ({exc})"
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    data = read_json(out_path) or {"impl": impl, "gpu": None, "torch": None, "cases": []}
    previous = data.get("error")
    worker_said = previous if previous not in (None, PENDING, NOT_STARTED) else None
    where = f"last stage: {data.get('stage')}"
    if problem:
        data["error"] = f"{worker_said}; then {problem}" if worker_said else f"{problem}; {where}"
    elif not data.get("complete") and not worker_said:
        data["error"] = f"worker ended without finishing; {where}"
    if data.get("error") != previous:
        write_json(out_path, data, indent=2)
    show(data)
    print(f"results: {out_path}", flush=True)
    return 1 if data.get("error") else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results path")
    p.add_argument("--quick", action="store_true", help="fewer warm-up and timed calls")
    p.add_argument(
        "--cases",
        default="",
        help="comma-separated words; runs the cases whose id (E256-fp8, E288-bf16, ...) "
        "contains one of them",
    )
    p.add_argument("--experts", default="256,288", help="comma-separated expert counts")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (T)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (H)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (20; quick: 5)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (200; quick: 30)")
    p.add_argument("--timeout-us", type=int, default=-1, help="kernel timeout; -1: none")
    p.add_argument(
        "--hide-launch",
        action="store_true",
        help="spin the GPU before each start event so times leave out host launch cost",
    )
    p.add_argument(
        "--pg-backend",
        choices=("auto", "mooncake", "nccl"),
        default="auto",
        help="process group for the buffer; auto: nccl, else upstream's mooncake",
    )
    p.add_argument("--site", default="", help="directory to put first on sys.path")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=540.0,
        help="stop the worker after this long (0: never); the JSON keeps finished cases",
    )
    p.add_argument("--inline", action="store_true", help="measure in this process, no watchdog")
    # The watchdog's child: --inline without the table, which the parent prints.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.experts = [int(e) for e in args.experts.split(",") if e.strip()]
    if args.warmup is None:
        args.warmup = 5 if args.quick else 20
    if args.iters is None:
        args.iters = 30 if args.quick else 200
    args.iters = max(1, args.iters)
    # At least one untimed call: the first call of a shape JIT-compiles its kernels.
    args.warmup = max(1, args.warmup)
    return args


def main() -> None:
    args = parse_args()
    if args.inline or args.worker:
        worker(args)
        data = read_json(Path(args.out))
        if data is not None and not args.worker:
            print_table(data)
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: native destructors at exit are not worth a crash here.
        os._exit(0)
    sys.exit(supervise(args))


if __name__ == "__main__":
    main()
