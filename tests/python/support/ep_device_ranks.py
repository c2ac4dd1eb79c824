"""Rank-side code of the EP device-path tests (test_ep_device.py).

Every rank shares the one GPU of the test machine. A case runs the device
path on CUDA tensors and the portable path on CPU copies of the same inputs,
through the same Buffer (a ``mooncake-cpu`` group; the workspace on the
GPU), and checks that they agree: the same rows in the same order, BF16/FP16
and FP8 payloads bit for bit, and combine bit for bit (both sum in ascending
expert order in fp32 and round once).

Run alone (``python tests/python/support/ep_device_ranks.py``) it does one small
world-1 round, which is what compute-sanitizer checks.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import zlib
from dataclasses import dataclass

import torch

import capture


def has_device_path() -> bool:
    """Whether this machine has a CUDA GPU and this build the EP device path."""
    if not torch.cuda.is_available():
        return False
    from mooncake.ep import device

    return device.available()


@dataclass(frozen=True)
class Case:
    name: str
    T: int = 128
    H: int = 7168
    experts_per_rank: int = 0  # 0: E = 256
    K: int = 8
    fp8: bool = True
    dtype: torch.dtype = torch.bfloat16
    # plain, hook, async, zero_copy, graph, pool; hook_clobber: a dispatch hook, with x
    # zeroed between the send half and the hook; combine_hook: a plain dispatch, then a
    # combine hook with its x zeroed between the halves (a half must not read x later);
    # async_unwaited: plain calls right after an async_finish one whose event nobody
    # waited on (_check_async_unwaited)
    mode: str = "plain"
    tokens: int = -1  # -1: T on every rank; else this many (rank 0 sends none)
    drop: float = 0.0  # share of selections set to -1
    duplicates: bool = False  # some tokens select one expert twice
    idx32: bool = False
    experts: int = 0  # E whatever the world size (0: experts_per_rank decides)
    one_block: bool = False  # every selection goes to experts one kernel block sends for


CASES = [
    Case("bf16", fp8=False),
    Case("fp8"),
    Case("fp8/hook", mode="hook"),
    Case("bf16/hook", fp8=False, mode="hook"),
    Case("fp8/async", mode="async"),
    Case("bf16/zero_copy", fp8=False, mode="zero_copy"),
    Case("fp8/zero_copy/hook", mode="zero_copy"),
    Case("bf16/hook_clobber", fp8=False, mode="hook_clobber"),
    Case("fp8/hook_clobber", mode="hook_clobber"),
    Case("bf16/combine_hook", fp8=False, mode="combine_hook"),
    Case("fp8/graph", mode="graph"),
    Case("bf16/graph", fp8=False, mode="graph"),
    Case("fp16", fp8=False, dtype=torch.float16),
    Case("fp16/fp8", dtype=torch.float16),
    Case("small/odd", T=13, H=256, experts_per_rank=3, K=3, tokens=11, drop=0.2),
    Case("small/fp8", T=5, H=128, experts_per_rank=1, K=1, fp8=True, drop=0.3),
    Case("duplicates", T=16, H=512, experts_per_rank=16, K=4, duplicates=True),
    Case("idx32", T=64, H=1024, K=4, idx32=True, fp8=False),
    Case("k16", T=32, H=2048, K=16),
    Case("empty-rank0", T=32, H=1024, tokens=7),
    Case("e1024", T=64, H=256, K=16, experts=1024),
    Case("e1024/fp8/one-block", T=256, H=256, K=8, experts=1024, one_block=True),
    Case("pool", fp8=False, mode="pool"),
    Case("fp8/async_unwaited", mode="async_unwaited"),
]


def _experts(case: Case, world: int) -> int:
    if case.experts:
        return case.experts
    return case.experts_per_rank * world if case.experts_per_rank else 256


def _inputs(case: Case, rank: int, world: int, step: int, device, blocks: int = 1):
    """x [N, H], topk_idx [N, K], weights [N, K]: fresh random values per rank and step.
    ``blocks``: the kernels' grid, for ``one_block``."""
    E = _experts(case, world)
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.name}|{rank}|{world}|{step}".encode()))
    n = case.T if case.tokens < 0 else (0 if rank == 0 else case.tokens)
    x = torch.randn(n, case.H, generator=g).to(case.dtype)
    if case.K <= E:
        idx = torch.rand(n, E, generator=g).topk(case.K, dim=1).indices
    else:
        idx = torch.randint(0, E, (n, case.K), generator=g)
    if case.one_block:
        # Experts b, b + G, b + 2G, ... are sent by block b of the grid: with every
        # token selecting K of them, that block holds more rows than it collects
        # at once (N * K > 1536) and stores them in several rounds.
        idx = (rank + step + blocks * torch.arange(case.K)).repeat(n, 1)
        assert int(idx.max()) < E, "one_block needs E >= K * the grid"
    if case.duplicates and n > 1:
        idx[::2, 1] = idx[::2, 0]
    if case.drop:
        idx[torch.rand(n, case.K, generator=g) < case.drop] = -1
    w = torch.rand(n, case.K, generator=g)
    if case.idx32:
        idx = idx.to(torch.int32)
    return x.to(device), idx.to(device), w.to(device)


