"""EP driven the way serving engines drive upstream Mooncake's ``Buffer`` (their
Mooncake dispatchers, unchanged in spirit): one process-wide Buffer made from the
engine's own EP group and sized by the hint; FP8 dispatch finished either with
``async_finish=True`` and ``event.current_stream_wait()`` or with
``return_recv_hook=True`` and ``hook()``; ``expected_m`` computed from
``buffer.group_size``; the FP8 data and scales handed as they are to a grouped-GEMM
stand-in that insists on upstream's scale layout (token stride 1); ``timeout_us=-1``
on the first call and 10 s after; the engine's own ``active_ranks`` tensor passed
to every call; the handle kept as a plain tuple between dispatch and combine.

Every rank builds every rank's inputs from seeds, so each checks its combine against
a model over the ranks still alive. ``rank_engine`` runs, in one launch, the steps
over a foreign group (gloo; NCCL on a GPU at world 1), then over the mooncake group,
and last a rank killed between two steps (world >= 2).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from mooncake import fp8

T, H, K, EXPERTS_PER_RANK = 16, 256, 4, 4
FIRST_TIMEOUT_US, TIMEOUT_US = -1, 10_000_000


def inputs(rank: int, world: int, step: int):
    """Rank ``rank``'s tokens, top-k experts (-1 for some) and weights at ``step``."""
    g = torch.Generator().manual_seed(1_000 * step + rank)
    n = T - (rank + step) % 5
    x = (torch.randn(n, H, generator=g) * 2).to(torch.bfloat16)
    E = EXPERTS_PER_RANK * world
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).long()
    idx[torch.rand(n, K, generator=g) < 0.1] = -1
    w = torch.rand(n, K, generator=g)
    return x, idx, w


def expert_value(expert: int) -> float:
    """The stand-in expert multiplies its tokens by this."""
    return 0.5 + 0.25 * (expert % 4)


def grouped_gemm(recv_x, recv_count, expected_m: int, world: int, rank: int) -> torch.Tensor:
    """A masked FP8 grouped GEMM stand-in: takes (data, scales) as dispatched and
    refuses scales in any layout but upstream's (``[E/R, R*T, H/128]`` with token
    stride 1, which such kernels read by TMA), as the kernels engines use do."""
    data, scales = recv_x
    epr, rows, h = data.shape
    want_shape = (epr, world * T, H // fp8.BLOCK)
    if tuple(scales.shape) != want_shape:
        raise AssertionError(f"scales shape {tuple(scales.shape)}, want {want_shape}")
    if scales.stride() != (H // fp8.BLOCK * world * T, 1, world * T):
        raise AssertionError(f"scales strides {scales.stride()}: not upstream's token stride 1")
    if data.dtype != torch.float8_e4m3fn or not data.is_contiguous():
        raise AssertionError(f"recv_x data {data.dtype}, contiguous {data.is_contiguous()}")
    if expected_m < 1:  # a hint for the kernel's tiling, from group_size
        raise AssertionError(f"expected_m {expected_m}")
    out = torch.zeros(epr, rows, h, dtype=torch.bfloat16, device=data.device)
    for j in range(epr):
        n = int(recv_count[j])
        vals = fp8.dequantize(data[j, :n], scales[j, :n])
        out[j, :n] = (vals * expert_value(rank * epr + j)).to(torch.bfloat16)
    return out


def model(x, idx, w, live: set[int], world: int) -> torch.Tensor:
    """What combine returns for this rank's tokens: the weighted stand-in outputs of
    the experts on live ranks, from the FP8 round trip of the tokens."""
    data, scales = fp8.quantize(x)
    vals = fp8.dequantize(data, scales).to(torch.bfloat16).float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(idx[t, k])
            if e >= 0 and e // EXPERTS_PER_RANK in live:
                y = (vals[t] * expert_value(e)).to(torch.bfloat16).float()
                out[t] += float(w[t, k]) * y
    return out


def step(buffer, active, rank: int, world: int, n: int, live: set[int], device) -> dict:
    """One engine step: dispatch, the expert stand-in, combine; checked against the model."""
    x, idx, w = inputs(rank, world, n)
    x, idx, w = x.to(device), idx.to(device), w.to(device)
    E = EXPERTS_PER_RANK * world
    timeout_us = FIRST_TIMEOUT_US if n == 0 else TIMEOUT_US
    hook_mode = n % 2 == 1
    t0 = time.monotonic()
    recv_x, recv_count, handle, event, hook = buffer.dispatch(
        x, idx, active, T, E, timeout_us, True, not hook_mode, hook_mode
    )
    if hook_mode:
        hook()
    else:
        event.current_stream_wait()
    handle = tuple(handle)  # engines keep upstream's plain tuple
    expected_m = (x.shape[0] * buffer.group_size * K + E) // E
    out = grouped_gemm(recv_x, recv_count, expected_m, world, rank)
    combined, event, hook = buffer.combine(
        out, idx, w, active, timeout_us, handle, async_finish=not hook_mode,
        return_recv_hook=hook_mode,
    )  # fmt: skip
    if hook_mode:
        hook()
    else:
        event.current_stream_wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    want = model(*inputs(rank, world, n), live, world)
    got = combined.float().cpu()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    bound = 2e-2 * max(want.abs().max().item(), 1.0)
    if got.shape != want.shape or err > bound:
        raise AssertionError(f"step {n}: combine off by {err} (bound {bound}), live {live}")
    return {"step": n, "path": buffer.path, "active": active.cpu().tolist(), "s": seconds}


def _run(buffer, rank: int, world: int, steps: range, live: set[int], device) -> list[dict]:
    active = torch.ones(world, dtype=torch.int32, device=device)
    return [step(buffer, active, rank, world, n, live, device) for n in steps]


def rank_engine(rank: int, world: int, port: int, device_kind: str, victim: int | None) -> dict:
    import warnings

    from mooncake.launch import init_rank
    from mooncake.mooncake_ep_buffer import Buffer

    cuda = device_kind == "cuda"
    init_rank(rank, world, port, "mooncake" if cuda else "mooncake-cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    hint = Buffer.get_ep_buffer_size_hint(T, H, world, EXPERTS_PER_RANK * world)
    everyone = set(range(world))
    out: dict = {}

    # The engine's own EP group without a mooncake backend: NCCL where it can run (one
    # rank per GPU), gloo otherwise.
    foreign = "nccl" if cuda and world <= torch.cuda.device_count() else "gloo"
    group = dist.new_group(backend=foreign)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no mooncake backend": known here
        buffer = Buffer(group, hint)
    out["foreign"] = {
        "backend": foreign,
        "steps": _run(buffer, rank, world, range(4), everyone, device),
    }
    del buffer

    buffer = Buffer(dist.group.WORLD, hint)
    active = torch.ones(world, dtype=torch.int32, device=device)
    out["mooncake"] = [step(buffer, active, rank, world, n, everyone, device) for n in range(4)]
    if victim is not None:
        if rank == victim:
            os._exit(0)  # between two steps, no teardown
        live = everyone - {victim}
        out["after_kill"] = [
            step(buffer, active, rank, world, n, live, device) for n in range(4, 6)
        ]
        out["events"] = buffer.mask_events()
    return out
