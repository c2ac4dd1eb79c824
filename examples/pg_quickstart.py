"""Mooncake PG quick start on CPU: run with torchrun.

    torchrun --standalone --nproc-per-node=2 examples/pg_quickstart.py

Every rank joins the ``mooncake-cpu`` group with an active-rank mask, runs a
few collectives and a point-to-point exchange, checks each result, and
prints it. The exit code is 0 only when every check passed.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from mooncake import pg


def main() -> int:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    # Backend-level active-rank mask: int32, on the CPU for mooncake-cpu.
    active_ranks = torch.ones(world_size, dtype=torch.int32)
    dist.init_process_group(
        backend="mooncake-cpu",
        rank=rank,
        world_size=world_size,
        pg_options=pg.MooncakeBackendOptions(active_ranks),
    )
    failures = []

    def report(name: str, got, want) -> None:
        ok = got == want
        print(f"rank={rank} {name}={got}{'' if ok else f' (expected {want})'}", flush=True)
        if not ok:
            failures.append(name)

    x = torch.tensor([rank + 1], dtype=torch.int32)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    report("all_reduce", int(x.item()), world_size * (world_size + 1) // 2)

    y = torch.full((4,), float(rank))
    dist.broadcast(y, src=world_size - 1)
    report("broadcast", y.tolist(), [float(world_size - 1)] * 4)

    out = torch.empty(world_size, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([rank * 10]))
    report("all_gather", out.tolist(), [r * 10 for r in range(world_size)])

    z = torch.full((3,), rank + 1.0, dtype=torch.bfloat16)
    dist.all_reduce(z, op=dist.ReduceOp.AVG, async_op=True).wait()
    report("all_reduce_avg_bf16", z.float().tolist(), [(world_size + 1) / 2] * 3)

    if world_size > 1:
        nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
        got = torch.empty(2)
        reqs = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.tensor([rank, rank * 2.0]), nxt),
                dist.P2POp(dist.irecv, got, prv),
            ]
        )
        for req in reqs:
            req.wait()
        report("ring_exchange", got.tolist(), [float(prv), prv * 2.0])

    report("active_ranks", pg.get_active_ranks(dist.group.WORLD).tolist(), [1] * world_size)
    report("num_synced_ranks", pg.get_num_synced_ranks(dist.group.WORLD), world_size)

    dist.barrier()
    dist.destroy_process_group()
    if failures:
        print(f"rank={rank} FAILED: {', '.join(failures)}", flush=True)
        return 1
    print(f"rank={rank} OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