def _expert_out(recv_x, fp8: bool, dtype) -> torch.Tensor:
    """A stand-in for the experts: a deterministic function of each received row."""
    from mooncake import fp8 as f8

    if fp8:
        data, scales = recv_x
        rows = f8.dequantize(data, scales)
    else:
        rows = recv_x.float()
    scale = torch.arange(1, rows.shape[0] + 1, dtype=torch.float32, device=rows.device) / 4
    return (rows * scale.view(-1, 1, 1)).to(torch.bfloat16 if fp8 else dtype)


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if a.shape != b.shape or not torch.equal(a, b):
        diff = (a.float() - b.float()).abs() if a.shape == b.shape else None
        raise AssertionError(
            f"{what} differs: shapes {list(a.shape)} vs {list(b.shape)}"
            + (
                f", {int((diff != 0).sum())} elements, max {float(diff.max())}"
                if diff is not None
                else ""
            )
        )


def _compare_dispatch(dev, ref, fp8: bool) -> None:
    (rx_d, cnt_d, h_d), (rx_r, cnt_r, h_r) = dev, ref
    _same(cnt_d, cnt_r, "recv_count")
    _same(h_d.layout_range, h_r.layout_range, "layout_range")
    if fp8:  # upstream's layout on both paths: a transposed view, token stride 1
        for name, scales in (("device", rx_d[1]), ("portable", rx_r[1])):
            e, rows, _ = scales.shape
            if scales.stride()[1:] != (1, rows):
                raise AssertionError(f"{name} scales strides {scales.stride()}, token stride not 1")
    for j, c in enumerate(cnt_r.tolist()):
        _same(h_d.src_info[j, :c], h_r.src_info[j, :c], f"src_info[{j}]")
        if fp8:
            _same(rx_d[0][j, :c], rx_r[0][j, :c], f"recv_x data[{j}]")
            _same(rx_d[1][j, :c], rx_r[1][j, :c], f"recv_x scales[{j}]")
        else:
            _same(rx_d[j, :c], rx_r[j, :c], f"recv_x[{j}]")
        if (h_d.src_info[j, c:] != -1).any():
            raise AssertionError(f"src_info[{j}] past recv_count is not -1")


def _dispatch(buf, x, idx, case, E, mode, timeout_us=-1):
    hook = mode in ("hook", "zero_copy", "hook_clobber")
    if mode == "hook_clobber":
        x = x.clone()
    recv_x, cnt, handle, event, recv_hook = buf.dispatch(
        x,
        idx,
        None,
        case.T,
        E,
        timeout_us,
        use_fp8=case.fp8,
        async_finish=mode == "async",
        return_recv_hook=hook,
    )
    if hook:
        if mode == "hook_clobber":
            x.zero_()
        recv_hook()
    event.current_stream_wait()
    return recv_x, cnt, handle


