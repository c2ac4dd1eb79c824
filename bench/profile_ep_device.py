"""Where an EP device-path call spends its time, on one GPU (world 1).

Two views, for the people tuning ``src/kernels/ep_ll/`` and ``mooncake/ep/device.py``:

- host: microseconds per call of each layer, from a bare torch op to the
  whole ``Buffer.dispatch``/``combine`` (calls back to back, the device
  synchronised every few calls so its queue never fills);
- device: every kernel's own duration, from the CUDA profiler (no launch or
  host time in it), for dispatch, its send and receive halves, and combine.

    python3 bench/profile_ep_device.py [--tokens 128] [--hidden 7168] [--experts 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import harness


def host_us(fn, calls: int = 300, every: int = 10) -> float:
    """Median host microseconds of ``fn()`` over ``calls`` calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
        if i % every == every - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return harness.median(out)


def back_to_back_us(fn, calls: int = 200) -> float:
    """Device microseconds per call when calls follow each other (host and device
    overlap, so this is max(host, device) per call)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    return harness.cuda_span_ms(fn, calls) * 1000 / calls


def kernel_table(fn, calls: int = 20) -> dict[str, float]:
    """Median device microseconds per kernel name over ``calls`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(ev.name[:60], []).append(ev.device_time)
    return {k: round(harness.median(v), 2) for k, v in times.items()}


def member(rank: int, world: int, port: int, cfg: dict) -> dict:
    import torch.distributed as dist

    from mooncake import pg
    from mooncake.ep import device as device_path
    from mooncake.launch import init_rank
    from mooncake.mooncake_ep_buffer import Buffer

    torch.cuda.set_device(0)
    init_rank(rank, world, port)
    T, H, E, K = cfg["T"], cfg["H"], cfg["E"], cfg["K"]
    buf = Buffer(dist.group.WORLD, Buffer.get_ep_buffer_size_hint(T, H, world, E), device="cuda")
    dev = buf._device
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.cuda()
    w = torch.softmax(torch.rand(T, K, generator=g), dim=1).cuda()
    active = torch.ones(world, dtype=torch.int32, device="cuda")
    res: dict = {"gpu": torch.cuda.get_device_name(0), "T": T, "H": H, "E": E, "K": K}
    small = torch.zeros(16, device="cuda")

    host = res["host_us"] = {}
    host["torch op (zero_ on 16 floats)"] = host_us(lambda: small.zero_())
    host["torch.empty x6 (dispatch's outputs)"] = host_us(
        lambda: [torch.empty(E, T, H, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(6)]
    )
    for fp8 in (True, False):
        tag = "FP8" if fp8 else "BF16"
        seq = [buf._seq]

        def ext_dispatch(outputs=None, fp8=fp8, seq=seq):
            seq[0] += 1
            return dev.ext.dispatch(
                x,
                idx,
                active,
                None,
                None,
                outputs,
                T,
                E,
                world,
                seq[0],
                10**9,
                fp8,
                3,
                dev.num_blocks,
            )

        outs = ext_dispatch()
        host[f"{tag} ext.dispatch, outputs given"] = host_us(lambda outs=outs: ext_dispatch(outs))
        before = dev.ext.pool_stats()
        host[f"{tag} ext.dispatch, allocating"] = host_us(ext_dispatch)
        hits, misses = (a - b for a, b in zip(dev.ext.pool_stats(), before, strict=True))
        res[f"{tag} output pool over those calls"] = {"hits": hits, "misses": misses}
        buf._seq = seq[0]
        host[f"{tag} Buffer.dispatch"] = host_us(
            lambda fp8=fp8: buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8)
        )
        # The send half alone (its receive half never runs: host time only).
        host[f"{tag} Buffer.dispatch, send half"] = host_us(
            lambda fp8=fp8: buf.dispatch(
                x, idx, active, T, E, -1, use_fp8=fp8, return_recv_hook=True
            )
        )
        host[f"{tag} ext.dispatch, send phase, outputs given"] = host_us(
            lambda outs=outs, fp8=fp8: dev.ext.dispatch(
                x,
                idx,
                active,
                None,
                None,
                outs,
                T,
                E,
                world,
                buf._seq + 1,
                10**9,
                fp8,
                1,
                dev.num_blocks,
            )
        )
        res[f"{tag} dispatch back-to-back us"] = back_to_back_us(
            lambda fp8=fp8: buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8)
        )
        recv_x, _, handle, _, _ = buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8)
        y = (recv_x[0].float() * 0.5).to(torch.bfloat16) if fp8 else recv_x
        out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
        # A combine of one handle again and again finds its flags raised already: the
        # receive half does not wait, which is what a host-time measure wants.
        host[f"{tag} Buffer.combine"] = host_us(
            lambda y=y, h=handle: buf.combine(y, idx, w, active, -1, h)
        )
        host[f"{tag} Buffer.combine, out given"] = host_us(
            lambda y=y, h=handle, out=out: buf.combine(y, idx, w, active, -1, h, out=out)
        )

        def round_trip(fp8=fp8, y=y):
            _, _, h, _, _ = buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8)
            buf.combine(y, idx, w, active, -1, h)

        res[f"{tag} dispatch+combine back-to-back us"] = back_to_back_us(round_trip)
        res[f"{tag} kernels (dispatch+combine)"] = kernel_table(round_trip)

        def halves(fp8=fp8, y=y):
            _, _, h, _, hook = buf.dispatch(
                x, idx, active, T, E, -1, use_fp8=fp8, return_recv_hook=True
            )
            hook()
            _, _, hook2 = buf.combine(y, idx, w, active, -1, h, return_recv_hook=True)
            hook2()

        res[f"{tag} kernels (halves)"] = kernel_table(halves)
    res["cuda_ipc"] = device_path.available() and bool(pg._ext)
    return res


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The options both profiles take besides their tokens: the shape, --out, --if-gpu."""
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--out", default=None, help="JSON file for the results")
    harness.add_if_gpu(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128)
    add_shape_args(p)
    a = p.parse_args(argv)
    status = harness.no_gpu_status("profile_ep_device", a.if_gpu)
    if status is not None:
        return status
    from mooncake.launch import run_local

    cfg = {"T": a.tokens, "H": a.hidden, "E": a.experts, "K": a.topk}
    res = run_local(member, 1, args=(cfg,), timeout_s=240)[0]  # within the step's 300 s
    print(json.dumps(res, indent=1))
    if a.out:
        harness.write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
