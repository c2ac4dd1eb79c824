"""A round of the mapped all_reduce (``MOONCAKE_CUDA_MAPPED=1``) at 2+ processes, for
compute-sanitizer.

    mapped_round.py [--world N]     (default 2; starts N ranks on the one GPU)

A group with a 64 KiB device-driven bound and a 256 KiB segment, so that a 1 MiB
``all_reduce`` is four launches of the mapped kernel. Each case runs twice on the same
tensor: its first call goes through the segments (the tensor's allocation is not mapped
yet), its second reads the tensors in place. Cases: fp32 SUM, bf16 MAX on an odd count, and
an fp32 view 4 bytes into its allocation (not 16-byte aligned: never offered, so it goes
through the segments every time, element by element). Every result is checked against a
reference made here from every rank's inputs (small integers: exact in any order), and
``pg.get_op_paths`` must count launches both ways. Exits non-zero on a wrong result, a
wrong count, or a rank that fails or does not finish. scripts/gpu_check.sh runs it under
memcheck and racecheck (compute-sanitizer follows the ranks, its child processes).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from round_ranks import round_main

ROUND_TIMEOUT_S = 200
ENV = {
    "MOONCAKE_CUDA_MAPPED": "1",
    "MOONCAKE_CUDA_DIRECT_BYTES": str(64 << 10),
    "MOONCAKE_CUDA_SEGMENT_BYTES": str(256 << 10),
}
N = 1 << 18  # elements: 1 MiB of fp32


def data(rank: int, n: int, salt: int) -> torch.Tensor:
    """Rank ``rank``'s input: small integers (exact sums), different per rank and case."""
    i = torch.arange(n, dtype=torch.int64)
    return ((i * (rank + 3) + salt) % 17 + rank).to(torch.float32)


def rank_main(rank: int, world: int, port: int) -> int:
    from mooncake import pg  # noqa: F401 - registers the backends

    os.environ.update(ENV)
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group("mooncake", store=store, rank=rank, world_size=world)
    bad = []
    cases = (
        ("fp32 sum", torch.float32, dist.ReduceOp.SUM, N, 0),
        ("bf16 max, odd count", torch.bfloat16, dist.ReduceOp.MAX, N + 4099, 0),
        ("fp32 sum, unaligned view", torch.float32, dist.ReduceOp.SUM, N, 1),
    )
    before = pg.get_op_paths(dist.group.WORLD)
    for salt, (what, dtype, op, n, skew) in enumerate(cases):
        inputs = [data(r, n, salt) for r in range(world)]
        stacked = torch.stack(inputs)
        want = stacked.sum(0) if op == dist.ReduceOp.SUM else stacked.max(0).values
        base = torch.empty(n + skew, dtype=dtype, device="cuda")
        x = base[skew:]
        for call in range(2):
            x.copy_(inputs[rank].to(dtype))
            dist.all_reduce(x, op=op)
            got = x.float().cpu()
            if not torch.equal(got, want.to(dtype).float()):
                wrong = int((got != want.to(dtype).float()).sum())
                bad.append(f"{what}, call {call}: {wrong} of {n} elements wrong")
    torch.cuda.synchronize()
    after = pg.get_op_paths(dist.group.WORLD)
    mapped = after["mapped"] - before["mapped"]
    planed = after["mapped_planed"] - before["mapped_planed"]
    if mapped == 0 or planed == 0:
        bad.append(f"launches in place {mapped}, through the segments {planed}: want both > 0")
    dist.barrier()
    dist.destroy_process_group()
    print(f"mapped_round rank {rank}/{world}:", "ok" if not bad else f"wrong: {bad}")
    return 1 if bad else 0


def main() -> int:
    return round_main(__file__, __doc__, "mapped_round", rank_main, ROUND_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main())