def _combine(buf, y, idx, w, handle, mode, timeout_us=-1):
    if mode == "zero_copy":
        buf.get_next_combine_buffer(handle).copy_(y)
        y = buf.get_next_combine_buffer(handle)
    elif mode == "combine_hook":
        y = y.clone()
    out, event, recv_hook = buf.combine(
        y,
        idx,
        w,
        None,
        timeout_us,
        handle,
        zero_copy=mode == "zero_copy",
        async_finish=mode == "async",
        return_recv_hook=mode in ("hook", "combine_hook"),
    )
    if recv_hook is not None:
        if mode == "combine_hook":
            y.zero_()
        recv_hook()
    event.current_stream_wait()
    return out


def run_case(buf, case: Case, rank: int, world: int) -> None:
    E = _experts(case, world)
    cuda = torch.device("cuda", torch.cuda.current_device())
    steps = 3 if case.mode == "graph" else 2
    graph = None
    if case.mode == "pool":
        _check_pool(buf, case, rank, world, cuda)
    if case.mode == "async_unwaited":
        _check_async_unwaited(buf, case, rank, world, cuda)
        return
    for step in range(steps):
        x, idx, w = _inputs(case, rank, world, step, cuda, buf._device.num_blocks)
        if case.mode == "graph":
            if graph is None:
                static = [x.clone(), idx.clone(), w.clone()]
                # One eager call first: the group's mask reaches the device outside capture.
                _dispatch(buf, static[0], static[1], case, E, "plain")
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with capture.graph(graph):
                    g_rx, g_cnt, g_h = _dispatch(buf, static[0], static[1], case, E, "plain")
                    g_y = _expert_out(g_rx, case.fp8, case.dtype)
                    g_out = _combine(buf, g_y, static[1], static[2], g_h, "plain")
                if buf.path != "device":
                    raise AssertionError(f"the capture ran the {buf.path} path")
            for s, v in zip(static, (x, idx, w), strict=True):
                s.copy_(v)
            graph.replay()
            torch.cuda.synchronize()
            got, y, out = (g_rx, g_cnt, g_h), g_y, g_out
        else:
            got = _dispatch(buf, x, idx, case, E, case.mode)
            torch.cuda.synchronize()
            y = _expert_out(got[0], case.fp8, case.dtype)
            out = _combine(buf, y, idx, w, got[2], case.mode)
            torch.cuda.synchronize()
            if buf.path != "device":
                raise AssertionError(f"the call ran the {buf.path} path, not the device path")
        ref = _dispatch(buf, x.cpu(), idx.cpu(), case, E, "plain")
        _compare_dispatch(got, ref, case.fp8)
        ref_out = _combine(buf, y.cpu(), idx.cpu(), w.cpu(), ref[2], "plain")
        _same(out, ref_out, "combine output")


# Holding a stream back without taking a multiprocessor (a sleep kernel would keep one
# block of an EP grid, which needs every block resident, off its SM until it ends): copies
# from pinned host memory, which the copy engines run, 3 GiB in all (about 0.1 s).
_HOLD_BYTES = 64 << 20
_HOLD_COPIES = 48
_hold: list = []


def _hold_stream(stream) -> None:
    if not _hold:
        _hold.append(torch.empty(_HOLD_BYTES, dtype=torch.uint8, pin_memory=True))
        _hold.append(torch.empty(_HOLD_BYTES, dtype=torch.uint8, device="cuda"))
    host, dev = _hold
    with torch.cuda.stream(stream):
        for _ in range(_HOLD_COPIES):
            dev.copy_(host, non_blocking=True)


