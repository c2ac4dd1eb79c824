"""Where an ElasticBuffer device-path call spends its time, on one GPU.

For the people cutting the host cost of ``mooncake/ep/throughput_device.py`` and the
binding (``src/torch/ep_ht_device.cc``): ``bench_elastic_buffer.py`` times a call on an
idle GPU (host work, launches and kernels together), and at world 1 that is several
times the copy floor. Three views split it:

- host: microseconds per call of each layer, from a bare torch op and the binding's
  ``layout`` and ``dispatch`` alone to the whole ``ElasticBuffer.dispatch`` (CPU sync,
  no sync, cached) and ``combine`` (calls back to back, the device synchronised every few
  calls so its queue never fills); and the same calls back to back as the device sees them
  (max(host, device) per call); with ``--world`` above 1 (processes sharing the GPU,
  under MPS) the whole calls only, each rank's figures (every rank calls alike);
- device: every kernel's own duration, from the CUDA profiler;
- Python: the functions and binding calls a CPU-sync dispatch and a combine spend their
  host time in (cProfile, by own time: a binding call or a ``.cpu()`` that waits for the
  device shows as a builtin method);
- with ``--world`` above 1, each kernel block's start and end (``%globaltimer``, one
  clock for all the processes on the GPU) in a few cached dispatches and combines, and
  a summary: how far apart the processes' kernels started, and when each one's sender
  and receiver blocks were done (whether the kernels ran side by side, and who waited).

    python3 bench/profile_elastic_buffer.py [--world 1] [--tokens 512,4096] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys

import torch

import harness
from profile_ep_device import add_shape_args, back_to_back_us, host_us, kernel_table


def python_profile(fn, calls: int = 200, top: int = 14) -> list[str]:
    """The ``top`` entries by own time over ``calls`` calls of ``fn`` (microseconds per
    call), one line each."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 10 == 9:
            torch.cuda.synchronize()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, ncalls, own, cum, _) in stats.stats.items():
        where = f"{path.rsplit('/', 1)[-1]}:{line}({name})" if line else name
        rows.append((own, cum, ncalls, where))
    rows.sort(reverse=True)
    return [
        f"{own / calls * 1e6:8.1f} own {cum / calls * 1e6:8.1f} cum us/call  {n / calls:5.1f}x  {w}"
        for own, cum, n, w in rows[:top]
    ]


def block_stamps(dev, fn, blocks: int, calls: int = 5, extra: int = 0) -> list[list[int]]:
    """Each block's start and end (%globaltimer ns, one clock for every process on the
    GPU) in ``calls`` calls of ``fn`` one at a time: [2 * blocks + extra] per call,
    senders (or repliers) first; a layout pass (``extra`` 1) ends its blocks when their
    chunks are counted, and its last block's end follows them."""
    stamps = torch.zeros(2 * blocks + extra, dtype=torch.int64, device="cuda")
    dev.ext.set_stamps(stamps)
    out = []
    try:
        for _ in range(calls):
            stamps.zero_()
            fn()
            torch.cuda.synchronize()
            out.append(stamps.cpu().tolist())
    finally:
        dev.ext.set_stamps(None)
    return out


def layout_phases(calls: list[list[int]]) -> dict:
    """A layout pass's phases from its stamps (the blocks that ran: a grid may be
    smaller than the stamps' room), median over the calls (us): its blocks counting
    their chunks (first start to last end) and its last block's plan after them."""
    count, last, grid = [], [], 0
    for c in calls:
        grid = 0  # the blocks that ran: pairs up to the first empty one, then the last stamp
        while 2 * grid + 1 < len(c) and c[2 * grid + 1]:
            grid += 1
        final = c[2 * grid] if 2 * grid < len(c) else 0
        if grid == 0 or not final:
            return {"error": "the layout pass wrote no stamps"}
        t0, t1 = min(c[0 : 2 * grid : 2]), max(c[1 : 2 * grid : 2])
        count.append((t1 - t0) / 1e3)
        last.append((final - t1) / 1e3)
    return {
        "blocks": grid,
        "chunks counted us": round(harness.median(count), 1),
        "last block us": round(harness.median(last), 1),
    }


