"""EP on one GPU: the device path against the portable path, upstream's kernels and the floor.

World 1 (one process), T=128 tokens, H=7168, top-8, E in {256, 288},
dispatch in FP8 and BF16, combine in BF16. For each case it times:

- ``dispatch`` and ``combine``: one call each, started on an idle GPU (the
  device is synchronised first) with CUDA events around the call, so a time
  covers the Python wrapper, the launch and the kernels; the same method as
  ``bench_ep_upstream.py`` uses for upstream's kernels;
- ``zero-copy``: combine with ``zero_copy=True``, its expert outputs written
  into ``get_next_combine_buffer`` before the timed call (the workspace itself:
  token owners read them there, so the call copies nothing first);
- ``send half`` / ``recv half``: ``return_recv_hook=True``: the dispatch call
  (its send phase) and the hook (its receive phase), each on its own; the
  same for combine, whose receive half starts after a barrier (every
  process's send half done: it times the sums, with no wait for peers);
- ``kernel``: the same dispatch or combine captured in a CUDA graph and
  replayed, which leaves out the host side;
- ``floor``: a device-to-device copy of the bytes the call must move (each
  selected token's payload once), timed the same way; with several processes
  all of them copy at once, as their calls share the GPU's bandwidth;
- ``portable``: the portable path on the same GPU tensors, where the build can
  run it (it needs a ``mooncake`` CUDA backend; skipped otherwise).

``--elastic CAP`` runs the same calls on an elastic buffer (``Buffer.create_elastic``)
of CAP slots, the processes in slots 0 .. W-1, its workspace sized for the capacity:
what the slot masks and the larger layout cost against a process group's buffer.

With ``--worlds 2,4`` it also runs 2 and 4 processes sharing the GPU (each
call after a barrier; the slowest rank's median is reported; ``kernel`` there
is the dispatch graph alone). Run those
under MPS (``scripts/gpu_check.sh`` starts it): without MPS, kernels of
different processes time-slice and a call waits milliseconds for its peers.

``--upstream PATH`` adds the columns of ``bench_ep_upstream.py``'s JSON.
Medians in microseconds; JSON to ``--out-dir``.

    python3 bench/bench_ep_device.py [--quick] [--worlds 1,2,4] [--upstream up.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import harness


def timed(fn, iters: int, warmup: int, barrier=None, host: list | None = None) -> list[float]:
    """Microseconds of ``fn()`` per call, by CUDA events, each call on an idle GPU;
    ``host`` gets the host's time in the call (Python, checks, launches)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        if barrier is not None:
            barrier()
        out.append(harness.cuda_span_ms(fn, 1, host) * 1000)
    return out


