"""The elastic EP buffer's lifecycle: grow 2 -> 4 ranks, lose one, replace it.

Four processes (slots 0-3) meet through a TCPStore hosted here; slots 2 and 3
join after a few rounds, slot 3 is killed and a new process takes its slot.
Every round is dispatch -> "experts" (expert e multiplies by e + 1) -> combine,
and each rank checks its result against the same computation done locally
over the slots that were active.

    .venv/bin/python examples/elastic_ep.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

CAPACITY, EPR, T, H, K = 4, 2, 8, 256, 2


def sync(store, name: str, n: int) -> None:
    if store.add(f"sync/{name}", 1) == n:
        store.set(f"sync/{name}/done", "1")
    store.wait([f"sync/{name}/done"], timedelta(seconds=120))


def run_round(buf, step: int, device: str) -> tuple[list[int], float]:
    """One checked round; returns the active slots and the largest relative error."""
    import torch

    R = buf.rank_bound
    g = torch.Generator().manual_seed(1000 * step + buf.rank)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    idx = torch.randint(0, EPR * R, (T, K), generator=g).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    # Upstream's elastic form: the buffer's mask and its timeout_ms (5 s) serve.
    recv_x, count, handle, _, _ = buf.dispatch(x, idx, T, EPR * R, use_fp8=False)
    scale = torch.arange(EPR, device=device) + buf.rank * EPR + 1  # global expert id + 1
    y = (recv_x.float() * scale.view(-1, 1, 1)).to(torch.bfloat16)
    out, _, _ = buf.combine(y, idx, w, handle)
    active = buf.active_slots  # after the call: a slot that died in it is masked
    on_active = torch.isin(idx // EPR, torch.tensor(active, device=device))
    coef = (idx + 1) * w * on_active
    ref = coef.sum(1, keepdim=True) * x.float()
    # Each element against its own bound: the experts' bf16 outputs and combine's one
    # rounding of the fp32 sum each lose at most 2**-8 relative (bf16 keeps 8 bits).
    bound = (coef.abs().sum(1, keepdim=True) * x.float().abs() + ref.abs()) * 2**-8 + 1e-6
    excess = ((out.float() - ref).abs() - bound).max().item()
    assert excess <= 0, f"rank {buf.rank}: an element is {excess} past its bound"
    err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    if device == "cuda":  # a workspace on every slot: the kernels must have served it
        assert buf.path == "device", f"rank {buf.rank}: the {buf.path} path ran"
    return active, err


def rank_main(slot: int, port: int, device: str, role: str) -> None:
    import torch.distributed as dist

    from mooncake.mooncake_ep_buffer import Buffer

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    buf = Buffer.create_elastic(
        rank=slot, tcp_store_group=store, timeout_ms=5000, metadata_timeout_ms=60000
    )
    # With CUDA tensors, a workspace makes the calls run the device path's kernels over
    # the peers' mapped workspaces (without one they are staged through host memory).
    hint = Buffer.get_ep_buffer_size_hint(T, H, CAPACITY, EPR * CAPACITY)
    buf.update_memory_buffers(
        num_ranks=CAPACITY, num_experts_per_rank=EPR, num_rdma_bytes=hint if device == "cuda" else 0
    )

    def join(peers):
        buf.connect_ranks(peers, activate=False)  # staged
        for p in peers:
            buf.update_mask_buffer(p, mask=False)  # published

    def say(text: str) -> None:
        print(f"[slot {slot}{' (replacement)' if role == 'new' else ''}] {text}", flush=True)

    step = 0
    if role == "new":  # the replacement for slot 3
        join([0, 1, 2])
        sync(store, "replaced", 3 + 1)
    else:
        join([p for p in (0, 1) if p != slot] if slot < 2 else [p for p in range(4) if p != slot])
        if slot < 2:
            for step in range(2):
                active, err = run_round(buf, step, device)
            say(f"2 ranks: active {active}, max relative error {err:.1e}")
            join([2, 3])  # growth 2 -> 4
        sync(store, "grown", 4)
        for step in range(2, 4):
            active, err = run_round(buf, step, device)
        say(f"4 ranks: active {active}, max relative error {err:.1e} ({buf.path} path)")
        sync(store, "kill", 4)
        if slot == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        active, _ = run_round(buf, 4, device)
        say(
            f"slot 3 killed: masked after {1e3 * (time.perf_counter() - t0):.1f} ms, active {active}"
        )
        buf.disconnect_ranks([3])
        if slot == 0:
            store.set("spawn", "1")
        join([3])  # waits for the replacement process
        sync(store, "replaced", 3 + 1)
    for step in range(5, 7):
        active, err = run_round(buf, step, device)
    say(f"after replacement: active {active}, max relative error {err:.1e}")
    store.set(f"done/{slot}", json.dumps({"active": active}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (the device path's kernels)")
    args = p.parse_args()
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and not torch.cuda.is_available():
        print("elastic EP example: FAILED (--device cuda: no CUDA GPU visible to torch)")
        return 1

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "python"))

    def spawn(slot: int, role: str):
        cmd = [sys.executable, __file__, "--rank", str(slot), str(port), args.device, role]
        return subprocess.Popen(cmd, env=env)

    procs = [spawn(s, "first") for s in range(CAPACITY)]
    deadline = time.time() + 180
    try:
        # A slot that fails (not the one killed on purpose) ends the run at once,
        # rather than leaving the others to wait out their deadlines.
        while time.time() < deadline:
            codes = [q.poll() for q in procs]
            if None not in codes or any(c not in (None, 0, -signal.SIGKILL) for c in codes):
                break
            if len(procs) == CAPACITY and store.check(["spawn"]):
                procs.append(spawn(3, "new"))
            time.sleep(0.05)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    codes = [q.returncode for q in procs]
    ok = codes == [0, 0, 0, -signal.SIGKILL, 0]
    print("elastic EP example:", "ok" if ok else f"FAILED (exit codes {codes})")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        sys.exit(main())
