"""Latency of the expert-parallel ``Buffer``'s portable path (dispatch, combine) on CPU.

The baseline later fast paths are measured against: ``Buffer.dispatch`` and
``Buffer.combine`` (``mooncake.mooncake_ep_buffer``, ``Buffer.path ==
"portable"``) on CPU tensors over a ``mooncake-cpu`` group, at DeepEP
low-latency shapes made small (``T`` tokens per rank, hidden ``H``, ``E = 8 R``
experts, top-8, BF16 or FP8), with in the same run the raw transport it runs
on: a plain ``all_to_all_single`` moving exactly the bytes of the call's token
exchange, over the same ``mooncake-cpu`` group and over a ``gloo`` group made
alongside (``dist.new_group(backend="gloo")``).

For each world size one group is launched with ``mooncake.launch.LocalGroup``
(the store hosted here, the ranks spawned, one CPU thread each); every rank
runs every case inside it. Each measure is timed call by call after warm-up
calls: a call's time is the slowest rank's, and a row shows the median and the
90th percentile over the calls. Results go to ``<out-dir>/ep.json`` and
``ep_table.md``; see "EP benchmark" in ``bench/README.md``.

    .venv/bin/python bench/bench_ep.py            # worlds 2, 4 and 8: 2-5 minutes
    .venv/bin/python bench/bench_ep.py --quick    # worlds 2 and 4, fewer shapes: under a minute
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta

# Only the standard library (and harness, which imports nothing else) at the top: the
# ranks are spawned processes that re-import this file.
import harness
from harness import fmt_ratio, log, say

HEADER_BYTES = 16  # one dispatch message's header (mooncake/ep/portable_rows.py)
META_COLS = 6  # the counts exchange's row: T, H, E, fp8, status, accept, then E/R counts
FP8_BLOCK = 128  # channels per fp32 scale
# Measures, in the order each case runs them: (name, what it times).
MEASURES = {
    "dispatch": "Buffer.dispatch (counts exchange, packing, token exchange, unpacking)",
    "combine": "Buffer.combine with the handle of one dispatch, called again and again",
    "pair": "Buffer.dispatch then Buffer.combine of its handle",
    "a2a_mc_disp": "all_to_all_single over the mooncake-cpu group, the dispatch's token bytes",
    "a2a_gloo_disp": "the same over the gloo group",
    "a2a_mc_comb": "all_to_all_single over the mooncake-cpu group, the combine's bytes",
    "a2a_gloo_comb": "the same over the gloo group",
}
SLOW_CALL_S = 0.05  # a measure whose first call takes longer gets 1 warm-up call
KEY_WORLD = 4
KEY_SHAPE = (128, 2048)  # (T, H) shown for every world in the Markdown table
FULL_CASES = [(t, h) for t in (16, 64, 128) for h in (1024, 2048)] + [(128, 7168)]
QUICK_CASES = [(16, 1024), (128, 2048)]


# --- one rank -------------------------------------------------------------------------


def row_bytes(hidden: int, use_fp8: bool) -> int:
    """One dispatch message: the header and a BF16 payload, or FP8 data and fp32 scales."""
    payload = hidden + 4 * (hidden // FP8_BLOCK) if use_fp8 else 2 * hidden
    return HEADER_BYTES + payload


def recv_x_bytes(case: dict, world: int, cfg: dict) -> int:
    """The size of dispatch's ``recv_x`` with BF16, ``[E/R, R*T, H]``, per rank (FP8: about half)."""
    return cfg["experts_per_rank"] * world * case["T"] * case["H"] * 2


def time_calls(fn, cfg: dict) -> list[float]:
    """Seconds of each timed call of ``fn`` on this rank.

    Every rank makes the same calls: a first call, ``warmup`` calls (1 when
    the first took over ``SLOW_CALL_S`` on some rank), then timed calls, as
    many as fit in ``point_seconds`` at the slowest rank's warm-up mean (agreed
    through an all_reduce(MAX)), between ``min_iters`` and ``max_iters``. The
    timed calls run back to back between two barriers.
    """
    import torch.distributed as dist

    dist.barrier()
    first = harness.rank_max(harness.mean_seconds(fn, 1))  # first touch of the buffers
    warmup = cfg["warmup"] if first < SLOW_CALL_S else 1
    iters = harness.calls_in_budget(harness.mean_seconds(fn, warmup), cfg)
    dist.barrier()
    times = harness.call_seconds(fn, iters)
    dist.barrier()
    return times