def _check_async_unwaited(buf, case: Case, rank: int, world: int, cuda) -> None:
    """Plain calls right after an async_finish call whose event nobody waited on run
    after it on the device (they share the workspace), for dispatch and for combine,
    and every result is the portable path's. The communication stream is held back
    first, so that the caller's stream can finish its plain calls only after the async
    call has ended when they are ordered, and long before it when they are not: an
    async dispatch a, then plain dispatches b and c (c on a's half); an async combine of
    c, then plain combines of b and of c again (on the async one's half)."""
    E = _experts(case, world)
    blocks = buf._device.num_blocks
    a, b, c, w = (_inputs(case, rank, world, step, cuda, blocks) for step in (0, 1, 2, 3))
    comm = buf._device.comm_stream()

    def check_order(event, what: str) -> None:
        torch.cuda.current_stream().synchronize()
        if not event.event.query():
            raise AssertionError(
                f"the plain {what} calls ran before the async_finish one had ended"
            )
        event.current_stream_wait()

    # Each kind of call once first, so that none of the timed ones spends the hold on
    # its first call's checks.
    for af in (False, True):
        rx, _, h, ev, _ = buf.dispatch(
            w[0], w[1], None, case.T, E, -1, use_fp8=case.fp8, async_finish=af
        )
        if af:
            ev.current_stream_wait()
        y = _expert_out(rx, case.fp8, case.dtype)
        _, ev, _ = buf.combine(y, w[1], w[2], None, -1, h, async_finish=af)
        if af:
            ev.current_stream_wait()
    torch.cuda.synchronize()

    _hold_stream(comm)
    rx_a, cnt_a, h_a, event, _ = buf.dispatch(
        a[0], a[1], None, case.T, E, -1, use_fp8=case.fp8, async_finish=True
    )
    got_b = _dispatch(buf, b[0], b[1], case, E, "plain")
    got_c = _dispatch(buf, c[0], c[1], case, E, "plain")
    check_order(event, "dispatch")
    got_a = (rx_a, cnt_a, h_a)
    y_b, y_c = (_expert_out(got[0], case.fp8, case.dtype) for got in (got_b, got_c))
    _hold_stream(comm)
    out_c1, event, _ = buf.combine(y_c, c[1], c[2], None, -1, got_c[2], async_finish=True)
    out_b = _combine(buf, y_b, b[1], b[2], got_b[2], "plain")
    out_c2 = _combine(buf, y_c, c[1], c[2], got_c[2], "plain")
    check_order(event, "combine")
    torch.cuda.synchronize()
    if buf.path != "device":
        raise AssertionError(f"the calls ran the {buf.path} path, not the device path")
    for name, (x, idx, wts), got, combined in (
        ("a", a, got_a, ()),
        ("b", b, got_b, (out_b,)),
        ("c", c, got_c, (out_c1, out_c2)),
    ):
        ref = _dispatch(buf, x.cpu(), idx.cpu(), case, E, "plain")
        _compare_dispatch(got, ref, case.fp8)
        if combined:
            y = _expert_out(got[0], case.fp8, case.dtype)
            ref_out = _combine(buf, y.cpu(), idx.cpu(), wts.cpu(), ref[2], "plain")
            for k, out in enumerate(combined):
                _same(out, ref_out, f"call {name}'s combine output ({k + 1})")


def _check_pool(buf, case: Case, rank: int, world: int, cuda) -> None:
    """A dispatch's outputs are reused by a later one (the pool's hit, not the caching
    allocator's) once nothing refers to them, and never while a view is held."""
    E = _experts(case, world)
    x, idx, _ = _inputs(case, rank, world, 0, cuda)
    stats = buf._device.ext.pool_stats

    def call():
        return _dispatch(buf, x, idx, case, E, "plain")[0]

    a = call()
    b = call()
    if a.data_ptr() == b.data_ptr():
        raise AssertionError("a dispatch reused the outputs of one still held")
    first, view = a.data_ptr(), a[0]
    del a
    c = call()
    if c.data_ptr() == first:
        raise AssertionError("a dispatch reused outputs of which a view is still held")
    freed = {first, c.data_ptr()}
    del view, c
    hits = stats()[0]
    d = call()
    if stats()[0] != hits + 1 or d.data_ptr() not in freed:
        raise AssertionError(
            f"a dispatch did not reuse outputs nothing refers to (pool hits {hits} -> {stats()[0]})"
        )
    del b, d
    torch.cuda.synchronize()