def make_inputs(T: int, H: int, E: int, K: int, n_sets: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
        idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.cuda()
        w = torch.softmax(torch.rand(T, K, generator=g), dim=1).cuda()
        sets.append((x, idx, w))
    return sets


def payload_bytes(H: int, fp8: bool) -> int:
    return H + 4 * (H // 128) if fp8 else 2 * H


def measure_case(
    buf, T, H, E, K, fp8, iters, warmup, rank, barrier=None, elastic=False, agree=None
) -> dict:
    sets = make_inputs(T, H, E, K, 4, seed=1234 + rank)
    # A mask tensor, as engines pass one (and as the upstream benchmark does); an
    # elastic buffer's calls use its own slot mask (already on the device).
    active = None if elastic else torch.ones(buf.num_ranks, dtype=torch.int32, device="cuda")
    i = [0]

    def nxt():
        i[0] = (i[0] + 1) % len(sets)
        return sets[i[0]]

    def dispatch():
        x, idx, _ = nxt()
        return buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8)

    res = {"E": E, "T": T, "H": H, "topk": K, "fp8": fp8, "path": None}
    res["dispatch_host_us"] = []
    res["dispatch_us"] = timed(dispatch, iters, warmup, barrier, res["dispatch_host_us"])
    res["path"] = buf.path
    # Each combine answers a dispatch of its own (a repeated combine of one handle
    # would find its peers' flags already raised and wait for nothing).
    # The expert outputs for FP8 are made once (bf16, from one dispatch's rows): made
    # per round, their ~0.5 GB conversion just before each timed combine left the
    # host thread cold from the long sync (combine host time 22 against 16 us).
    # With zero_copy the expert outputs are first written into the Buffer's combine
    # buffer (outside the timed call, as an expert kernel would write them there:
    # the rows received, not the whole [E/R, R*T, H], whose ~0.5 GB of writes just
    # before the call would leave the cache full of them).
    y_fp8 = None
    for zero_copy in (False, True):
        combine_us, combine_host = [], []
        for it in range(warmup + iters):
            x, idx, w = nxt()
            recv_x, count, handle, _, _ = buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8)
            if fp8 and y_fp8 is None:
                y_fp8 = recv_x[0].to(torch.bfloat16)
            y = y_fp8 if fp8 else recv_x
            if zero_copy:
                n = int(count.max())
                z = buf.get_next_combine_buffer(handle)
                z[:, :n].copy_(y[:, :n])
                y = z

            def call(y=y, idx=idx, w=w, h=handle, z=zero_copy):
                return buf.combine(y, idx, w, active, -1, h, zero_copy=z)

            host: list[float] = []
            t = timed(call, 1, 0, barrier, host)
            if it >= warmup:
                combine_us += t
                combine_host += host
        key = "combine_zero_copy" if zero_copy else "combine"
        res[f"{key}_us"], res[f"{key}_host_us"] = combine_us, combine_host

    hooks = []

    def send_half():
        x, idx, _ = nxt()
        hooks.append(buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8, return_recv_hook=True)[4])

    def recv_half():
        hooks.pop(0)()

    send, recv = [], []
    for it in range(warmup + iters):
        s = timed(send_half, 1, 0, barrier)
        r = timed(recv_half, 1, 0)
        if it >= warmup:
            send += s
            recv += r
    res["send_half_us"], res["recv_half_us"] = send, recv
    # The combine's halves: its receive half starts after every process's send half
    # has finished (a barrier between), so it waits for no peer: the sums alone.
    send, recv = [], []
    for it in range(warmup + iters):
        x, idx, w = nxt()
        recv_x, _, handle, _, _ = buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8)
        y = y_fp8 if fp8 else recv_x
        hooks.append(None)

        def combine_send(y=y, idx=idx, w=w, h=handle):
            hooks[-1] = buf.combine(y, idx, w, active, -1, h, return_recv_hook=True)[2]

        s = timed(combine_send, 1, 0, barrier)
        r = timed(recv_half, 1, 0, barrier)
        if it >= warmup:
            send += s
            recv += r
    res["combine_send_half_us"], res["combine_recv_half_us"] = send, recv
    res.update(graph_times(buf, T, E, fp8, sets[0], y, active, iters, barrier, agree))
    return res


def graph_times(buf, T, E, fp8, inputs, y, active, iters, barrier=None, agree=None) -> dict:
    """Kernel time: one dispatch (and at world 1 one combine) captured and replayed.

    With peers every replay follows a barrier (a dispatch replay waits for its
    peers' counts, which each consumes and clears); a replayed combine would
    find its flags still raised by the replay before, so it is timed at world
    1 only. With peers the processes first agree (``agree``) that each captured:
    one replaying alone would wait out its kernels' deadline."""
    x, idx, w = inputs
    out = {}
    warm = 0 if barrier is not None else 5
    error = None
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _, _, handle, _, _ = buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8)
    except (RuntimeError, ValueError) as e:  # capture can fail on the portable path
        error = str(e)
    if agree is not None and not agree(error is None):
        error = error or "the capture failed on another process"
    if error is not None:
        out["graph_error"] = error
        return out
    out["dispatch_kernel_us"] = timed(g.replay, iters, warm, barrier)
    if barrier is not None:
        return out
    try:
        gs = torch.cuda.CUDAGraph()  # the send phase alone (its counts are never consumed)
        with torch.cuda.graph(gs):
            buf.dispatch(x, idx, active, T, E, -1, use_fp8=fp8, return_recv_hook=True)
        out["send_kernel_us"] = timed(gs.replay, iters, 5)
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            buf.combine(y, idx, w, active, -1, handle)
        out["combine_kernel_us"] = timed(g2.replay, iters, 5)
    except (RuntimeError, ValueError) as e:
        out["graph_error"] = str(e)
    return out


