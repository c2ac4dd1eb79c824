"""The demo behind ``make demo``: a local group of CPU ranks and what the
mooncake-cpu backend does with it."""

from __future__ import annotations


def _rank_main(rank: int, world_size: int, port: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from mooncake import pg
    from mooncake.launch import init_rank

    lines: list[str] = []

    def say(text: str) -> None:
        if rank == 0:
            lines.append(text)

    init_rank(rank, world_size, port)
    group = dist.group.WORLD
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    say(f"all_reduce(SUM) of rank+1 over {world_size} ranks = {x.item():g}")
    big = torch.full((1 << 20,), 1.0, dtype=torch.bfloat16)
    dist.all_reduce(big, op=dist.ReduceOp.AVG)
    say(f"all_reduce(AVG) of 1M bf16 ones = {big[0].item():g} (reduce-scatter + all-gather)")
    out = [torch.empty(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([rank, rank * rank]))
    say(f"all_gather = {[t.tolist() for t in out]}")
    splits = [r + 1 for r in range(world_size)]  # rank r sends r+1 rows to each... uneven
    inp = torch.full((sum(splits),), rank, dtype=torch.int32)
    outp = torch.empty(world_size * (rank + 1), dtype=torch.int32)
    dist.all_to_all_single(outp, inp, [rank + 1] * world_size, splits)
    say(f"all_to_all_single with uneven splits: rank 0 got {outp.tolist()}")
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    got = torch.empty(1, dtype=torch.int64)
    reqs = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.tensor([rank]), right), dist.P2POp(dist.irecv, got, left)]
    )
    for r in reqs:
        r.wait()
    say(f"batch_isend_irecv ring: rank 0 received {got.item()} from rank {left}")
    try:
        bad = torch.zeros(3 if rank == 1 else 4)
        dist.all_reduce(bad)
    except ValueError as e:
        say(f"mismatched shapes raise ValueError on every rank: {e}")
    y = torch.ones(1)
    dist.all_reduce(y)
    say(f"...and the group still works: all_reduce = {y.item():g}")
    say(
        f"active ranks {pg.get_active_ranks(group).tolist()}, synced {pg.get_num_synced_ranks(group)}"
    )
    dist.destroy_process_group()
    return lines


def demo(world_size: int) -> int:
    """Runs a local group of CPU ranks and shows what the backend does."""
    from mooncake.launch import run_local

    print(f"mooncake demo: {world_size} CPU ranks on this host, backend mooncake-cpu")
    results = run_local(_rank_main, world_size, timeout_s=180)
    for line in results[0]:
        print("  " + line)
    print("demo finished")
    return 0