def _setup(rank: int, world: int, port: int, T=128, H=7168, E=256):
    import torch.distributed as dist

    from mooncake.launch import init_rank
    from mooncake.mooncake_ep_buffer import Buffer

    torch.cuda.set_device(0)
    init_rank(rank, world, port)
    hint = Buffer.get_ep_buffer_size_hint(T, H, world, E)
    buf = Buffer(dist.group.WORLD, hint, device="cuda")
    if buf._device is None or not all(buf._device.reachable):
        raise AssertionError(f"rank {rank}: the device path did not map every peer")
    return buf


def rank_cases(
    rank: int, world: int, port: int, names: list[str], unordered: bool = False
) -> dict[str, str | None]:
    """Runs the named cases in order; returns {name: None or the failure's traceback}.
    ``unordered``: the Buffer's order of a plain call after an unwaited async_finish one
    taken out (its _after_comm drops the event), for the negative control of the case
    that checks it."""
    if unordered:
        from mooncake.ep.device import DevicePath

        DevicePath._after_comm = lambda self: setattr(self, "_comm_pending", None)
    buf = _setup(rank, world, port, E=1024)
    out: dict[str, str | None] = {}
    for case in CASES:
        if case.name not in names:
            continue
        try:
            run_case(buf, case, rank, world)
            out[case.name] = None
        except Exception:  # noqa: BLE001  (reported per case)
            out[case.name] = traceback.format_exc()
    if buf.mask_events():
        out["mask_events"] = "unexpected masking: " + "; ".join(buf.mask_events())
    return out


def _check_recv(recv_x, cnt, rank: int, E: int, K: int, xs, live) -> None:
    """recv_x and recv_count against the model: per local expert, the rows of the
    ``live`` sources in rank order, token order within a source (``xs[s]``: source
    s's (x, topk_idx, weights) on the CPU)."""
    epr = E // len(xs)
    for j in range(epr):
        e = rank * epr + j
        rows = [
            xs[s][0][t]
            for s in live
            for t in range(xs[s][1].shape[0])
            for k in range(K)
            if int(xs[s][1][t, k]) == e
        ]
        if int(cnt[j]) != len(rows):
            raise AssertionError(f"expert {j}: {int(cnt[j])} rows, the model says {len(rows)}")
        if rows:
            _same(recv_x[j, : len(rows)], torch.stack(rows), f"recv_x[{j}]")


def _check_combine(out, x, idx, w, epr: int, dead) -> None:
    """combine's output against the model, the experts being y = 0.5 * x: per token,
    its selections whose expert's rank is not in ``dead``, in ascending expert order."""
    want = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for k in sorted(range(idx.shape[1]), key=lambda k: (int(idx[t, k]), k)):
            e = int(idx[t, k])
            if e < 0 or e // epr in dead:
                continue
            acc = acc + (x[t].float() * 0.5).to(torch.bfloat16).float() * w[t, k].float()
        want[t] = acc
    _same(out, want.to(torch.bfloat16), "combine output")