def floor_us(nbytes: int, iters: int, barrier=None) -> list[float]:
    """A device-to-device copy of ``nbytes``, timed like a call; with peers every
    process copies at once after a barrier (they share the GPU's bandwidth)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), iters, 5, barrier)


def member(rank: int, world: int, port: int, cfg: dict) -> list[dict]:
    import os

    import torch.distributed as dist

    from mooncake.launch import init_rank
    from mooncake.mooncake_ep_buffer import Buffer

    os.environ.update(cfg.get("env", {}))
    torch.cuda.set_device(0)
    init_rank(rank, world, port)
    group = dist.group.WORLD
    T, H, K = cfg["T"], cfg["H"], cfg["K"]
    cap = cfg.get("elastic", 0)
    if cap:
        buf = elastic_buffer(rank, world, cap, T, H, cfg["experts"][0])
    else:
        hint = max(Buffer.get_ep_buffer_size_hint(T, H, world, E) for E in cfg["experts"])
        buf = Buffer(group, hint, device="cuda")
    barrier = (lambda: dist.barrier(group)) if world > 1 else None

    def agree(ok: bool) -> bool:  # whether every process is ok
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    rows = []
    for E in cfg["experts"][:1] if cap else cfg["experts"]:
        for fp8 in cfg["fp8"]:
            r = measure_case(
                buf, T, H, E, K, fp8, cfg["iters"], cfg["warmup"], rank, barrier, bool(cap),
                agree if world > 1 else None,
            )  # fmt: skip
            moved = T * K * payload_bytes(H, fp8)
            r["dispatch_floor_us"] = floor_us(moved, cfg["iters"], barrier)
            r["combine_floor_us"] = floor_us(T * K * 2 * H, cfg["iters"], barrier)
            rows.append(r)
    return rows


def elastic_buffer(rank: int, world: int, capacity: int, T: int, H: int, E: int):
    """An elastic buffer for slot ``rank`` of ``capacity``, its workspace sized for the
    capacity, connected to the other ``world - 1`` processes (slots 0 .. world-1)
    through the process group's store; its calls cover ``world`` slots."""
    import torch.distributed as dist

    from mooncake.mooncake_ep_buffer import Buffer

    epr = E // world
    store = dist.distributed_c10d._get_default_store()
    buf = Buffer.create_elastic(
        rank=rank, tcp_store_group=store, timeout_ms=60000, store_prefix="bench-elastic/"
    )
    hint = Buffer.get_ep_buffer_size_hint(T, H, capacity, epr * capacity)
    buf.update_memory_buffers(num_ranks=capacity, num_experts_per_rank=epr, num_rdma_bytes=hint)
    peers = [r for r in range(world) if r != rank]
    if peers:
        buf.connect_ranks(peers, activate=True)
    return buf


def summarize(rows_by_rank: list[list[dict]]) -> list[dict]:
    """Per case: the median of every timing list; across ranks, the slowest rank's."""
    out = []
    for cases in zip(*rows_by_rank, strict=True):
        row = {k: v for k, v in cases[0].items() if not isinstance(v, list)}
        keys = {k for c in cases for k, v in c.items() if isinstance(v, list)}
        for k in sorted(keys):  # a key some process lacks (an error): no time (None)
            per = [harness.median(c.get(k, [])) for c in cases]
            row[k] = None if None in per else max(per)
        out.append(row)
    return out


def upstream_rows(path: str | None) -> dict:
    data = harness.read_json(path) if path else None
    if data is None:
        if path:
            print(f"upstream: no JSON at {path} (its wheel not carried, or its run failed): "
                  "its columns are empty")  # fmt: skip
        return {}
    if data.get("error") and not data.get("cases"):
        return {"error": data["error"]}
    return {(c["E"], bool(c["fp8"])): c for c in data.get("cases", []) if not c.get("error")}


def fmt(v) -> str:
    return harness.fmt_fixed(v, 100)


