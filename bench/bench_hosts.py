"""Across hosts: all_reduce and all_to_all_single at world 4 on two hosts of two ranks
(network namespaces on this machine, see tools/hosts.py), over our tcp transport
and over ucx (UCX kept to tcp: the same wire), beside the same world on one host
(shared memory). Each point: warm-up, then timed loops of back-to-back ops between
barriers; a loop's time is the slowest rank's mean, a point's its fastest loop's.

    .venv/bin/python bench/bench_hosts.py            # about two minutes here
    .venv/bin/python bench/bench_hosts.py --quick    # three sizes

It starts itself again inside a user and network namespace of its own (``unshare -rn``)
and prints a markdown table; results also go to ``<out-dir>/hosts.json``. Where
namespaces cannot be made it says why and exits 0 (the other benchmarks still run).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))  # hosts.py: the namespaces, shared with the tests

import hosts  # noqa: E402

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
QUICK_SIZES = (4 << 10, 1 << 20, 16 << 20)
OPS = ("all_reduce", "all_to_all_single")
#: label -> (hosts of ranks 0..3, environment)
#: "every peer": that transport even between the two ranks of a host, so that tcp and ucx
#: carry the same traffic; "auto": shared memory within a host, tcp across.
SETUPS = {
    "one host (shm)": ((0, 0, 0, 0), {"MOONCAKE_TRANSPORT": "auto"}),
    "2 hosts, auto": ((0, 0, 1, 1), {"MOONCAKE_TRANSPORT": "auto"}),
    "2 hosts, tcp every peer": ((0, 0, 1, 1), {"MOONCAKE_TRANSPORT": "tcp"}),
    "2 hosts, ucx every peer": ((0, 0, 1, 1), {"MOONCAKE_TRANSPORT": "ucx", "UCX_TLS": "tcp"}),
}


def rank_fn(rank, world, port, sizes):
    import torch
    import torch.distributed as dist

    import mooncake.pg  # noqa: F401  (registers the backend)
    from mooncake.launch import store_host

    store = dist.TCPStore(store_host(), port, world, False)
    dist.init_process_group("mooncake-cpu", store=store, rank=rank, world_size=world)
    out = {}
    for op in OPS:
        for n in sizes:
            x = torch.ones(n // 4)
            y = torch.empty_like(x)
            if op == "all_reduce":
                run = functools.partial(dist.all_reduce, x)
            else:
                run = functools.partial(dist.all_to_all_single, y, x)
            iters = max(3, min(200, (64 << 20) // max(n, 1) // 16))
            for _ in range(2):
                run()
            best = float("inf")
            for _ in range(3):
                dist.barrier()
                best = min(best, harness.rank_max(harness.mean_seconds(run, iters)))
            out[f"{op}/{n}"] = best
            if rank == 0:
                print(f"    {op} {n} B: {best * 1e6:.0f} us", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return out


def inside(args) -> int:
    f = hosts.fabric(2)
    sizes = QUICK_SIZES if args.quick else SIZES
    results = {}
    for label, (where, env) in SETUPS.items():
        if "ucx" in label and not _ucx_built():
            continue
        placement = None if len(set(where)) == 1 else f.placement(where)
        kw = {"placement": placement, "store_host": f.gateway} if placement else {}
        env = {"OMP_NUM_THREADS": "1", **env}
        run = harness.launch(4, rank_fn, (sizes,), env=env, timeout_s=600, **kw)
        if run.error:
            raise RuntimeError(f"{label}: {run.error}")
        results[label] = run.returned["0"]
        print(f"  {label}: done", file=sys.stderr, flush=True)
    print(json.dumps({"sizes": sizes, "results": results}))
    return 0


def _ucx_built() -> bool:
    from mooncake._loader import load_extension

    return "ucx" in load_extension().TransferEngine.available_transports()


def table(data) -> str:
    sizes, res = data["sizes"], data["results"]
    labels = list(res)
    rows = []
    for op in OPS:
        for n in sizes:
            key = f"{op}/{n}"
            cells = [f"{res[lb][key] * 1e6:,.0f} µs" for lb in labels]
            ratio = ""
            ucx, tcp = res.get("2 hosts, ucx every peer"), res.get("2 hosts, tcp every peer")
            if ucx and tcp:
                ratio = f"{ucx[key] / tcp[key]:.2f}"
            rows.append([op, harness.fmt_bytes(n), *cells, ratio])
    return "\n".join(harness.markdown_table(["op", "size", *labels, "ucx / tcp"], rows))


def main() -> int:
    p = harness.arg_parser(__doc__.splitlines()[0])
    harness.add_output_args(p, "three sizes")
    args = p.parse_args()
    if hosts.inside():
        return inside(args)
    why = hosts.reason()
    if why:
        print(f"bench_hosts: skipped: {why}")
        return 0
    argv = [str(Path(__file__).resolve())] + (["--quick"] if args.quick else [])
    r = hosts.run_inside(argv, timeout_s=1800)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
        return r.returncode
    data = json.loads(r.stdout.strip().splitlines()[-1])
    harness.write_outputs(args.out_dir, {"hosts.json": data})
    print("world 4 (ranks 0, 1 on host A; 2, 3 on host B), mooncake-cpu, times per op:\n")
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