def _model_round(buf, case: Case, rank: int, world: int, step: int, dead, timeout_us) -> dict:
    """One dispatch and combine of everyone's inputs for ``step`` (each rank makes every
    rank's inputs itself), checked against the model with the ranks in ``dead`` silent."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    E, K = _experts(case, world), case.K
    xs = [_inputs(case, s, world, step, "cpu") for s in range(world)]
    x, idx, w = xs[rank]
    active = torch.ones(world, dtype=torch.int32, device=cuda)
    t0 = time.monotonic()
    recv_x, cnt, handle, _, _ = buf.dispatch(
        x.to(cuda), idx.to(cuda), active, case.T, E, timeout_us, use_fp8=False
    )
    torch.cuda.synchronize()
    t_dispatch = time.monotonic() - t0
    if buf.path != "device":
        raise AssertionError(f"the dispatch ran the {buf.path} path")
    _check_recv(recv_x, cnt, rank, E, K, xs, [s for s in range(world) if s not in dead])
    y = (recv_x.float() * 0.5).to(torch.bfloat16)
    t0 = time.monotonic()
    out, _, _ = buf.combine(y, idx.to(cuda), w.to(cuda), active, timeout_us, handle)
    torch.cuda.synchronize()
    t_combine = time.monotonic() - t0
    _check_combine(out, x, idx, w, E // world, dead)
    return {
        "active": active.cpu().tolist(),
        "dispatch_s": t_dispatch,
        "combine_s": t_combine,
        "seq": buf._seq,
    }


def _small(rank: int, world: int, port: int, name: str):
    """A Buffer over the group for T=32, H=1024, 8 experts per rank, top-4, and every
    rank's inputs on the CPU: (buf, xs, T, E, K)."""
    T, H, E, K = 32, 1024, 8 * world, 4
    buf = _setup(rank, world, port, T, H, E)
    case = Case(name, T=T, H=H, experts_per_rank=8, K=K, fp8=False)
    return buf, [_inputs(case, s, world, 0, "cpu") for s in range(world)], T, E, K


