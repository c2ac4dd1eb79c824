"""The demo behind ``make demo``: a local group of CPU ranks, what the
mooncake-cpu backend does with it, expert-parallel dispatch/combine, a rank
killed, the survivors going on (in collectives and in EP) and a replacement
joining."""

from __future__ import annotations

import signal
import time

VICTIM = 2  # the rank the demo kills (rank 0 reports, so it is not this one)


def _collectives(rank: int, world_size: int, say) -> None:
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    say(f"all_reduce(SUM) of rank+1 over {world_size} ranks = {x.item():g}")
    big = torch.full((1 << 20,), 1.0, dtype=torch.bfloat16)
    dist.all_reduce(big, op=dist.ReduceOp.AVG)
    say(f"all_reduce(AVG) of 1M bf16 ones = {big[0].item():g} (reduce-scatter + all-gather)")
    out = [torch.empty(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([rank, rank * rank]))
    say(f"all_gather = {[t.tolist() for t in out]}")
    splits = [r + 1 for r in range(world_size)]
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


def _ep_round(buffer, rank: int, world_size: int, active) -> int:
    """One EP dispatch/combine with identity experts, two per rank: every token picks
    one expert on each rank with weight 1, so the combined token is its input times
    the number of experts that answered. Returns that number."""
    import torch

    tokens, hidden = 4, 128
    x = torch.full((tokens, hidden), float(rank + 1), dtype=torch.bfloat16)
    idx = torch.tensor([[2 * r + t % 2 for r in range(world_size)] for t in range(tokens)])
    weights = torch.ones(tokens, world_size)
    recv_x, _, handle, _, _ = buffer.dispatch(
        x, idx, active, tokens, 2 * world_size, timeout_us=5_000_000, use_fp8=False
    )
    y, _, _ = buffer.combine(recv_x, idx, weights, active, 5_000_000, handle)
    return round(y[0, 0].item() / (rank + 1))


def _ranks_in(total: int) -> list[int]:
    """The ranks whose 1 << rank make up ``total``."""
    return [r for r in range(total.bit_length()) if total >> r & 1]


def _member(rank: int, world_size: int, port: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from mooncake import pg
    from mooncake.launch import init_rank
    from mooncake.mooncake_ep_buffer import Buffer

    lines: list[str] = []

    def say(text: str) -> None:
        if rank == 0:
            lines.append(text)

    active = init_rank(rank, world_size, port, timeout_s=30)
    group = dist.group.WORLD
    # The launcher's store, unprefixed (the process group's own keys live under a prefix).
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    _collectives(rank, world_size, say)
    buffer = Buffer(group)
    ep_active = torch.ones(world_size, dtype=torch.int32)
    n = _ep_round(buffer, rank, world_size, ep_active)
    say(f"EP dispatch/combine: each token went to {n} experts, one per rank, and came back summed")

    say(f"--- rank {VICTIM} is killed (SIGKILL) while the others are inside an all_reduce ---")
    if rank == VICTIM:
        store.set("demo/victim_ready", "1")
        time.sleep(3600)  # the launcher kills this process here
    x = torch.tensor([1 << rank], dtype=torch.int64)
    dist.all_reduce(x)  # blocks on the victim until it dies, then re-runs among the survivors
    done = time.time()
    killed_at = float(store.get("demo/killed_at").decode())
    say(
        f"all_reduce of 1 << rank covered ranks {_ranks_in(x.item())}, returned "
        f"{(done - killed_at) * 1e3:.0f} ms after the kill"
    )
    say(f"active_ranks = {active.tolist()}, synced ranks = {pg.get_num_synced_ranks(group)}")
    y = torch.ones(4)
    dist.all_reduce(y)
    say(f"the survivors go on: all_reduce of ones = {y.tolist()}")
    n = _ep_round(buffer, rank, world_size, ep_active)
    say(
        f"EP after the kill: ep active_ranks = {ep_active.tolist()}, tokens came back from {n} experts"
    )

    say(f"--- a new process starts as rank {VICTIM} and joins ---")
    deadline = time.monotonic() + 120
    while not pg.get_peer_state(group, [VICTIM])[0]:
        if time.monotonic() > deadline:
            raise TimeoutError("the replacement never showed up")
        time.sleep(0.01)
    pg.recover_ranks(group, [VICTIM])
    z = torch.tensor([1 << rank], dtype=torch.int64)
    dist.all_reduce(z)
    say(f"recover_ranks([{VICTIM}]): active_ranks = {active.tolist()}")
    say(f"full strength again: all_reduce covered ranks {_ranks_in(z.item())}")
    buffer.update_ep_member()  # with the replacement, which builds its Buffer meanwhile
    ep_active.fill_(1)
    n = _ep_round(buffer, rank, world_size, ep_active)
    say(f"EP at full strength again: tokens came back from {n} experts")
    dist.destroy_process_group()
    return lines


def _replacement(rank: int, world_size: int, port: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from mooncake import pg
    from mooncake.launch import init_rank
    from mooncake.mooncake_ep_buffer import Buffer

    init_rank(rank, world_size, port, is_extension=True, timeout_s=120)
    pg.join_group()
    z = torch.tensor([1 << rank], dtype=torch.int64)
    dist.all_reduce(z)
    buffer = Buffer(dist.group.WORLD)
    n = _ep_round(buffer, rank, world_size, torch.ones(world_size, dtype=torch.int32))
    dist.destroy_process_group()
    return [
        f"replacement rank {rank} joined; its all_reduce covered {_ranks_in(z.item())}, "
        f"its EP tokens came back from {n} experts"
    ]


def demo(world_size: int) -> int:
    """Runs a local group of CPU ranks: collectives, a rank killed, a replacement joining."""
    from mooncake.launch import LocalGroup

    if world_size <= VICTIM:
        raise ValueError(f"demo: world_size must be > {VICTIM}, got {world_size}")
    print(f"mooncake demo: {world_size} CPU ranks on this host, backend mooncake-cpu")
    with LocalGroup(world_size) as group:
        group.start(_member)
        group.store.wait(["demo/victim_ready"])
        time.sleep(0.2)  # let the others enter their all_reduce
        group.store.set("demo/killed_at", repr(time.time()))
        group.kill(VICTIM, signal.SIGKILL)
        group.start(_replacement, ranks=[VICTIM])
        results = group.results(timeout_s=240)
    for line in results["0"]:
        print("  " + line)
    print("  " + results[f"{VICTIM}.1"][0])
    print("demo finished")
    return 0