def run_case(buf, gloo, case: dict, cfg: dict, rank: int, world: int) -> list[dict]:
    """Every measure of one (T, H, use_fp8) case; a check of the results first."""
    import torch
    import torch.distributed as dist

    from mooncake import fp8

    T, H, use_fp8 = case["T"], case["H"], case["fp8"]
    E = cfg["experts_per_rank"] * world
    K = min(cfg["topk"], E)
    epr = E // world
    g = torch.Generator().manual_seed(1_000_003 * case["index"] + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices  # K distinct experts
    topk_weights = torch.rand(T, K, generator=g)
    active = torch.ones(world, dtype=torch.int32)

    # The token exchange's rows per peer, worked out here from topk_idx (not by the Buffer).
    send_rows = torch.bincount((topk_idx // epr).reshape(-1), minlength=world)
    recv_rows = torch.empty_like(send_rows)
    dist.all_to_all_single(recv_rows, send_rows)
    send_rows, recv_rows = send_rows.tolist(), recv_rows.tolist()

    def dispatch():
        return buf.dispatch(x, topk_idx, active, T, E, -1, use_fp8=use_fp8)

    # Identity experts: combine gets back what was dispatched (dequantised, in BF16).
    recv_x, recv_count, handle, _, _ = dispatch()
    if use_fp8:
        y = fp8.dequantize(*recv_x).to(torch.bfloat16)
        sent = fp8.dequantize(*fp8.quantize(x)).to(torch.bfloat16).float()
    else:
        y, sent = recv_x, x.float()
    combined, _, _ = buf.combine(y, topk_idx, topk_weights, active, -1, handle)
    ref = topk_weights.sum(1, keepdim=True) * sent
    bound = topk_weights.sum(1, keepdim=True) * sent.abs() * 2**-7 + 1e-6
    excess = float(((combined.float() - ref).abs() - bound).max())
    check = {
        "recv_rows": int(recv_count.sum()),
        "recv_rows_expected": sum(recv_rows),
        "combine_max_abs_err": float((combined.float() - ref).abs().max()),
        "ok": int(recv_count.sum()) == sum(recv_rows) and excess <= 0,
    }

    def combine():
        buf.combine(y, topk_idx, topk_weights, active, -1, handle)

    def pair():
        h = dispatch()[2]
        buf.combine(y, topk_idx, topk_weights, active, -1, h)

    def raw(send, recv, nbytes, group):
        inp = torch.zeros(sum(send) * nbytes, dtype=torch.uint8)
        out = torch.empty(sum(recv) * nbytes, dtype=torch.uint8)
        out_splits = [r * nbytes for r in recv]
        in_splits = [s * nbytes for s in send]
        return lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)

    d_bytes, c_bytes = row_bytes(H, use_fp8), 2 * H
    fns = {
        "dispatch": dispatch,
        "combine": combine,
        "pair": pair,
        "a2a_mc_disp": raw(send_rows, recv_rows, d_bytes, None),
        "a2a_gloo_disp": raw(send_rows, recv_rows, d_bytes, gloo),
        # combine sends every received row back: the reverse splits, BF16 rows, no header
        "a2a_mc_comb": raw(recv_rows, send_rows, c_bytes, None),
        "a2a_gloo_comb": raw(recv_rows, send_rows, c_bytes, gloo),
    }
    points = []
    for name in cfg["measures"]:
        times = time_calls(fns[name], cfg)
        points.append(
            {
                "case": case["index"],
                "measure": name,
                "calls_us": [round(t * 1e6, 2) for t in times],
            }
        )
        if rank == 0:
            print(
                f"[world {world}] T {T:>4} H {H:>5} fp8 {int(use_fp8)} {name:<14} "
                f"{statistics.median(times) * 1e6:>10.1f} us median ({len(times)} calls)",
                file=sys.stderr,
                flush=True,
            )
    info = {
        "case": case["index"],
        "measure": "info",
        "T": T,
        "H": H,
        "fp8": use_fp8,
        "E": E,
        "K": K,
        "dispatch_row_bytes": d_bytes,
        "combine_row_bytes": c_bytes,
        "send_rows": send_rows,
        "recv_rows": recv_rows,
        "check": check,
    }
    return [info] + points


def member(rank: int, world: int, port: int, cfg: dict) -> None:
    """One rank: every case, its points published under ``result/<rank>`` as they come."""
    import torch
    import torch.distributed as dist

    from mooncake.launch import init_rank
    from mooncake.mooncake_ep_buffer import Buffer

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg["op_timeout"])
    )
    # Meet after the imports, which take seconds on a busy host: the rendezvous in
    # init_process_group is bounded by the op timeout, and imports are not measured.
    harness.store_barrier(store, "imported", world)
    init_rank(rank, world, port, timeout_s=cfg["op_timeout"])
    gloo = dist.new_group(backend="gloo")
    buf = Buffer(dist.group.WORLD, 0)
    assert buf.path == "portable", buf.path
    points: list[dict] = []

    # The dispatch's first exchange (counts) alone: one int64 row per peer.
    E = cfg["experts_per_rank"] * world
    meta = torch.zeros(world, META_COLS + E // world, dtype=torch.int64)
    theirs = torch.empty_like(meta)
    times = time_calls(lambda: dist.all_to_all_single(theirs, meta), cfg)
    points.append(
        {"case": -1, "measure": "a2a_mc_counts", "calls_us": [round(t * 1e6, 2) for t in times]}
    )
    for case in cfg["cases"]:
        points += run_case(buf, gloo, case, cfg, rank, world)
        harness.publish(store, f"result/{rank}", points)
    dist.destroy_process_group()


# --- the parent -----------------------------------------------------------------------


def summarize(name: str, per_rank: list[list[float]]) -> dict:
    """Per call the slowest rank's time; their median, p90 (nearest rank), mean and min."""
    calls = harness.slowest(per_rank)
    return {
        "measure": name,
        **harness.summarize(
            calls,
            {"median_us": "median", "p90_us": "p90", "mean_us": "mean", "min_us": "min"},
        ),
        "calls": len(calls),
        "per_rank_median_us": [round(statistics.median(c), 2) for c in per_rank],
        "slowest_per_call_us": [round(c, 2) for c in calls],
    }


def run_world(world: int, cases: list[dict], cfg: dict, timeout_s: float) -> dict:
    """One group of ``world`` ranks runs every case; returns its rows (whatever it finished)."""
    run = harness.launch(
        world,
        member,
        (dict(cfg, cases=cases),),
        env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        timeout_s=timeout_s,
    )
    error = run.error
    if error:
        log(f"# world {world}: {error}")
    per_rank = run.per_rank("result", [])
    rows, counts = [], None
    complete = min(len(p) for p in per_rank)
    points = {}  # (case, measure) -> per rank calls
    infos = {}
    for i in range(complete):
        first = per_rank[0][i]
        key = (first["case"], first["measure"])
        if first["measure"] == "info":
            infos[first["case"]] = [p[i] for p in per_rank]
        else:
            points[key] = [p[i]["calls_us"] for p in per_rank]
    if (-1, "a2a_mc_counts") in points:
        counts = summarize("a2a_mc_counts", points[(-1, "a2a_mc_counts")])
        del counts["slowest_per_call_us"]
        counts["bytes_per_peer"] = 8 * (META_COLS + cfg["experts_per_rank"])
    for case in cases:
        ranks_info = infos.get(case["index"])
        if ranks_info is None:
            continue
        info = ranks_info[0]
        d_sent = [sum(ri["send_rows"]) * info["dispatch_row_bytes"] for ri in ranks_info]
        row = {
            "world": world,
            "T": info["T"],
            "H": info["H"],
            "fp8": info["fp8"],
            "E": info["E"],
            "K": info["K"],
            "dispatch_row_bytes": info["dispatch_row_bytes"],
            "combine_row_bytes": info["combine_row_bytes"],
            # the token exchange: bytes a rank sends per destination (itself included), mean
            "dispatch_bytes_per_peer": statistics.fmean(d_sent) / world,
            "combine_bytes_per_peer": statistics.fmean(
                sum(ri["recv_rows"]) * info["combine_row_bytes"] for ri in ranks_info
            )
            / world,
            "send_rows": [ri["send_rows"] for ri in ranks_info],
            "checks": [ri["check"] for ri in ranks_info],
            "check_ok": all(ri["check"]["ok"] for ri in ranks_info),
        }
        for name in MEASURES:
            if (case["index"], name) in points:
                row[name] = summarize(name, points[(case["index"], name)])
        row["ratios"] = ratios(row)
        rows.append(row)
    return {
        "world": world,
        "error": error,
        "rows": rows,
        "counts_exchange": counts,
        "wall_s": run.wall_s,
        "loadavg": run.loadavg,
    }


def ratios(row: dict) -> dict:
    def r(a: str, b: str) -> float | None:
        if a in row and b in row and row[b]["median_us"] > 0:
            return row[a]["median_us"] / row[b]["median_us"]
        return None

    return {  # of medians
        "dispatch_over_a2a_mc": r("dispatch", "a2a_mc_disp"),
        "combine_over_a2a_mc": r("combine", "a2a_mc_comb"),
        "gloo_over_mc_disp": r("a2a_gloo_disp", "a2a_mc_disp"),
        "gloo_over_mc_comb": r("a2a_gloo_comb", "a2a_mc_comb"),
    }


# --- tables ---------------------------------------------------------------------------


def fmt_us(t: float | None) -> str:
    return harness.fmt_fixed(t, 1e4)  # the EP tables are narrower: whole from 10 ms


def fmt_kib(n: float) -> str:
    return f"{n / 1024:.1f}"


TEXT_COLS = [  # (measure, header)
    ("dispatch", "dispatch"),
    ("combine", "combine"),
    ("pair", "disp+comb"),
    ("a2a_mc_disp", "a2a mc (d)"),
    ("a2a_gloo_disp", "a2a gloo (d)"),
    ("a2a_mc_comb", "a2a mc (c)"),
    ("a2a_gloo_comb", "a2a gloo (c)"),
]
RATIO_COLS = [
    ("dispatch_over_a2a_mc", "d/mc"),
    ("combine_over_a2a_mc", "c/mc"),
    ("gloo_over_mc_disp", "gl/mc(d)"),
    ("gloo_over_mc_comb", "gl/mc(c)"),
]


def print_world(result: dict) -> None:
    world, rows = result["world"], result["rows"]
    if not rows:
        return
    say()
    e, k = rows[0]["E"], rows[0]["K"]
    say(
        f"# world {world}, E {e} ({e // world} per rank), top-{k}, x bf16; per call: "
        "the slowest rank's time; median / p90 over the calls (us)"
    )
    c = result["counts_exchange"]
    if c:
        say(
            f"#   the dispatch's counts exchange alone (a2a mc, {c['bytes_per_peer']} B per peer): "
            f"{fmt_us(c['median_us'])} / {fmt_us(c['p90_us'])} us"
        )
    head1 = f"#{'T':>4} {'H':>5} {'fp8':>3} {'KiB/peer':>8}"
    head2 = f"#{'':>4} {'':>5} {'':>3} {'(d)':>8}"
    for _, label in TEXT_COLS:
        head1 += f" |{label:>15}"
        head2 += f" |{'med':>7} {'p90':>7}"
    head1 += " |" + "".join(f"{label:>9}" for _, label in RATIO_COLS)
    head2 += " |" + f"{'ratios of medians':>36}"
    say(head1)
    say(head2)
    for row in rows:
        line = f" {row['T']:>4} {row['H']:>5} {int(row['fp8']):>3} "
        line += f"{fmt_kib(row['dispatch_bytes_per_peer']):>8}"
        for name, _ in TEXT_COLS:
            p = row.get(name)
            line += (
                f"  {fmt_us(p['median_us']):>7} {fmt_us(p['p90_us']):>7}"
                if p
                else f"  {'-':>7} {'-':>7}"
            )
        line += "  " + "".join(f"{fmt_ratio(row['ratios'][n]):>9}" for n, _ in RATIO_COLS)
        if not row["check_ok"]:
            line += "  CHECK FAILED"
        say(line)


def markdown_table(results: list[dict], meta: dict) -> str:
    """World 4's rows, and the key shape at the other world sizes."""
    lines = [
        f'mooncake-cpu, portable path (`Buffer.path == "portable"`), CPU tensors, on one host '
        f"({meta['cores']} cores), {meta['started']}, library {meta['mooncake']['commit']}; "
        f"load average {meta['loadavg_start'][0]:.1f} at the start, "
        f"{meta['loadavg_end'][0]:.1f} at the end; {meta['duration_s']:.0f} s in all"
        + (" (`--quick`)" if meta["args"]["quick"] else "")
        + ". E = 8 experts per rank, top-8, x bf16. Per call: the slowest rank's time; "
        "median / p90 over the calls, in µs. `a2a` = a plain `all_to_all_single` moving the "
        "same bytes per peer as the call's token exchange (d: dispatch's, c: combine's), over "
        "the mooncake-cpu group (mc) or a gloo group.",
        "",
    ]
    header = [
        *("world", "T", "H", "fp8", "KiB/peer (d)", "dispatch", "combine"),
        *("dispatch + combine", "a2a mc (d)", "a2a gloo (d)", "a2a mc (c)"),
        *("dispatch / a2a mc (d)", "combine / a2a mc (c)", "gloo / mc (d)", "gloo / mc (c)"),
    ]
    table = []

    def cell(row, name):
        p = row.get(name)
        return f"{fmt_us(p['median_us'])} / {fmt_us(p['p90_us'])}" if p else "-"

    for res in results:
        for row in res["rows"]:
            if res["world"] != KEY_WORLD and (row["T"], row["H"]) != KEY_SHAPE:
                continue
            r = row["ratios"]
            cells = [
                str(row["world"]),
                str(row["T"]),
                str(row["H"]),
                "yes" if row["fp8"] else "no",
                fmt_kib(row["dispatch_bytes_per_peer"]),
                cell(row, "dispatch"),
                cell(row, "combine"),
                cell(row, "pair"),
                cell(row, "a2a_mc_disp"),
                cell(row, "a2a_gloo_disp"),
                cell(row, "a2a_mc_comb"),
                fmt_ratio(r["dispatch_over_a2a_mc"]),
                fmt_ratio(r["combine_over_a2a_mc"]),
                fmt_ratio(r["gloo_over_mc_disp"]),
                fmt_ratio(r["gloo_over_mc_comb"]),
            ]
            table.append(cells)
    lines += harness.markdown_table(header, table, "r" * len(header))
    counts = [
        f"world {res['world']} {fmt_us(res['counts_exchange']['median_us'])} µs"
        for res in results
        if res["counts_exchange"]
    ]
    if counts:
        lines += [
            "",
            "The dispatch's first exchange (the counts, one int64 row per peer) alone, as a "
            "plain all_to_all_single over mooncake-cpu, median: " + ", ".join(counts) + ".",
        ]
    bad = [
        f"world {res['world']} T {row['T']} H {row['H']} fp8 {row['fp8']}"
        for res in results
        for row in res["rows"]
        if not row["check_ok"]
    ]
    skipped = [
        f"world {res['world']}: {', '.join(res['skipped_shapes'])}"
        for res in results
        if res.get("skipped_shapes")
    ]
    if skipped:
        lines += [
            "",
            f"Skipped (dispatch's recv_x over {meta['args']['max_recv_mib']} MiB per rank): "
            + "; ".join(skipped)
            + ".",
        ]
    lines += [f"\nCHECK FAILED: {b}" for b in bad]
    lines += [f"\nERROR: world {res['world']}: {res['error']}" for res in results if res["error"]]
    return "\n".join(lines) + "\n"


# --- main -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = harness.arg_parser(
        "Latency of the EP Buffer's portable dispatch and combine on CPU, beside the raw "
        "all_to_all_single of the same bytes over mooncake-cpu and gloo (see bench/README.md).",
        world_sizes="2,4,8",
    )
    p.add_argument(
        "--shapes",
        default=",".join(f"{t}x{h}" for t, h in FULL_CASES),
        help="comma-separated TxH: tokens per rank x hidden",
    )
    p.add_argument("--fp8", default="0,1", help="use_fp8 values to run: 0, 1 or 0,1")
    p.add_argument("--experts-per-rank", type=int, default=8, help="E / R")
    p.add_argument("--topk", type=int, default=8, help="top-k (at most E)")
    p.add_argument(
        "--max-recv-mib",
        type=int,
        default=64,
        help="skip a shape at a world size where dispatch's recv_x (BF16) exceeds this per rank",
    )
    p.add_argument("--measures", default=",".join(MEASURES), help="comma-separated measures to run")
    harness.add_loop_args(p, "measure", 5, 12, 500)
    p.add_argument("--op-timeout", type=float, default=120, help="backend op timeout, seconds")
    p.add_argument(
        "--launch-timeout", type=float, default=600, help="seconds for one world size's run"
    )
    harness.add_output_args(
        p,
        f"worlds 2 and 4, shapes {','.join(f'{t}x{h}' for t, h in QUICK_CASES)}, "
        "shorter loops: under a minute",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = harness.parse_args(
        parser,
        argv,
        {"world_sizes": "2,4", "shapes": ",".join(f"{t}x{h}" for t, h in QUICK_CASES)},
        {"point_seconds": 0.05, "warmup": 2, "min_iters": 8},
    )
    try:
        worlds = sorted(set(harness.csv_ints(args.world_sizes)))
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
        fp8s = [bool(int(v)) for v in args.fp8.split(",") if v.strip()]
        measures = [m.strip() for m in args.measures.split(",") if m.strip()]
    except ValueError as e:
        parser.error(str(e))
    if not worlds or min(worlds) < 2:
        parser.error("world sizes must be >= 2")
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        parser.error("shapes are TxH with T, H >= 1, e.g. 128x2048")
    if any(h % FP8_BLOCK for _, h in shapes) and True in fp8s:
        parser.error(f"with fp8, H must be a multiple of {FP8_BLOCK}")
    bad = [m for m in measures if m not in MEASURES]
    if bad:
        parser.error(f"unknown measure {', '.join(bad)}; choose from {', '.join(MEASURES)}")

    cases = [
        {"index": i, "T": t, "H": h, "fp8": f}
        for i, ((t, h), f) in enumerate((s, f) for s in shapes for f in fp8s)
    ]
    cfg = {
        "experts_per_rank": args.experts_per_rank,
        "topk": args.topk,
        "measures": measures,
        "warmup": args.warmup,
        "min_iters": args.min_iters,
        "max_iters": args.max_iters,
        "point_seconds": args.point_seconds,
        "op_timeout": args.op_timeout,
    }
    started = time.time()
    load_start = os.getloadavg()
    cores = os.cpu_count()
    harness.say_host("EP Buffer (portable path)", cores, load_start)
    say("# d/mc = dispatch / a2a mc (d); c/mc = combine / a2a mc (c); gl/mc = gloo / mooncake")
    say(
        "# a2a (d): the dispatch's token exchange (16 B header + payload per (token, expert)); "
        "a2a (c): the combine's (2H B per row)"
    )
    results = []
    for world in worlds:
        fits = [c for c in cases if recv_x_bytes(c, world, cfg) <= args.max_recv_mib << 20]
        skipped = sorted({f"{c['T']}x{c['H']}" for c in cases if c not in fits})
        if skipped:
            say(
                f"# world {world}: skipping {', '.join(skipped)}: recv_x over "
                f"{args.max_recv_mib} MiB per rank (--max-recv-mib)"
            )
        log(f"# launching world {world}: {len(fits)} cases ...")
        res = run_world(world, fits, cfg, args.launch_timeout)
        res["skipped_shapes"] = skipped
        log(f"# world {world}: {res['wall_s']:.1f} s")
        results.append(res)
        print_world(res)
    errors = [{"world": r["world"], "error": r["error"]} for r in results if r["error"]]
    failed = [
        {"world": r["world"], "T": row["T"], "H": row["H"], "fp8": row["fp8"]}
        for r in results
        for row in r["rows"]
        if not row["check_ok"]
    ]
    for f in failed:
        say(f"# CHECK FAILED: {f}")
    for e in errors:
        say(f"# ERROR: world {e['world']}: {e['error']}")
    meta = {
        **harness.run_meta(started, cores, load_start, args),
        "mooncake_env": {k: v for k, v in os.environ.items() if k.startswith("MOONCAKE_")},
        "measures": MEASURES,
        "time": "per call, the slowest rank's time (time.perf_counter around the call); "
        "median, p90 (nearest rank), mean and min over the timed calls",
        "method": "see the module docstring and bench/README.md, 'EP benchmark'",
    }
    document = {"meta": meta, "results": results, "errors": errors, "check_failed": failed}
    files = {"ep.json": document, "ep_table.md": markdown_table(results, meta)}
    say(f"# {harness.write_outputs(args.out_dir, files)}")
    log(f"# total {time.time() - started:.0f} s")
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
