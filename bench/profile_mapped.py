"""Where a large eager ``all_reduce`` on the ``mooncake`` CUDA backend spends its time.

``bench_pg_cuda.py`` times the whole call; ``mapped_ceiling.py`` times the data movement
alone with torch's kernels. This splits the gap between them, for the plane and for the
mapped path (``MOONCAKE_CUDA_MAPPED=1``, one launch per piece), on one GPU shared by
``--world`` processes (run it under MPS):

- ``op us``: each call's host time, calls back to back (an eager op on the plane blocks
  its caller until the device has run it; a mapped one does not);
- ``back-to-back us``: per call, on the device's clock, over calls back to back (what a
  training or serving loop sees);
- ``kernels``: per call, each kernel's and copy's count and median device time (CUDA
  profiler), and the sum of count times median;
- ``timeline``: one call as this process saw it: the CUDA runtime calls (launches,
  synchronisations) and the device's kernels and copies, microseconds from the call's
  start, so the host's time before the first launch and after the last kernel shows.

Variants: ``plane`` (mapped off) and ``mapped``.

    python3 bench/profile_mapped.py [--world 2] [--mib 64] [--out F.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import harness

VARIANTS = {
    "plane": {"MOONCAKE_CUDA_MAPPED": "0"},
    "mapped": {"MOONCAKE_CUDA_MAPPED": "1"},
}


def _timeline(prof, start_us: float, end_us: float) -> list[str]:
    """The events of one call (between its two markers) as lines: microseconds from its
    start, duration, where (host runtime call or device), name."""
    rows = []
    for ev in prof.events():
        t0, t1 = ev.time_range.start, ev.time_range.end
        if t0 < start_us - 1 or t0 > end_us + 1:
            continue
        gpu = ev.device_type == torch.autograd.DeviceType.CUDA
        if not gpu and not ev.name.startswith("cuda"):
            continue
        rows.append((t0 - start_us, t1 - t0, "device" if gpu else "host", ev.name[:70]))
    rows.sort()
    return [f"{t:9.1f} {d:8.1f}  {w:6s} {n}" for t, d, w, n in rows]


def member(rank: int, world: int, port: int, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from mooncake import pg
    from mooncake.launch import init_rank

    torch.cuda.set_device(0)
    init_rank(rank, world, port, "mooncake", timeout_s=120)
    n = cfg["mib"] * (1 << 20) // 2
    t = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    # Right first: a sum of ones is the world size (a first op maps the tensor).
    for _ in range(3):
        t.fill_(1.0)
        dist.all_reduce(t)
    torch.cuda.synchronize()
    if not bool((t == world).all()):
        return {"error": f"rank {rank}: all_reduce gave {t.float().unique().tolist()[:4]}"}
    t.fill_(0.0)  # sums of zeros from here on: the values stay finite
    paths0 = pg.get_op_paths(dist.group.WORLD)
    res: dict = {}
    calls = cfg["calls"]
    for _ in range(5):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    host = []
    for _ in range(calls):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    res["op us"] = round(harness.median(host), 1)
    res["op us, fastest"] = round(min(host), 1)
    # Back to back as the device sees them (a call that does not block its host
    # overlaps the next one's host work).
    res["back-to-back us"] = round(
        harness.cuda_span_ms(lambda: dist.all_reduce(t), calls) * 1000 / calls, 1
    )
    marks = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(cfg["profiled"]):
            with record_function(f"call{i}"):
                dist.all_reduce(t)
    torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.name.startswith("call") and ev.device_type != torch.autograd.DeviceType.CUDA:
            marks.append((ev.time_range.start, ev.time_range.end))
        elif ev.device_type == torch.autograd.DeviceType.CUDA:
            per.setdefault(ev.name[:60], []).append(ev.device_time)
    k = cfg["profiled"]
    # Medians, not sums: the profiler's first call is its own warm-up (tens of ms).
    kern = {
        name: {"per call": round(len(v) / k, 2), "median us": round(harness.median(v), 1)}
        for name, v in per.items()
        if not name.startswith("call")
    }
    res["kernels"] = kern
    res["kernels us per call"] = round(
        sum(x["per call"] * x["median us"] for x in kern.values()), 1
    )
    marks.sort()
    if marks:
        mid = marks[len(marks) // 2]
        res["profiled call us"] = round(mid[1] - mid[0], 1)
        res["timeline"] = _timeline(prof, *mid)
    paths1 = pg.get_op_paths(dist.group.WORLD)
    res["op paths"] = {p: paths1.get(p, 0) - paths0.get(p, 0) for p in paths1}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="processes on the GPU (run under MPS)")
    p.add_argument("--mib", type=int, default=64, help="the all_reduce's bytes per rank, MiB")
    p.add_argument("--calls", type=int, default=50, help="timed calls per variant")
    p.add_argument("--profiled", type=int, default=9, help="calls under the CUDA profiler")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    p.add_argument("--out", default="", help="write the results as JSON here")
    harness.add_if_gpu(p)
    a = p.parse_args(argv)
    if a.world < 2:
        p.error(f"--world must be at least 2 (a lone rank reduces nothing), got {a.world}")
    names = [v for v in a.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {','.join(VARIANTS)}")
    status = harness.no_gpu_status("profile_mapped", a.if_gpu)
    if status is not None:
        return status
    from mooncake.launch import run_local

    cfg = {"mib": a.mib, "calls": a.calls, "profiled": a.profiled}
    out: dict = {"world": a.world, "mib": a.mib}
    failed = False
    for name in names:
        ranks = run_local(member, a.world, args=(cfg,), env=VARIANTS[name], timeout_s=150)
        out[name] = ranks
        failed = failed or any("error" in r for r in ranks)
        ops = [(r.get("op us"), r.get("back-to-back us")) for r in ranks]
        kern = [r.get("kernels us per call") for r in ranks]
        print(
            f"{name}: (op us, back-to-back us) {ops}, kernels us per call {kern}, paths {ranks[0].get('op paths')}"
        )
        for line in ranks[0].get("timeline", []):
            print("   ", line)
    if a.out:
        harness.write_json(a.out, out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