# The table's columns after "dispatch" and after "combine": header -> a row's key, or
# "up:" and a key of upstream's case (its median).
DISPATCH_COLS = {
    "ours": "dispatch_us",
    "kernel": "dispatch_kernel_us",
    "send half": "send_half_us",
    "(kernel)": "send_kernel_us",
    "recv half": "recv_half_us",
    "upstream": "up:dispatch_us",
    "floor": "dispatch_floor_us",
}
COMBINE_COLS = {
    "ours": "combine_us",
    "zero-copy": "combine_zero_copy_us",
    "send half": "combine_send_half_us",
    "recv half": "combine_recv_half_us",
    "kernel": "combine_kernel_us",
    "upstream": "up:combine_us",
    "floor": "combine_floor_us",
}


def table(world: int, rows: list[dict], up: dict) -> str:
    header = ["E", "dispatch", *DISPATCH_COLS, "combine", *COMBINE_COLS]
    cells = []
    for r in rows:
        u = up.get((r["E"], r["fp8"]), {}) if "error" not in up else {}

        def cell(key: str, r=r, u=u) -> str:
            if key.startswith("up:"):
                return fmt((u.get(key[3:]) or {}).get("median"))
            return fmt(r.get(key))

        dispatch = [cell(k) for k in DISPATCH_COLS.values()]
        combine = [cell(k) for k in COMBINE_COLS.values()]
        cells.append([str(r["E"]), "FP8" if r["fp8"] else "BF16", *dispatch, "BF16", *combine])
    lines = [f"world {world}: median µs (T=128, H=7168, top-8)"]
    lines += harness.markdown_table(header, cells)
    if "error" in up:
        lines.append(f"(upstream skipped: {up['error'].splitlines()[-1][:120]})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="1", help="comma-separated process counts on the GPU")
    p.add_argument("--experts", default="256,288")
    p.add_argument("--fp8", default="1,0", help="use_fp8 values")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="30 timed calls, 5 warm-up")
    p.add_argument("--upstream", default=None, help="bench_ep_upstream.py's JSON")
    p.add_argument(
        "--elastic",
        type=int,
        default=0,
        help="CAP: an elastic buffer of CAP slots (Buffer.create_elastic) instead of a "
        "process group's, its calls covering the processes' slots; the first of --experts",
    )
    p.add_argument(
        "--launch-timeout", type=float, default=560, help="seconds each world's launch may take"
    )
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    harness.add_if_gpu(p)
    a = p.parse_args(argv)
    status = harness.no_gpu_status("bench_ep_device", a.if_gpu)
    if status is not None:
        return status
    from mooncake.launch import run_local

    cfg = {
        "T": a.tokens,
        "H": a.hidden,
        "K": a.topk,
        "experts": [int(e) for e in a.experts.split(",")],
        "fp8": [bool(int(f)) for f in a.fp8.split(",")],
        "iters": 30 if a.quick else a.iters,
        "warmup": 5 if a.quick else a.warmup,
        "elastic": a.elastic,
    }
    up = upstream_rows(a.upstream)
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "worlds": {}}
    results["elastic_capacity"] = a.elastic
    name = f"ep_device_elastic{a.elastic}.json" if a.elastic else "ep_device.json"
    failed = []
    for world in harness.csv_ints(a.worlds):
        t0 = time.monotonic()
        try:
            rows = summarize(run_local(member, world, args=(cfg,), timeout_s=a.launch_timeout))
        except RuntimeError as e:  # this world's launch failed: the others still count
            failed.append(world)
            results.setdefault("failed", {})[world] = str(e)[-2000:]
            print(f"world {world}: FAILED: {str(e)[-600:]}\n", flush=True)
            harness.write_outputs(a.out_dir, {name: results})
            continue
        results["worlds"][world] = rows
        if a.elastic:
            print(f"elastic buffer, capacity {a.elastic}, {world} slots active:")
        print(table(world, rows, up if world == 1 and not a.elastic else {}))
        for r in rows:
            print(
                f"  E={r['E']} {'FP8' if r['fp8'] else 'BF16'}: host time in dispatch "
                f"{fmt(r['dispatch_host_us'])} us, in combine {fmt(r['combine_host_us'])} us"
            )
        print(f"(world {world}: {time.monotonic() - t0:.0f} s)\n")
        harness.write_outputs(a.out_dir, {name: results})  # kept if a later world hangs
    harness.write_outputs(a.out_dir, {name: results})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
