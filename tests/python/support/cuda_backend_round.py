"""One world-1 round of the ``mooncake`` backend's device plane, for compute-sanitizer.

Every op the plane serves, on inputs that take it (``MOONCAKE_CUDA_PLANE_MIN_BYTES=0``),
checked against local references; exits non-zero on a wrong result. scripts/gpu_check.sh
runs it under memcheck and racecheck (the reduce kernel and the plane's copies).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    os.environ["MOONCAKE_CUDA_PLANE_MIN_BYTES"] = "0"
    from mooncake import pg

    torch.cuda.set_device(0)
    active = torch.ones(1, dtype=torch.int32, device="cuda")
    dist.init_process_group(
        "mooncake",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        pg_options=pg.MooncakeBackendOptions(active),
    )
    g = torch.Generator().manual_seed(1)
    bad = []

    def same(what, got, want):
        if not torch.equal(got.cpu(), want):
            bad.append(what)

    for dtype, op in (
        (torch.float32, dist.ReduceOp.SUM),
        (torch.bfloat16, dist.ReduceOp.AVG),
        (torch.int64, dist.ReduceOp.MAX),
        (torch.float16, dist.ReduceOp.MIN),
    ):
        for n in (1, 7, 1001, 70_000):
            host = (torch.randn(n, generator=g) * 100).to(dtype)
            x = host.cuda()
            dist.all_reduce(x, op=op)
            same(f"all_reduce {dtype} {op} n{n}", x, host)
    host = torch.randn(3001, generator=g)
    x = host.cuda()
    dist.broadcast(x, src=0)
    same("broadcast", x, host)
    out = torch.empty(3001, device="cuda")
    dist.all_gather_into_tensor(out, host.cuda())
    same("all_gather_into_tensor", out, host)
    dist.reduce_scatter_tensor(out, host.cuda())
    same("reduce_scatter_tensor", out, host)
    rows = torch.randn(50, 3, generator=g)
    out = torch.empty(50, 3, device="cuda")
    dist.all_to_all_single(out, rows.cuda())
    same("all_to_all_single", out, rows)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    print("cuda_backend_round:", "ok" if not bad else f"wrong results: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
