"""How long the elastic EP buffer takes to stage, activate and replace a peer.

``Buffer.create_elastic`` (``mooncake/ep/elastic.py``, ``src/ep/elastic.h``) on
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
``elastic_table.md`` (``elastic_cuda.json``, ``elastic_cuda_table.md`` with
``--device cuda``).

``--device cuda``: every process on the one GPU (under MPS where it runs: a victim
kills itself between rounds, its kernels done), the workspaces in device memory, CUDA
tensors: every round runs the device path's kernels (a round on another path fails the
run) and is timed to the device's end (synchronised). Without a GPU it measures nothing
and exits 1 (0 with ``--if-gpu``).

    .venv/bin/python bench/bench_elastic.py            # worlds 4 and 8, about a minute
    .venv/bin/python bench/bench_elastic.py --quick    # world 4, fewer repeats
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import harness

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


ABORT = "abort"  # set by a process that failed: the others stop waiting for it


def sync(store, name: str, n: int) -> None:
    harness.store_barrier(store, name, n, timeout_s=120, abort_key=ABORT)


def one_round(buf, cfg: dict, world: int, step: int) -> float:
    import torch

    g = torch.Generator().manual_seed(step * 1000 + buf.rank)
    T, H, K, epr = cfg["T"], cfg["H"], cfg["topk"], cfg["experts_per_rank"]
    E = epr * world
    dev = torch.device(cfg["device"])
    x = torch.randn(T, H, generator=g).bfloat16().to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    recv_x, count, handle, _, _ = buf.dispatch(x, idx, None, T, E, cfg["timeout_us"], use_fp8=False)
    buf.combine(recv_x, idx, w, None, cfg["timeout_us"], handle)
    if cuda:
        torch.cuda.synchronize()  # the kernels' time too (and none left running at a kill)
        if buf.path != "device":
            raise RuntimeError(
                f"slot {buf.rank}: a round took the {buf.path} path, not the device's"
            )
    return time.perf_counter() - t0


def process(role: str, slot: int, world: int, port: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from mooncake.mooncake_ep_buffer import Buffer

    torch.set_num_threads(1)
    if cfg["device"] == "cuda":
        torch.cuda.set_device(0)  # the workspace goes on the current device
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    sync(store, "imported", world + cfg["replacements"])
    out: dict[str, list[float]] = {m: [] for m in MEASURES}

    # The device path needs a workspace (num_rdma_bytes); the portable path none.
    workspace = 0
    if cfg["device"] == "cuda":
        epr = cfg["experts_per_rank"]
        workspace = Buffer.get_ep_buffer_size_hint(cfg["T"], cfg["H"], world, epr * world)

    def create(s: int):
        buf = Buffer.create_elastic(rank=s, tcp_store_group=store, timeout_ms=cfg["timeout_ms"])
        buf.update_memory_buffers(
            num_ranks=world, num_experts_per_rank=cfg["experts_per_rank"], num_rdma_bytes=workspace
        )
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
        harness.store_wait(store, f"go/{slot}", 600, ABORT)
        t0 = time.perf_counter()
        buf = create(VICTIM)
        others = [p for p in range(world) if p != VICTIM]
        buf.connect_ranks(others, activate=False)
        publish(buf, others)
        out["ready"].append(time.perf_counter() - t0)
        harness.publish(store, f"result/standby{slot}", out)
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
        buf.connect_ranks(peers, activate=False)
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
            timed("stage_new", lambda: buf.connect_ranks(old, activate=False))
        else:
            timed("stage", lambda: buf.connect_ranks([new], activate=False))
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
        buf.connect_ranks([VICTIM], activate=False)
        buf.update_mask_buffer(VICTIM, False)
        out["reconnect"].append(time.perf_counter() - t0)
        sync(store, f"replaced{k}", world)
        one_round(buf, cfg, world, 10_000 + k)
        out["kill_to_full"].append(time.time() - killed)
    harness.publish(store, f"result/{slot}", out)
    sync(store, "end", world)


# --- the parent -----------------------------------------------------------------------


def _role(slot: int, world: int, port: int, role: str, cfg: dict) -> None:
    try:
        process(role, slot, world, port, cfg)
    except harness.Aborted:
        raise
    except BaseException as e:
        # The victims' SIGKILL is no failure; an exception is, and ends everyone's waits.
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        store.set(ABORT, f"{role} {slot}: {type(e).__name__}: {e}"[:500])
        raise


def run_world(world: int, cfg: dict, timeout_s: float) -> dict:
    # The victims kill themselves: no grace, and their exit codes are read below.
    run = harness.launch(
        world,
        _role,
        ("member", cfg),
        env={"OMP_NUM_THREADS": "1"},
        timeout_s=timeout_s,
        grace_s=None,
        more=[(range(cfg["replacements"]), ("standby", cfg))],
    )
    if run.timed_out:
        print(f"# world {world}: {run.error}", file=sys.stderr)
    samples: dict[str, list[float]] = {m: [] for m in MEASURES}
    keys = [f"result/{s}" for s in range(world)]
    keys += [f"result/standby{k}" for k in range(cfg["replacements"])]
    for key in keys:
        for m, v in harness.store_json(run.store, key, {}).items():
            samples[m] += v
    # p90: the smallest sample with more than 90% at or below it, as the tables always had
    stats = {"n": "n", "median_ms": "median", "p90_ms": "p90", "max_ms": "max"}
    rows = [
        {
            "measure": m,
            "what": MEASURES[m],
            **harness.summarize(v, stats, method="above", scale=1e3),
        }
        for m, v in samples.items()
        if v
    ]
    return {"world": world, "wall_s": run.wall_s, "rows": rows, "exit": run.codes}


def markdown_table(results: list[dict]) -> str:
    header = ["measure"] + [f"W={r['world']} median (p90), ms" for r in results]
    table = []
    for m, what in MEASURES.items():
        cells = [what]
        for r in results:
            row = next((x for x in r["rows"] if x["measure"] == m), None)
            cells.append(f"{row['median_ms']:.2f} ({row['p90_ms']:.2f})" if row else "-")
        table.append(cells)
    return "\n".join(harness.markdown_table(header, table)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = harness.arg_parser(__doc__.split("\n")[0], world_sizes="4,8")
    p.add_argument("--cycles", type=int, default=5, help="stage/activate repeats")
    p.add_argument("--replacements", type=int, default=3, help="kill + replace repeats")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per phase")
    p.add_argument("--tokens", type=int, default=16, help="T")
    p.add_argument("--hidden", type=int, default=1024, help="H")
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--timeout-ms", type=int, default=5000, help="the buffers' timeout_ms")
    p.add_argument("--launch-timeout", type=float, default=300)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the tensors' device")
    harness.add_if_gpu(p)
    harness.add_output_args(p, "world 4, 3 cycles, 2 replacements")
    quick = {"world_sizes": "4", "cycles": 3, "replacements": 2, "rounds": 3}
    args = harness.parse_args(p, argv, quick)
    worlds = harness.csv_ints(args.world_sizes)
    if min(worlds) < 3:
        p.error("world sizes must be >= 3 (a victim, a new peer and slot 0)")
    if args.device == "cuda":
        status = harness.no_gpu_status("bench_elastic", args.if_gpu)
        if status is not None:
            return status
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
        "device": args.device,
    }
    started, load = time.time(), os.getloadavg()
    results = []
    for w in worlds:
        print(f"# world {w} ...", file=sys.stderr, flush=True)
        results.append(run_world(w, cfg, args.launch_timeout))
    table = markdown_table(results)
    print(table)
    meta = harness.run_meta(started, os.cpu_count(), load, args)
    stem = "elastic" if args.device == "cpu" else "elastic_cuda"
    files = {f"{stem}.json": {"meta": meta, "results": results}, f"{stem}_table.md": table}
    harness.write_outputs(args.out_dir, files)
    bad = [r for r in results if any(c not in (0, -signal.SIGKILL) for c in r["exit"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
