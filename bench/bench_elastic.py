"""How long the elastic EP buffer takes to stage, activate and replace a peer.

``Buffer.create_elastic`` (``mooncake/_ep_elastic.py``, ``src/ep/elastic.h``) on
CPU tensors. One run per world size ``W``: slots ``0 .. W-2`` start connected;
slot ``W-1`` is the new peer. Measured, in one run:

* **stage**: ``connect_ranks([new], activate=False)`` on an existing rank
  (maps the peer's memory, publishes this side's link), and the new process's
  ``connect_ranks`` to all ``W-1`` existing ranks;
* **activate**: ``update_mask_buffer(peer, mask=False)`` (takes the peer's link,
  restarts the channel);
* **round**: one ``dispatch`` + ``combine`` (T tokens, hidden H, top-k, BF16)
  among all active slots, before and after the new peer joined;
* **replace**: slot 1 is killed (SIGKILL) right after a round; the survivors'
  next dispatch masks it (**detect**: kill to dispatch return); they
  ``disconnect_ranks`` it, and a standby process (already started, torch
  imported) creates the replacement buffer for slot 1, connects and publishes
  (**ready**) while the survivors reconnect (**reconnect**); **kill to full
  round** ends when the first round with every slot active returns.

Stage/activate are repeated by disconnecting and reconnecting the new peer;
replace runs ``--replacements`` times. Results: ``<out-dir>/elastic.json`` and
``elastic_table.md``.

    .venv/bin/python bench/bench_elastic.py            # worlds 4 and 8, about a minute
    .venv/bin/python bench/bench_elastic.py --quick    # world 4, fewer repeats
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
VICTIM = 1
MEASURES = {
    "stage": "connect_ranks([new peer], activate=False), existing rank",
    "stage_new": "the new process's connect_ranks to all existing ranks",
    "activate": "update_mask_buffer(peer, mask=False), per peer",
    "round_before": "dispatch + combine, before the new peer",
    "round_after": "dispatch + combine, with the new peer",
    "detect": "replace: SIGKILL to the survivors' dispatch returning with it masked",
    "ready": "replace: replacement's create_elastic + update_memory_buffers + connect + publish",
    "reconnect": "replace: survivors' disconnect + connect + publish of the slot",
    "kill_to_full": "replace: SIGKILL to the first full round's return",
}


# --- the processes --------------------------------------------------------------------


def sync(store, name: str, n: int, timeout_s: float = 120) -> None:
    """Store barrier of ``n`` processes."""
    if store.add(f"sync/{name}", 1) == n:
        store.set(f"sync/{name}/done", "1")
    store.wait([f"sync/{name}/done"], timedelta(seconds=timeout_s))


def one_round(buf, cfg: dict, world: int, step: int) -> float:
    import torch

    g = torch.Generator().manual_seed(step * 1000 + buf.rank)
    T, H, K, epr = cfg["T"], cfg["H"], cfg["topk"], cfg["experts_per_rank"]
    E = epr * world
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    t0 = time.perf_counter()
    recv_x, count, handle, _, _ = buf.dispatch(x, idx, None, T, E, cfg["timeout_us"], use_fp8=False)
    buf.combine(recv_x, idx, w, None, cfg["timeout_us"], handle)
    return time.perf_counter() - t0


def process(role: str, slot: int, world: int, port: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from mooncake.mooncake_ep_buffer import Buffer

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    sync(store, "imported", world + cfg["replacements"])
    out: dict[str, list[float]] = {m: [] for m in MEASURES}

    def create(s: int):
        buf = Buffer.create_elastic(s, store, timeout_ms=cfg["timeout_ms"])
        buf.update_memory_buffers(num_ranks=world, num_experts_per_rank=cfg["experts_per_rank"])
        return buf

    def timed(key: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        out[key].append(time.perf_counter() - t0)

    def publish(buf, peers):
        for p in peers:
            buf.update_mask_buffer(p, False)

    new = world - 1
    old = list(range(world - 1))
    if role == "standby":  # waits to replace slot VICTIM
        store.wait([f"go/{slot}"], timedelta(seconds=600))
        t0 = time.perf_counter()
        buf = create(VICTIM)
        others = [p for p in range(world) if p != VICTIM]
        buf.connect_ranks(others)
        publish(buf, others)
        out["ready"].append(time.perf_counter() - t0)
        store.set(f"result/standby{slot}", json.dumps(out))
        sync(store, f"replaced{slot}", world)
        one_round(buf, cfg, world, 10_000 + slot)
        if slot + 1 < cfg["replacements"]:  # the next replacement takes over from this one
            sync(store, f"kill{slot + 1}", world)
            one_round(buf, cfg, world, 20_000 + slot)
            store.set(f"killed_at/{slot + 1}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            sync(store, "end", world)
        return

    buf = create(slot)
    if slot != new:
        peers = [p for p in old if p != slot]
        buf.connect_ranks(peers)
        publish(buf, peers)
    sync(store, "initial", world)
    if slot != new:
        for i in range(cfg["rounds"]):
            out["round_before"].append(one_round(buf, cfg, world - 1, i))
    for cycle in range(cfg["cycles"]):
        if cycle:
            buf.disconnect_ranks(old if slot == new else [new])
        sync(store, f"stage{cycle}", world)
        if slot == new:
            timed("stage_new", lambda: buf.connect_ranks(old))
        else:
            timed("stage", lambda: buf.connect_ranks([new]))
        sync(store, f"staged{cycle}", world)
        for p in old if slot == new else [new]:
            timed("activate", lambda p=p: buf.update_mask_buffer(p, False))
        for i in range(cfg["rounds"]):
            out["round_after"].append(one_round(buf, cfg, world, 100 * cycle + i))
    for k in range(cfg["replacements"]):
        if k == 0:
            sync(store, f"kill{k}", world)
            one_round(buf, cfg, world, 20_000 + k)
            if slot == VICTIM:
                store.set(f"killed_at/{k}", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        elif slot == VICTIM:
            break  # unreachable: the victim is dead
        else:
            sync(store, f"kill{k}", world)
            one_round(buf, cfg, world, 20_000 + k)
        # The survivors: the next dispatch masks the victim.
        killed = float(store.get(f"killed_at/{k}").decode())
        one_round(buf, cfg, world, 30_000 + k)
        out["detect"].append(time.time() - killed)
        assert buf.slot_state(VICTIM) == "staged", buf.slot_state(VICTIM)
        t0 = time.perf_counter()
        buf.disconnect_ranks([VICTIM])
        if slot == 0:
            store.set(f"go/{k}", "1")
        buf.connect_ranks([VICTIM])
        buf.update_mask_buffer(VICTIM, False)
        out["reconnect"].append(time.perf_counter() - t0)
        sync(store, f"replaced{k}", world)
        one_round(buf, cfg, world, 10_000 + k)
        out["kill_to_full"].append(time.time() - killed)
    store.set(f"result/{slot}", json.dumps(out))
    sync(store, "end", world)


# --- the parent -----------------------------------------------------------------------


def _role(slot: int, world: int, port: int, role: str, cfg: dict) -> None:
    process(role, slot, world, port, cfg)


def run_world(world: int, cfg: dict, timeout_s: float) -> dict:
    from mooncake.launch import LocalGroup

    started = time.time()
    with LocalGroup(world, env={"OMP_NUM_THREADS": "1"}) as group:
        store = group.store
        keys = group.start(_role, args=("member", cfg))
        keys += group.start(_role, ranks=range(cfg["replacements"]), args=("standby", cfg))
        if group.wait_all(keys, timeout_s):
            print(f"# world {world}: timed out after {timeout_s} s", file=sys.stderr)
        codes = group.reap(keys)
        samples: dict[str, list[float]] = {m: [] for m in MEASURES}
        keys = [f"result/{s}" for s in range(world)]
        keys += [f"result/standby{k}" for k in range(cfg["replacements"])]
        for key in keys:
            if store.check([key]):
                for m, v in json.loads(store.get(key)).items():
                    samples[m] += v
        rows = []
        for m, v in samples.items():
            if v:
                v = sorted(v)
                rows.append(
                    {
                        "measure": m,
                        "what": MEASURES[m],
                        "n": len(v),
                        "median_ms": statistics.median(v) * 1e3,
                        "p90_ms": v[min(len(v) - 1, int(0.9 * len(v)))] * 1e3,
                        "max_ms": v[-1] * 1e3,
                    }
                )
    return {"world": world, "wall_s": round(time.time() - started, 1), "rows": rows, "exit": codes}


def markdown_table(results: list[dict]) -> str:
    worlds = [r["world"] for r in results]
    head = "| measure | " + " | ".join(f"W={w} median (p90), ms" for w in worlds) + " |"
    lines = [head, "|---|" + "---|" * len(worlds)]
    for m, what in MEASURES.items():
        cells = []
        for r in results:
            row = next((x for x in r["rows"] if x["measure"] == m), None)
            cells.append(f"{row['median_ms']:.2f} ({row['p90_ms']:.2f})" if row else "-")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="4,8")
    p.add_argument("--cycles", type=int, default=5, help="stage/activate repeats")
    p.add_argument("--replacements", type=int, default=3, help="kill + replace repeats")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per phase")
    p.add_argument("--tokens", type=int, default=16, help="T")
    p.add_argument("--hidden", type=int, default=1024, help="H")
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--timeout-ms", type=int, default=5000, help="the buffers' timeout_ms")
    p.add_argument("--launch-timeout", type=float, default=300)
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--quick", action="store_true", help="world 4, 3 cycles, 2 replacements")
    args = p.parse_args(argv)
    if args.quick:
        args.world_sizes, args.cycles, args.replacements, args.rounds = "4", 3, 2, 3
    worlds = [int(w) for w in args.world_sizes.split(",")]
    if min(worlds) < 3:
        p.error("world sizes must be >= 3 (a victim, a new peer and slot 0)")
    cfg = {
        "cycles": args.cycles,
        "replacements": args.replacements,
        "rounds": args.rounds,
        "T": args.tokens,
        "H": args.hidden,
        "experts_per_rank": args.experts_per_rank,
        "topk": min(args.topk, args.experts_per_rank * 2),
        "timeout_ms": args.timeout_ms,
        "timeout_us": args.timeout_ms * 1000,
    }
    sys.path.insert(0, str(HERE))
    import bench_pg

    started, load = time.time(), os.getloadavg()
    results = []
    for w in worlds:
        print(f"# world {w} ...", file=sys.stderr, flush=True)
        results.append(run_world(w, cfg, args.launch_timeout))
    table = markdown_table(results)
    print(table)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = bench_pg.run_meta(started, os.cpu_count(), load, args)
    (out / "elastic.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "elastic_table.md").write_text(table)
    bad = [r for r in results if any(c not in (0, -signal.SIGKILL) for c in r["exit"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