def stamps_summary(ranks: list[dict]) -> dict:
    """Per T and call kind, per call: how far apart the processes' kernels started
    (skew), and for each rank when its sender and receiver blocks were done, from the
    first start on the GPU (us): whether the kernels ran side by side, and which half
    waited."""
    out: dict = {}
    for key in ranks[0]:
        if not key.startswith("T="):
            continue
        for name in ("dispatch, cached", "combine"):
            per_rank = [r[key].get(f"stamps: {name}") for r in ranks]
            if any(p is None for p in per_rank):
                continue
            rows = []
            for i in range(len(per_rank[0])):
                calls = [p[i] for p in per_rank]
                if any(0 in c for c in calls):  # a block that wrote nothing: no figures
                    rows.append({"error": "a block wrote no stamp"})
                    continue
                starts = [c[0::2] for c in calls]
                ends = [c[1::2] for c in calls]
                t0 = min(min(s) for s in starts)
                half = len(starts[0]) // 2
                rows.append({
                    "start skew us": round((max(min(s) for s in starts) - t0) / 1e3, 1),
                    "senders done us": [round((max(e[:half]) - t0) / 1e3, 1) for e in ends],
                    "receivers done us": [round((max(e[half:]) - t0) / 1e3, 1) for e in ends],
                    "block us (median)": [
                        round(harness.median([b - a for a, b in zip(s, e, strict=True)]) / 1e3, 1)
                        for s, e in zip(starts, ends, strict=True)
                    ],
                })  # fmt: skip
            out[f"{key} {name}"] = rows
    return out


