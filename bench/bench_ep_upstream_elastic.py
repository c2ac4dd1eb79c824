"""Upstream Mooncake 0.3.14's ElasticBuffer (PyPI wheel) on one GPU, world 1: the
``upstream`` column of ``bench_elastic_buffer.py``.

It drives ``mooncake.mooncake_elastic_buffer.ElasticBuffer`` of the published
``mooncake-transfer-engine-cuda13==0.3.14`` wheel at the shapes of
``bench_elastic_buffer.py``: T in {512, 1024, 4096} tokens, H=7168, top-8 of E=256
(every expert local), BF16 and FP8 (``x`` pre-quantised with our ``mooncake/fp8.py``'s
formula, loaded from its file: one fp32 scale per 128 channels), combine in BF16. Per
case, with CUDA events around each call on an idle GPU (the same method as ours):

- ``dispatch_us``: a fresh ``dispatch(x, topk_idx, topk_weights, num_experts=E)``
  (upstream's default ``do_cpu_sync=True``), two input sets alternating;
- ``combine_us``: ``combine(y, handle)``, each after an untimed dispatch of its own, ``y``
  the received rows as BF16;
- ``cached_dispatch_us`` (at ``--cached-tokens``): ``dispatch(x, handle=h)``.

Why it can run on one GPU: with ``transport="auto"`` upstream picks NCCL's device API
only for 2 or 8 ranks on a host (its compiled topologies), so world 1 takes its IBGDA
runtime, which without an RDMA NIC falls back to peer-to-peer (CUDA IPC: at world 1 the
GPU's own memory); its kernels are JIT-compiled with nvcc on first use of a shape (the
first call's time, ``first_dispatch_s``, includes that). Nothing needs NVSHMEM. Several
processes on one GPU would count as several hosts (upstream sizes its domains by
``LOCAL_WORLD_SIZE`` or the GPU count) and need RDMA between them, so only world 1 runs.

Checks, recorded per case (``check_dispatch``, ``check_combine``): at world 1 every token
comes back once, its row as sent (matched by ``recv_src_metadata[:, 0] % T``), and
combine of those rows returns them.

Like ``bench_ep_upstream.py`` (whose helpers it uses), it imports upstream's package,
named ``mooncake`` as ours, so it runs with upstream's site first on the path, in a child
process under a deadline, and always leaves a JSON file (``"error"`` says what failed):

    PYTHONPATH=/tmp/upstream-site CXX=/usr/bin/g++ python3 bench/bench_ep_upstream_elastic.py \\
        --out /tmp/up_elastic.json
    python3 bench/bench_elastic_buffer.py --upstream /tmp/up_elastic.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

# The standard library and the stdlib-only helpers at module level: the watchdog parent
# never loads torch.
import bench_ep_upstream as base
import harness

IMPL = "upstream-0.3.14 ElasticBuffer"
DEFAULT_OUT = harness.RESULTS / "elastic_buffer_upstream.json"
OUR_FP8 = harness.HERE.parent / "python" / "mooncake" / "fp8.py"


def our_fp8():
    """Our ``mooncake/fp8.py`` (torch only), loaded from its file under another name:
    ``mooncake`` here is upstream's package."""
    spec = importlib.util.spec_from_file_location("ours_fp8", OUR_FP8)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call_us(torch, fn) -> tuple[float, object]:
    """Microseconds of ``fn()`` from an idle GPU, by CUDA events; and its result."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    base.wait_event(out)
    end.synchronize()
    return start.elapsed_time(end) * 1000.0, out


def check_dispatch(torch, out, x, T: int) -> str:
    recv, _, _, handle, _ = out
    data = recv[0] if isinstance(recv, tuple) else recv
    if data.shape[0] != T:
        return f"{data.shape[0]} rows received, expected every one of the {T} tokens once"
    tokens = handle.recv_src_metadata[:, 0].long() % T
    if sorted(tokens.tolist()) != list(range(T)):
        return "recv_src_metadata[:, 0] does not name every token once"
    sent = x[0] if isinstance(x, tuple) else x
    if isinstance(recv, tuple):
        ok = torch.equal(recv[0].view(torch.uint8), sent[tokens].view(torch.uint8))
        ok = ok and torch.equal(recv[1], x[1][tokens])
    else:
        ok = torch.equal(recv, sent[tokens])
    return "ok" if ok else "received rows differ from the tokens sent"


def run_case(torch, buf, fp8_mod, args, T: int, fp8: bool) -> dict:
    H, E, K = args.hidden, args.experts, args.topk
    res = {"T": T, "H": H, "E": E, "topk": K, "fp8": fp8}
    sets = []
    for _ in range(2):
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        idx = torch.randn(T, E, device="cuda").topk(K, dim=1).indices
        w = torch.rand(T, K, device="cuda")
        sets.append((fp8_mod.quantize(x) if fp8 else x, idx, w))

    def as_bf16(recv):
        return fp8_mod.dequantize(*recv).to(torch.bfloat16) if isinstance(recv, tuple) else recv

    def fresh(k):
        x, idx, w = sets[k]
        return buf.dispatch(x, idx, w, num_experts=E, num_max_tokens_per_rank=T)

    t0 = time.perf_counter()
    out = fresh(0)
    torch.cuda.synchronize()
    res["first_dispatch_s"] = round(time.perf_counter() - t0, 3)
    res["check_dispatch"] = check_dispatch(torch, out, sets[0][0], T)
    y = as_bf16(out[0]).contiguous()
    combined = buf.combine(y, out[3])[0]
    torch.cuda.synchronize()
    tokens = out[3].recv_src_metadata[:, 0].long() % T
    want = torch.empty_like(y)
    want[tokens] = y
    res["check_combine"] = "ok" if torch.equal(combined, want) else "combined rows differ"
    handle0 = out[3]
    del out, y, combined

    def timed(make_call) -> dict:
        times = []
        for i in range(args.warmup + args.iters):
            t, _ = call_us(torch, make_call(i))
            if i >= args.warmup:
                times.append(t)
        return base.summarize(times)

    res["dispatch_us"] = timed(lambda i: lambda: fresh(i % 2))

    def combine_call(i):
        recv, _, _, handle, _ = fresh(i % 2)
        torch.cuda.synchronize()
        y = as_bf16(recv).contiguous()
        return lambda: buf.combine(y, handle)

    res["combine_us"] = timed(combine_call)
    if T == args.cached_tokens:
        res["cached_dispatch_us"] = timed(
            lambda i: lambda: buf.dispatch(sets[i % 2][0], handle=handle0)
        )
    return res


def worker(args: argparse.Namespace) -> None:
    out_path = Path(args.out)
    rec: dict = {"impl": IMPL, "gpu": None, "torch": None, "cases": [], "error": base.PENDING,
                 "complete": False, "stage": "start", "iters": args.iters,
                 "warmup": args.warmup, "python": sys.version.split()[0]}  # fmt: skip

    def run_cases(torch, dist, up, stage) -> None:
        fp8_mod = our_fp8()
        eb_mod = importlib.import_module("mooncake.mooncake_elastic_buffer")
        if Path(eb_mod.__file__).resolve().parent != up.pkg_dir:
            raise RuntimeError(f"mooncake_elastic_buffer came from {eb_mod.__file__}")
        rec["buffers"] = {}
        for fp8 in args.fp8:
            name = "FP8" if fp8 else "BF16"
            stage(f"create ElasticBuffer ({name})")
            buf = eb_mod.ElasticBuffer(
                dist.group.WORLD, num_max_tokens_per_rank=max(args.tokens), hidden=args.hidden,
                num_topk=args.topk, use_fp8_dispatch=fp8,
            )  # fmt: skip
            rec["buffers"][name] = {
                "num_bytes": int(buf.num_bytes),
                "transport": buf.transport,
                "ibgda_disabled": bool(buf.runtime.ibgda_disabled()),
            }
            for T in args.tokens:
                stage(f"case T={T} {name}")
                try:
                    rec["cases"].append(run_case(torch, buf, fp8_mod, args, T, fp8))
                except Exception as exc:
                    traceback.print_exc()
                    rec["cases"].append(
                        {"T": T, "fp8": fp8, "error": f"{type(exc).__name__}: {exc}"}
                    )
                torch.cuda.empty_cache()
                harness.write_json(out_path, rec, indent=2)
            buf.destroy()

    base.run_worker(args, out_path, rec, run_cases)


def print_table(data: dict) -> None:
    print(f"\n{data.get('impl')} on {data.get('gpu')} (torch {data.get('torch')}), world 1")
    print(f"buffers: {data.get('buffers')}")
    for c in data.get("cases", []):
        name = f"T={c['T']} {'FP8' if c['fp8'] else 'BF16'}"
        if c.get("error"):
            print(f"{name}: error: {c['error']}")
            continue
        cells = [f"{k} {c[k]['median']:.1f} us" for k in
                 ("dispatch_us", "combine_us", "cached_dispatch_us") if k in c]  # fmt: skip
        print(f"{name}: {', '.join(cells)}; first call {c['first_dispatch_s']} s; checks: "
              f"{c['check_dispatch']}, {c['check_combine']}")  # fmt: skip
    if data.get("error"):
        print(f"error: {data['error']}")
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.arg_parser(__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results path")
    p.add_argument("--tokens", default="512,1024,4096", help="comma-separated T")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--fp8", default="0,1", help="comma-separated: 0 BF16, 1 FP8")
    p.add_argument("--cached-tokens", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="10 timed calls, 2 warm-up")
    p.add_argument("--pg-backend", choices=("auto", "mooncake", "nccl"), default="auto",
                   help="the world-1 group; auto: nccl, else upstream's mooncake")  # fmt: skip
    p.add_argument("--site", default="", help="directory to put first on sys.path")
    p.add_argument("--deadline-s", type=float, default=540.0, help="stop the worker after this")
    p.add_argument("--inline", action="store_true", help="measure in this process, no watchdog")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.tokens = harness.csv_ints(a.tokens)
    a.fp8 = [bool(int(f)) for f in a.fp8.split(",")]
    if a.quick:
        a.iters, a.warmup = min(a.iters, 10), min(a.warmup, 2)
    a.iters = max(1, a.iters)
    return a


def main() -> None:
    args = parse_args()
    if args.inline or args.worker:
        worker(args)
        if not args.worker:
            print_table(harness.read_json(Path(args.out)) or {})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no native destructors at exit
    sys.exit(base.supervise(args, IMPL, __file__, print_table))


if __name__ == "__main__":
    main()
