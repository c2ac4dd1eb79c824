"""Tables, JSON rows, the Markdown snippet, target checks and the plot for bench_pg.py."""

from __future__ import annotations

import sys
from pathlib import Path

import harness
from floors import FloorModel
from harness import fmt_bytes, fmt_fixed, fmt_ratio, median, say

MOONCAKE = "mooncake-cpu"
GLOO = "gloo"
BUSBW_FACTOR = {  # nccl-tests' bus bandwidth factors
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
KEY_WORLD = 4
KEY_ROWS = [("all_reduce", s) for s in (8, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)] + [
    (op, s)
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")
    for s in (4 << 10, 16 << 20)
]
TARGETS = {  # world 4, except bare_core_world
    "small_max_bytes": 4 << 10,
    "small_floor_ratio": 2.5,
    "small_gloo_speedup": 50.0,
    "large_min_bytes": 16 << 20,
    "large_floor_ratio": 1.25,
    "large_ops": ("all_reduce", "all_gather_into_tensor", "all_to_all_single"),
    "large_gloo_speedup": 1.0,
    "bare_core_world": 8,
    "bare_core_ratio": 1.5,
}


def fmt_us(t: float | None) -> str:
    """Microseconds in these tables: whole from 100 ms up."""
    return fmt_fixed(t, 1e5)


# --- rows -----------------------------------------------------------------------------


def make_row(model: FloorModel, op: str, world: int, points: dict[str, dict]) -> dict:
    """One JSON row: every backend's time and bandwidths, the floor, the ratios."""
    first = next(iter(points.values()))
    nbytes = first["bytes"]
    row: dict = {"op": op, "world": world, "bytes": nbytes, "count": first["count"]}
    for backend, p in points.items():
        algbw = nbytes / p["time_us"] / 1e3
        row[backend] = {
            "time_us": p["time_us"],
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * BUSBW_FACTOR[op](world),
            "iters": p["iters"],
            "loops_us": p["loops_us"],
            "per_rank_us": p["per_rank_us"],
            "sleeps_per_op": p["sleeps_per_op"],
            "preempted_per_op": p["preempted_per_op"],
            "cpu_us_per_op": p["cpu_us_per_op"],
        }
        if "copy_beside_us" in p:
            row[backend]["copy_beside_us"] = p["copy_beside_us"]
    row["floor"] = model.floor(op, nbytes, world) if world >= 2 else None
    mc, gl = row.get(MOONCAKE), row.get(GLOO)
    row["ratios"] = {
        "mooncake_over_floor": mc["time_us"] / row["floor"]["floor_us"]
        if mc and row["floor"] and row["floor"]["floor_us"] > 0
        else None,
        "gloo_over_mooncake": gl["time_us"] / mc["time_us"] if mc and gl else None,
        "mooncake_over_copy_beside": over_copy_beside(mc) if mc else None,
    }
    return row


def over_copy_beside(point: dict) -> float | None:
    """The op against the copy its ranks made right after each of its loops (each rank
    its share of the copy floor's traffic, all at once): the median over loops of
    loop / copy. Both halves of a pair see the same state of a shared host, which
    drifts over seconds; a copy floor measured at the start of the run does not."""
    copies = point.get("copy_beside_us")
    if not copies:
        return None
    return median([t / c for t, c in zip(point["loops_us"], copies, strict=True)])


def world_rows(
    model: FloorModel, world: int, ops: list[str], by_backend: dict[str, dict]
) -> list[dict]:
    rows = []
    for op in ops:
        sizes = sorted({b for pts in by_backend.values() for (o, b) in pts if o == op})
        for nbytes in sizes:
            points = {k: pts[(op, nbytes)] for k, pts in by_backend.items() if (op, nbytes) in pts}
            rows.append(make_row(model, op, world, points))
    return rows


def collect(model: FloorModel, by_world: dict[int, dict[str, dict]], ops: list[str]) -> dict:
    """Result rows for ``ops``, and the per-op overhead probes (the points of other names).

    ``by_world[world][backend]`` maps (op, bytes) to the merged point of that launch.
    """
    rows, overhead = [], []
    for world, by_backend in sorted(by_world.items()):
        for backend, pts in by_backend.items():
            for (op, _), p in pts.items():
                if op not in ops:
                    overhead.append(
                        {
                            "backend": backend,
                            "world": world,
                            "probe": op,
                            "time_us": p["time_us"],
                            "sleeps_per_op": p["sleeps_per_op"],
                            "preempted_per_op": p["preempted_per_op"],
                            "cpu_us_per_op": p["cpu_us_per_op"],
                        }
                    )
        rows += world_rows(model, world, ops, by_backend)
    return {"rows": rows, "overhead": overhead}


# --- the text tables ------------------------------------------------------------------


def print_floors(model: FloorModel, load: tuple[float, float, float]) -> None:
    harness.say_host("mooncake-cpu vs gloo", model.cores, load, "times and floors are noisy")
    say("# floors, measured now:")
    for n, h in sorted(model.handoff.items()):
        trials = sorted(h.trials_us)
        say(
            f"#   hand-off, ring of {n}: {h.hop_us:.1f} us/hop (fastest of {len(trials)} trials "
            f"{h.raw_hop_us:.1f} - loop body {h.loop_us:.1f}; median trial "
            f"{trials[len(trials) // 2]:.1f})"
        )
    say(
        f"#   copy bandwidth (numpy.copyto), GB/s copied: 1 process / {model.cores} at once, summed"
    )
    say(
        "#     "
        + ", ".join(
            f"{fmt_bytes(c.nbytes)} {c.single_gbps:.1f}/{c.aggregate_gbps:.1f}" for c in model.copy
        )
    )
    say("# floor = max(hand-off, copy)")
    say(
        "#   hand-off = rounds x max(1, N/cores) x hop(N); rounds = 1 (direct: one message to "
        "every peer at once),"
    )
    say(
        f"#     2 for all_reduce/broadcast above {fmt_bytes(model.small_bytes)} "
        "(reduce-scatter + all-gather, scatter + all-gather)"
    )
    say(
        "#   copy = max(all ranks' traffic / bandwidth of min(N, cores) processes, "
        "busiest rank's / 1 process);"
    )
    say(
        "#     traffic = bytes read + written when each byte crossing ranks is copied once "
        "and a reduction reads each input once"
    )
    say("#   staged = the copy floor of mooncake's two-copy path (into the peer's slot, out of it)")
    say(
        "#   torch floor = floor + torch's layer (in the same ranks, 8 B through dist minus "
        "through the backend object): what a backend that moved nothing would take through dist"
    )
    say("#   mc/flr = mooncake / floor; gl/mc = gloo / mooncake (> 1: mooncake is faster)")


def print_world(
    model: FloorModel, world: int, ops: list[str], backends: list[str], by_backend: dict
) -> None:
    both = MOONCAKE in backends and GLOO in backends
    for op in ops:
        rows = world_rows(model, world, [op], by_backend)
        say()
        say(f"# {op}, world {world}, float32" + (", sum" if "reduce" in op else ""))
        head1 = f"#{'':>10} {'':>10} {'':>5}"
        head2 = f"#{'size':>10} {'count':>10} {'type':>5}"
        head3 = f"#{'(B)':>10} {'(elems)':>10} {'':>5}"
        for b in backends:
            head1 += f" |{b:>24}"
            head2 += f" |{'time':>8} {'algbw':>7} {'busbw':>7}"
            head3 += f" |{'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7}"
        head1 += f" |{'floor':>17} {'':>8}"
        head2 += f" |{'hand':>8} {'copy':>8} {'staged':>8}"
        head3 += f" |{'(us)':>8} {'(us)':>8} {'(us)':>8}"
        if both:
            head1 += f" |{'ratios':>15}"
            head2 += f" |{'mc/flr':>7} {'gl/mc':>7}"
        for h in (head1, head2, head3):
            say(h)
        for row in rows:
            line = f" {row['bytes']:>10} {row['count']:>10} {'float':>5}"
            for b in backends:
                p = row.get(b)
                if p:
                    line += f"  {fmt_us(p['time_us']):>8} {p['algbw_gbps']:>7.2f} "
                    line += f"{p['busbw_gbps']:>7.2f}"
                else:
                    line += f"  {'-':>8} {'-':>7} {'-':>7}"
            f = row["floor"]
            line += f"  {fmt_us(f['handoff_us']):>8} {fmt_us(f['copy_us']):>8}"
            line += f" {fmt_us(f['staged_copy_us']):>8}"
            if both:
                r = row["ratios"]
                line += f"  {fmt_ratio(r['mooncake_over_floor']):>7}"
                line += f" {fmt_ratio(r['gloo_over_mooncake']):>7}"
            say(line)
    sys.stdout.flush()


def print_overheads(overhead: list[dict], backends: list[str]) -> None:
    if not overhead:
        return
    worlds = sorted({o["world"] for o in overhead})
    say()
    say("# per-op cost with no data, as time (us, slowest rank) / sleeps per rank / CPU (us, all")
    say("#   ranks); a sleep is a voluntary context switch: a hand-off. World 1: the call alone.")
    say("#   all_reduce_8B_direct: 8 bytes through the backend object, without dist.all_reduce.")
    say(f"#{'probe':>14} {'backend':>13} " + " ".join(f"{'world ' + str(w):>20}" for w in worlds))
    for probe in ("all_reduce_0B", "barrier", "all_reduce_8B_direct"):
        for b in backends:
            cells = []
            for w in worlds:
                hit = [
                    o for o in overhead if (o["probe"], o["backend"], o["world"]) == (probe, b, w)
                ]
                cell = "-"
                if hit:
                    o = hit[0]
                    cell = (
                        f"{fmt_us(o['time_us'])} / {o['sleeps_per_op']:.1f} / "
                        f"{o['cpu_us_per_op']:.0f}"
                    )
                cells.append(f"{cell:>20}")
            say(f" {probe:>14} {b:>13} " + " ".join(cells))


# --- targets --------------------------------------------------------------------------


def large_verdict(verdict, rows: list[dict], op: str) -> dict:
    """A large op against the copy floor: on the copy made beside each loop where the
    run made it (over_copy_beside), the ratio to the floor model beside it in a
    note; else on the model (the copy rate measured at the start of the run)."""
    t = TARGETS
    name = f"{op} >= {fmt_bytes(t['large_min_bytes'])}: mooncake <= {t['large_floor_ratio']:g}x copy floor"

    def model(r: dict) -> float:
        return r[MOONCAKE]["time_us"] / r["floor"]["copy_us"]

    if rows and all(r["ratios"]["mooncake_over_copy_beside"] is not None for r in rows):
        out = verdict(
            f"{name} (copied beside each loop)",
            rows,
            lambda r: r["ratios"]["mooncake_over_copy_beside"],
            t["large_floor_ratio"],
            "low",
        )
        out["note"] = "against the model's floor: " + ", ".join(
            f"{model(r):.2f} at {fmt_bytes(r['bytes'])}" for r in rows
        )
        return out
    return verdict(name, rows, model, t["large_floor_ratio"], "low")


def check_targets(
    results: dict, backends: list[str], bare: list[dict] = (), fresh: dict | None = None
) -> list[dict]:
    """The targets: each with the measured worst case and a verdict. World 4: small
    all_reduce against its hand-off floor and gloo, large all_reduce, all_gather and
    all_to_all_single against the copy floor, large all_reduce against gloo; world 8:
    an 8-byte all_reduce through torch against the bare C++ core (``bare``). The
    verdicts are on the ranks as launched (forked, as the floors' rings and the bare
    core's ranks are); ``fresh`` (bench_pg.fresh_interpreters) adds a note."""
    t = TARGETS
    rows = [r for r in results["rows"] if r["op"] == "all_reduce" and r["world"] == KEY_WORLD]
    small = [r for r in rows if r["bytes"] <= t["small_max_bytes"] and MOONCAKE in r]
    large = [r for r in rows if r["bytes"] >= t["large_min_bytes"] and MOONCAKE in r]
    large_ops = [
        r
        for r in results["rows"]
        if r["op"] in t["large_ops"]
        and r["world"] == KEY_WORLD
        and r["bytes"] >= t["large_min_bytes"]
        and MOONCAKE in r
    ]

    def verdict(name, selected, value, limit, better) -> dict:
        values = [(r["bytes"], value(r)) for r in selected if value(r) is not None]
        if not values:
            return {"target": name, "met": None, "worst": None, "at_bytes": None}
        pick = min if better == "high" else max
        at, worst = pick(values, key=lambda v: v[1])
        met = worst >= limit if better == "high" else worst <= limit
        return {"target": name, "met": met, "worst": worst, "at_bytes": at, "limit": limit}

    # Paired rounds (bench_pg.small_against_floors), where the run took them: each size
    # against the ring and torch's layer measured beside it.
    paired = next((b.get("small") for b in bare if b["world"] == KEY_WORLD), None) or {}
    in_rounds = " (in rounds with the ring)" if paired else ""

    def vs_handoff(r: dict) -> float:
        if r["bytes"] in paired:
            return paired[r["bytes"]]["vs_handoff"]
        return r[MOONCAKE]["time_us"] / r["floor"]["handoff_us"]

    plain = verdict(
        f"all_reduce <= {fmt_bytes(t['small_max_bytes'])}: mooncake <= "
        f"{t['small_floor_ratio']:g}x hand-off floor{in_rounds}",
        small,
        vs_handoff,
        t["small_floor_ratio"],
        "low",
    )
    # Out of reach when torch's own layer alone (a backend that moves nothing) passes it.
    # The do-nothing figure is a model (hand-off floor + torch's layer); where mooncake
    # beats it, it bounds nothing and goes unsaid.
    nothing = [
        paired[r["bytes"]]["do_nothing_vs_handoff"]
        if r["bytes"] in paired
        else r["floor"]["torch_floor_us"] / r["floor"]["handoff_us"]
        for r in small
        if r["bytes"] in paired or r["floor"]["torch_floor_us"] is not None
    ]
    nothing = [v for v in nothing if v is not None]
    if nothing and max(nothing) > t["small_floor_ratio"] and plain["worst"] >= max(nothing):
        plain["note"] = f"out of reach through torch: a do-nothing backend is at {max(nothing):.2f}"
    fresh_us = ((fresh or {}).get(KEY_WORLD) or {}).get("all_reduce_us", {})
    fresh_ratios = [
        fresh_us[r["bytes"]] / r["floor"]["handoff_us"] for r in small if r["bytes"] in fresh_us
    ]
    if fresh_ratios:
        said = f"{plain['note']}; " if plain.get("note") else ""
        plain["note"] = f"{said}fresh interpreters: {max(fresh_ratios):.2f}"

    def through_torch(r: dict) -> float | None:
        if r["bytes"] in paired:
            return paired[r["bytes"]]["vs_torch_floor"]
        torch_floor = r["floor"]["torch_floor_us"]
        return None if torch_floor is None else r[MOONCAKE]["time_us"] / torch_floor

    out = [
        plain,
        verdict(
            f"all_reduce <= {fmt_bytes(t['small_max_bytes'])}: mooncake <= "
            f"{t['small_floor_ratio']:g}x torch floor (hand-off + torch's layer){in_rounds}",
            small,
            through_torch,
            t["small_floor_ratio"],
            "low",
        ),
        *(
            large_verdict(verdict, [r for r in large_ops if r["op"] == op], op)
            for op in t["large_ops"]
        ),
    ]
    key = [b for b in bare if b["world"] == t["bare_core_world"]]
    vs_bare = {
        "target": f"world {t['bare_core_world']}, 8 B all_reduce: through torch <= "
        f"{t['bare_core_ratio']:g}x the bare core",
        "met": key[0]["ratio"] <= t["bare_core_ratio"] if key else None,
        "worst": key[0]["ratio"] if key else None,
        "at_bytes": 8,
        "limit": t["bare_core_ratio"],
    }
    nothing_ratio = key[0].get("do_nothing_ratio") if key else None
    notes = []
    if (
        nothing_ratio is not None
        and nothing_ratio > t["bare_core_ratio"]
        and vs_bare["worst"] >= nothing_ratio
    ):
        notes.append(f"out of reach through torch: a do-nothing backend is at {nothing_ratio:.2f}")
    fresh_ratio = key[0].get("fresh_ratio") if key else None
    if fresh_ratio is not None:
        # The bare core forks its ranks: the forked ranks are the like-for-like row.
        notes.append(f"ranks forked, as the bare core's; fresh interpreters: {fresh_ratio:.2f}")
    if notes:
        vs_bare["note"] = "; ".join(notes)
    own = key[0].get("backend_object_ratio") if key else None
    out += [
        vs_bare,
        {
            "target": f"world {t['bare_core_world']}, 8 B all_reduce: through the backend "
            f"object <= {t['bare_core_ratio']:g}x the bare core (mooncake's glue, no dist layer)",
            "met": own <= t["bare_core_ratio"] if own is not None else None,
            "worst": own,
            "at_bytes": 8,
            "limit": t["bare_core_ratio"],
        },
    ]
    if GLOO in backends:

        def speedup(r: dict) -> float | None:
            return r["ratios"]["gloo_over_mooncake"]

        vs_gloo = verdict(
            f"all_reduce <= {fmt_bytes(t['small_max_bytes'])}: gloo / mooncake >= "
            f"{t['small_gloo_speedup']:g}",
            small,
            speedup,
            t["small_gloo_speedup"],
            "high",
        )
        best = [
            r[GLOO]["time_us"] / r["floor"]["torch_floor_us"]
            for r in small
            if r.get(GLOO) and r["floor"]["torch_floor_us"]
        ]
        if (
            best
            and min(best) < t["small_gloo_speedup"]
            and vs_gloo["worst"] is not None
            and vs_gloo["worst"] <= min(best)
        ):
            vs_gloo["note"] = (
                f"out of reach through torch: a do-nothing backend would be {min(best):.1f}x "
                "faster than gloo"
            )
        out.insert(1, vs_gloo)
        out.append(
            verdict(
                f"all_reduce >= {fmt_bytes(t['large_min_bytes'])}: gloo / mooncake > 1",
                large,
                speedup,
                t["large_gloo_speedup"],
                "high",
            )
        )
    return out


def print_targets(targets: list[dict]) -> None:
    say()
    say(f"# targets (world {KEY_WORLD} unless named; worst size shown)")
    for t in targets:
        if t["met"] is None:
            say(f"#   n/a   {t['target']}: not measured")
            continue
        mark = "met " if t["met"] else "MISS"
        note = f" ({t['note']})" if t.get("note") else ""
        say(f"#   {mark}  {t['target']}: {t['worst']:.2f} at {fmt_bytes(t['at_bytes'])}{note}")


# --- JSON, Markdown, plot -----------------------------------------------------------------


def floors_json(model: FloorModel) -> dict:
    return {
        "cores": model.cores,
        "handoff": {
            str(n): {
                "hop_us": h.hop_us,
                "raw_hop_us": h.raw_hop_us,
                "loop_us": h.loop_us,
                "trials_us": h.trials_us,
            }
            for n, h in sorted(model.handoff.items())
        },
        "torch_layer_us": {str(n): us for n, us in sorted(model.torch_layer.items())},
        "copy": [
            {
                "bytes": c.nbytes,
                "single_gbps": c.single_gbps,
                "aggregate_gbps": c.aggregate_gbps,
                "processes": c.processes,
            }
            for c in model.copy
        ],
        "small_msg_bytes": model.small_bytes,
        "model": {
            "floor": "max(handoff_us, copy_us)",
            "handoff_us": "rounds * max(1, N / cores) * hop_us(N); rounds = 1 for the direct "
            "algorithms, 2 for all_reduce (reduce-scatter + all-gather) and broadcast "
            "(scatter + all-gather) above small_msg_bytes",
            "copy_us": "max(sum(traffic_bytes_per_rank) / (2 * copy_gbps(size, min(N, cores))), "
            "max(traffic_bytes_per_rank) / (2 * copy_gbps(size, 1))); traffic = bytes read + "
            "written when every byte crossing ranks is copied once and a reduction reads each "
            "input once",
            "staged_copy_us": "the same, for mooncake's two-copy path (sender into the peer's "
            "slot, receiver out of it)",
            "torch_floor_us": "floor + torch_layer_us(N): an 8-byte dist.all_reduce minus the "
            "same op through the backend object, in the benchmark's mooncake ranks",
        },
    }


def markdown_table(rows: list[dict], backends: list[str]) -> str:
    """The README's key rows: world 4, all_reduce over sizes, the other ops at 4 KiB and 16 MiB."""
    index = {(r["op"], r["bytes"]): r for r in rows if r["world"] == KEY_WORLD}
    cols = ["op", "size"] + [f"{b} (us)" for b in backends]
    cols += ["floor (us)", "bound by"]
    if MOONCAKE in backends:
        cols += ["mooncake / floor"]
    if GLOO in backends and MOONCAKE in backends:
        cols += ["gloo / mooncake"]
    if MOONCAKE in backends:
        cols += ["mooncake busbw (GB/s)"]
    table = []
    for op, nbytes in KEY_ROWS:
        r = index.get((op, nbytes))
        if r is None:
            continue
        cells = [f"`{op}`", fmt_bytes(nbytes)]
        cells += [fmt_us(r[b]["time_us"]) if b in r else "-" for b in backends]
        cells += [fmt_us(r["floor"]["floor_us"]), r["floor"]["bound"]]
        if MOONCAKE in backends:
            cells.append(fmt_ratio(r["ratios"]["mooncake_over_floor"]))
        if GLOO in backends and MOONCAKE in backends:
            cells.append(fmt_ratio(r["ratios"]["gloo_over_mooncake"]))
        if MOONCAKE in backends:
            cells.append(f"{r[MOONCAKE]['busbw_gbps']:.2f}" if MOONCAKE in r else "-")
        table.append(cells)
    lines = [
        f"World size {KEY_WORLD}, float32; time = the slowest rank's mean over a timed loop "
        "(the fastest of the point's loops).",
        "",
        *harness.markdown_table(cols, table, "ll" + "r" * (len(cols) - 2)),
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], backends: list[str], path: Path) -> None:
    """Time vs size: one subplot per (op, world size), each backend and the floor a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows if r["world"] >= 2))
    worlds = sorted({r["world"] for r in rows if r["world"] >= 2})
    if not ops or not worlds:
        return
    fig, axes = plt.subplots(
        len(ops),
        len(worlds),
        figsize=(4.6 * len(worlds), 3.3 * len(ops)),
        squeeze=False,
        sharex=True,
    )
    style = {MOONCAKE: ("tab:blue", "o"), GLOO: ("tab:orange", "s")}
    for i, op in enumerate(ops):
        for j, world in enumerate(worlds):
            ax = axes[i][j]
            sel = sorted(
                (r for r in rows if r["op"] == op and r["world"] == world), key=lambda r: r["bytes"]
            )
            x = [r["bytes"] for r in sel]
            for b in backends:
                have = [r for r in sel if b in r]
                if have:
                    color, marker = style.get(b, ("tab:green", "^"))
                    xs, ys = [r["bytes"] for r in have], [r[b]["time_us"] for r in have]
                    ax.plot(xs, ys, marker=marker, ms=3.5, color=color, label=b)
            if sel and sel[0]["floor"]:
                ax.plot(x, [r["floor"]["floor_us"] for r in sel], "k--", lw=1.2, label="floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(f"{op}, world {world}", fontsize=10)
            if j == 0:
                ax.set_ylabel("time (us)")
            if i == len(ops) - 1:
                ax.set_xlabel("size (bytes)")
            ticks = [t for t in (8, 1 << 8, 1 << 12, 1 << 16, 1 << 20, 1 << 24) if x and t <= x[-1]]
            ax.set_xticks(ticks, [fmt_bytes(t).replace(" ", "") for t in ticks])
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle("mooncake-cpu vs gloo vs floor (float32, this host)", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)