def member(rank: int, world: int, port: int, cfg: dict) -> dict:
    import torch.distributed as dist

    from mooncake.launch import init_rank
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    torch.cuda.set_device(0)
    init_rank(rank, world, port)
    H, E, K = cfg["H"], cfg["E"], cfg["K"]
    sms = cfg.get("num_sms") or None  # the calls' grid (None: this process's share)
    res: dict = {"gpu": torch.cuda.get_device_name(0), "H": H, "E": E, "K": K, "num_sms": sms}
    small = torch.zeros(16, device="cuda")
    res["torch op (zero_ on 16 floats) us"] = host_us(lambda: small.zero_())
    res["torch.empty x10 (layout's tensors) us"] = host_us(
        lambda: [torch.empty(512, 10, dtype=torch.int32, device="cuda") for _ in range(10)]
    )
    eb = ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=max(cfg["tokens"]), hidden=H, num_topk=K
    )
    for T in cfg["tokens"]:
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
        idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.cuda()
        w = torch.softmax(torch.rand(T, K, generator=g), dim=1).cuda()
        recv, _, _, handle, _ = eb.dispatch(x, idx, w, num_experts=E)
        dev = eb._device
        if eb.path != "device" or dev is None:
            return {**res, "error": f"the dispatch took the {eb.path} path, not the device path"}
        row = res[f"T={T}"] = {}
        y = recv if isinstance(recv, torch.Tensor) else recv[0]

        blocks = dev._blocks(sms)
        res["blocks"] = blocks
        if "host us: small calls" not in res:
            # Without cProfile, which charged _present 6-7 us a call on the GPU machine
            # (its own time above its cumulative time) when it called view_version.
            from mooncake import pg

            backend = pg._backend_of(dist.group.WORLD)
            small = {
                "_present": dev._present,
                "_settle": lambda dev=dev: dev._settle(eb),
                "_mask": lambda dev=dev: dev._mask(eb),
                "ext.status_code": dev.ext.status_code,
                "ext.take_masked": dev.ext.take_masked,
                "backend.view_version": backend.view_version,
                "backend.left_out": backend.left_out,
                "view_version, its word": pg._view_version_reader(backend),
            }
            res["host us: small calls"] = {n: round(host_us(f), 2) for n, f in small.items()}

        def layout(T=T, idx=idx, dev=dev, blocks=blocks):
            seq = dev._next_seq(eb)
            return dev.ext.layout(
                idx, dev._mask(eb), T, E, 1, False, 0, seq, dev._ns(eb._cpu_timeout_us), blocks,
            )  # fmt: skip

        def layout_dispatch(T=T, x=x, idx=idx, w=w, dev=dev, blocks=blocks):
            seq = dev._next_seq(eb)
            active = dev._mask(eb)
            plan = dev.ext.layout(
                idx, active, T, E, 1, False, 0, seq, dev._ns(eb._cpu_timeout_us), blocks
            )
            return dev.ext.dispatch(
                plan, x, None, w, active, T, 0, False, False, seq, dev._ns(eb._gpu_timeout_us),
                blocks,
            )  # fmt: skip

        # The binding's calls alone at world 1 only: with peers a layout pass without its
        # dispatch would leave theirs waiting.
        bare = {"ext.layout": layout, "ext.layout + ext.dispatch": layout_dispatch}
        calls = {
            **(bare if world == 1 else {}),
            "dispatch, CPU sync": lambda x=x, idx=idx, w=w: eb.dispatch(
                x, idx, w, num_experts=E, num_sms=sms
            ),
            "dispatch, no sync": lambda x=x, idx=idx, w=w: eb.dispatch(
                x, idx, w, num_experts=E, do_cpu_sync=False, num_sms=sms
            ),
            "dispatch, cached": lambda x=x, w=w, h=handle: eb.dispatch(
                x, topk_weights=w, handle=h, num_sms=sms
            ),
            "combine": lambda y=y, h=handle: eb.combine(y, h, num_sms=sms),
        }
        row["host us"] = {name: round(host_us(fn), 1) for name, fn in calls.items()}
        row["back-to-back us"] = {name: round(back_to_back_us(fn), 1) for name, fn in calls.items()}
        for name in ("dispatch, CPU sync", "dispatch, no sync", "dispatch, cached", "combine"):
            row[f"kernels: {name}"] = kernel_table(calls[name])
        row["python: dispatch, CPU sync"] = python_profile(calls["dispatch, CPU sync"])
        row["python: combine"] = python_profile(calls["combine"])
        if world == 1:
            row["stamps: layout"] = layout_phases(block_stamps(dev, layout, blocks, extra=1))
        if world > 1:
            for name in ("dispatch, cached", "combine"):
                row[f"stamps: {name}"] = block_stamps(dev, calls[name], blocks)
        eb.dispatch(x, idx, w, num_experts=E)  # back in step after the bare binding calls
    eb.destroy()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="512,4096", help="tokens per call, comma-separated")
    p.add_argument("--world", type=int, default=1, help="processes on the GPU (MPS above 1)")
    p.add_argument(
        "--num-sms",
        type=int,
        default=0,
        help="the calls' num_sms (0: the default, each process's share of the SMs)",
    )
    add_shape_args(p)
    a = p.parse_args(argv)
    if a.num_sms < 0:
        p.error(f"--num-sms must be >= 0, got {a.num_sms}")
    status = harness.no_gpu_status("profile_elastic_buffer", a.if_gpu)
    if status is not None:
        return status
    from mooncake.launch import run_local

    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    cfg = {"tokens": tokens, "H": a.hidden, "E": a.experts, "K": a.topk, "num_sms": a.num_sms}
    ranks = run_local(member, a.world, args=(cfg,), timeout_s=240)  # within the step's 300 s
    res = ranks[0] if a.world == 1 else {"world": a.world, "ranks": ranks}
    if a.world > 1 and not any("error" in r for r in ranks):
        res["stamps"] = stamps_summary(ranks)
    print(json.dumps(res, indent=1))
    if a.out:
        harness.write_json(a.out, res)
    return 1 if any("error" in r for r in ranks) else 0


if __name__ == "__main__":
    sys.exit(main())