def rank_exit(rank: int, world: int, port: int, when: str, victim: int, timeout_us: int) -> dict:
    """``victim`` exits before the dispatch (``when="dispatch"``) or between dispatch
    and combine (``"combine"``); the others must finish with exactly the victim masked
    and every other row exact."""
    buf, xs, T, E, K = _small(rank, world, port, "exit")
    cuda = torch.device("cuda", 0)
    x, idx, w = xs[rank]
    if rank == victim and when == "dispatch":
        os._exit(0)
    active = torch.ones(world, dtype=torch.int32, device=cuda)
    t0 = time.monotonic()
    recv_x, cnt, handle, _, _ = buf.dispatch(
        x.to(cuda), idx.to(cuda), active, T, E, timeout_us, use_fp8=False
    )
    torch.cuda.synchronize()
    t_dispatch = time.monotonic() - t0
    if rank == victim:
        os._exit(0)
    live = [s for s in range(world) if not (s == victim and when == "dispatch")]
    _check_recv(recv_x, cnt, rank, E, K, xs, live)
    y = (recv_x.float() * 0.5).to(torch.bfloat16)
    t0 = time.monotonic()
    out, _, _ = buf.combine(y, idx.to(cuda), w.to(cuda), active, timeout_us, handle)
    torch.cuda.synchronize()
    t_combine = time.monotonic() - t0
    _check_combine(out, x, idx, w, E // world, {victim})
    return {
        "active": active.cpu().tolist(),
        "dispatch_s": t_dispatch,
        "combine_s": t_combine,
        "events": buf.mask_events(),
    }


def rank_rejected(rank: int, world: int, port: int) -> dict:
    """Rank 1's dispatch is rejected (float32 x) while rank 0's runs and masks it at a
    short deadline; then full rounds over the group's view (``active_ranks=None``) must
    be exact at full strength on both: the rejected rank's call number stays in step
    with rank 0's, and rank 0 takes rank 1 in again (a kernel's mask of a live rank
    holds for its call only)."""
    buf, xs, T, E, K = _small(rank, world, port, "rejected")
    cuda = torch.device("cuda", 0)
    x, idx, w = xs[rank]
    short = 300_000  # µs: rank 0 masks rank 1 after this
    if rank == 1:
        try:
            buf.dispatch(x.float().to(cuda), idx.to(cuda), None, T, E, short, use_fp8=False)
        except ValueError:
            pass
        else:
            raise AssertionError("a float32 x was not rejected on the device path")
    else:
        recv_x, _, handle, _, _ = buf.dispatch(
            x.to(cuda), idx.to(cuda), None, T, E, short, use_fp8=False
        )
        y = (recv_x.float() * 0.5).to(torch.bfloat16)
        buf.combine(y, idx.to(cuda), w.to(cuda), None, short, handle)
        torch.cuda.synchronize()
    seqs = []
    for _ in range(2):
        recv_x, cnt, handle, _, _ = buf.dispatch(
            x.to(cuda), idx.to(cuda), None, T, E, 60_000_000, use_fp8=False
        )
        torch.cuda.synchronize()
        _check_recv(recv_x, cnt, rank, E, K, xs, range(world))
        y = (recv_x.float() * 0.5).to(torch.bfloat16)
        out, _, _ = buf.combine(y, idx.to(cuda), w.to(cuda), None, 60_000_000, handle)
        torch.cuda.synchronize()
        _check_combine(out, x, idx, w, E // world, set())
        seqs.append(buf._seq)
    return {"seqs": seqs, "events": buf.mask_events()}


REPLACE = Case("replace", T=32, H=1024, experts_per_rank=8, K=4, fp8=False)


class _Replacing:
    """A process of a replacement test: its group, store and Buffer (sized for
    REPLACE), a member's or (``role="joiner"``) the replacement's, which joins the
    running group; ``out["rounds"]``: its rounds' records."""

    def __init__(self, rank: int, world: int, port: int, role: str, timeout_us: int, **init):
        import torch.distributed as dist

        from mooncake import pg
        from mooncake.launch import init_rank
        from mooncake.mooncake_ep_buffer import Buffer

        torch.cuda.set_device(0)
        self.rank, self.world, self.timeout_us = rank, world, timeout_us
        self.joiner = role == "joiner"
        hint = Buffer.get_ep_buffer_size_hint(REPLACE.T, REPLACE.H, world, _experts(REPLACE, world))
        init_rank(rank, world, port, max_world_size=world, is_extension=self.joiner,
                  timeout_s=20.0, **init)  # fmt: skip
        self.W = dist.group.WORLD
        self.store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        if self.joiner:
            pg.join_group(self.W)
        self.buf = Buffer(self.W, hint, device="cuda")
        self.out: dict = {"rounds": []}

    def round(self, step: int, dead=()) -> None:
        self.out["rounds"].append(
            _model_round(self.buf, REPLACE, self.rank, self.world, step, set(dead), self.timeout_us)
        )

    def full_strength(self, victim: int, steps) -> None:
        """A member admits ``victim``'s replacement (update_ep_member); then, every rank
        mapped, rounds ``steps`` at full strength."""
        import torch.distributed as dist

        buf = self.buf
        if not self.joiner:
            from ft_ranks import admit

            admit(self.W, [victim])
            buf.update_ep_member()
        if not all(buf._device.reachable):
            raise AssertionError(
                f"rank {self.rank}: not every peer is mapped: {buf._device.reachable}"
            )
        dist.barrier(self.W)  # the group at full strength (the first call's deadline is short)
        for step in steps:
            self.round(step)


def rank_replace(rank: int, world: int, port: int, backend: str, victim: int, role: str) -> dict:
    """A round with everyone; ``victim`` exits; a round among the survivors (it is
    masked at the deadline); a replacement joins (``role="joiner"``: pg.join_group and
    a new Buffer, while the survivors call recover_ranks and update_ep_member); then
    rounds at full strength on the device path, the replacement's first included."""
    p = _Replacing(rank, world, port, role, 1_500_000, backend=backend)
    if not p.joiner:
        p.round(0)
        if rank == victim:
            p.store.set("dying", "1")
            os._exit(0)
        while not p.store.check(["dead"]):
            time.sleep(0.005)
        p.round(1, dead={victim})
    p.full_strength(victim, (2, 3))
    p.out["events"] = p.buf.mask_events()
    return p.out


def late_launch(buf, T: int, H: int, K: int, E: int, R: int) -> dict:
    """A dispatch of ``buf``'s device path launched straight through the extension, past
    the host's checks, as a kernel of this process queued before it stopped would run:
    selections to every rank's experts, every rank marked active, a 0.5 s deadline,
    the next call number. A fenced process's kernel stores into nobody and reports it;
    the next call raises LeftOutError. Returns what it saw."""
    from mooncake import LeftOutError, pg

    dev = buf._device
    cuda = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(T, H, dtype=torch.bfloat16, device=cuda)
    idx = (torch.arange(T * K, device=cuda) % E).reshape(T, K)
    active = torch.ones(R, dtype=torch.int32, device=cuda)
    dev.ext.dispatch(
        x, idx, active, None, None, None, T, E, R, buf._seq + 1, 500_000_000, False,
        pg._ext.EP_PHASE_BOTH, dev.num_blocks,
    )  # fmt: skip
    torch.cuda.synchronize()
    out = {"status": dev.ext.status_code(), "active": active.cpu().tolist()}
    try:
        dev.raise_reported("late launch")
        out["next"] = "returned normally"
    except LeftOutError as e:
        out["next"] = "LeftOutError" if e.ranks == [buf.rank] else f"LeftOutError {e.ranks}"
    out["fenced"] = out["status"] == pg._ext.EP_STATUS_LEFT_OUT and dev.ext.left_out
    return out


def rank_stop(rank: int, world: int, port: int, victim: int, role: str) -> dict:
    """A round with everyone; ``victim`` stops itself (SIGSTOP); the survivors' next
    round masks it once its heartbeat stood still past MOONCAKE_HANG_MS, far inside
    timeout_us; the group leaves it out and admits a replacement (``role="joiner"``),
    while the survivors call update_ep_member (the members move to a new fence key and
    fence the stopped process's workspace); full rounds. Then the parent resumes the
    stopped process: its next dispatch must raise LeftOutError, and a late launch of
    its (:func:`late_launch`) must store nothing; after that, full rounds among the
    survivors and the replacement are exact."""
    import signal

    from mooncake import LeftOutError

    # The stopped rank must be masked for its heartbeat, not timeout_us.
    p = _Replacing(rank, world, port, role, 20_000_000)
    T, H, E = REPLACE.T, REPLACE.H, _experts(REPLACE, world)
    if not p.joiner:
        p.round(0)
        if rank == victim:
            p.store.set("stopping", "1")
            os.kill(os.getpid(), signal.SIGSTOP)
            # Resumed, after the replacement joined.
            x, idx, _ = _inputs(REPLACE, rank, world, 9, torch.device("cuda", 0))
            try:
                p.buf.dispatch(x, idx, None, T, E, p.timeout_us, use_fp8=False)
                p.out["told"] = "returned normally"
            except LeftOutError as e:
                ok = e.ranks == [rank] and "left out" in str(e)
                p.out["told"] = "LeftOutError" if ok else f"LeftOutError {e.ranks}: {e}"
            p.out["late"] = late_launch(p.buf, T, H, REPLACE.K, E, world)
            p.store.set("resumed_done", "1")
            return p.out
        while not p.store.check(["stopping"]):
            time.sleep(0.005)
        time.sleep(0.2)  # it is stopped now
        p.round(1, dead={victim})
    p.full_strength(victim, (2, 3))
    p.store.set(f"joined/{rank}", "1")
    while not p.store.check(["resumed_done"]):  # the stopped rank's late calls
        time.sleep(0.005)
    for step in (4, 5):
        p.round(step)
    p.out["events"] = p.buf.mask_events()
    return p.out


def main() -> int:
    """One small world-1 round on its own (for compute-sanitizer)."""
    import torch.distributed as dist

    store = dist.HashStore()
    from mooncake import pg  # noqa: F401  (registers the backends)

    active = torch.ones(1, dtype=torch.int32)
    dist.init_process_group(
        "mooncake-cpu",
        store=store,
        rank=0,
        world_size=1,
        pg_options=pg.MooncakeBackendOptions(active),
    )
    from mooncake.mooncake_ep_buffer import Buffer

    torch.cuda.set_device(0)
    buf = Buffer(dist.group.WORLD, Buffer.get_ep_buffer_size_hint(16, 512, 1, 16), device="cuda")
    for case in (
        Case("s", T=16, H=512, experts_per_rank=16, K=4, fp8=f, mode=m)
        for f in (False, True)
        for m in ("plain", "hook")
    ):
        run_case(buf, case, 0, 1)
    print("ep_device_ranks: ok")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
