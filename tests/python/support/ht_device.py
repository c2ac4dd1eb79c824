"""Rank-side code of the ElasticBuffer device-path tests (``test_elastic_buffer_device.py``).

Every rank shares the one GPU of the test machine (``cuda:0``); the group is
``mooncake-cpu``, so the same buffer runs the portable path on CPU tensors and the device
path on CUDA ones. A round here is ``ht_round.HRound`` on CUDA tensors
(:class:`DeviceRound`): inputs are built on the CPU from seeds (every rank builds every
rank's), moved to the GPU with their strides and offsets, and the outputs come back to the
CPU to be checked against ``ht_model`` bit for bit; then the same round runs on the
portable path (CPU tensors, same buffer) and the two must agree bit for bit as well.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import ht_cases
import ht_fault
from ep_cases import Checks
from ht_round import HRound, HSpec, fit, make_inputs
from launcher import Case

#: The buffer's sizing (the device path's rings are made for the larger of it and the
#: first call): wide enough for every round below.
MAKE = {"hidden": 7168, "num_topk": 32, "num_cpu_timeout_secs": 60, "num_gpu_timeout_secs": 60}


def has_device_path() -> bool:
    """Whether this machine has a CUDA GPU and this build the ElasticBuffer device path."""
    if not torch.cuda.is_available():
        return False
    from mooncake.ep import throughput_device

    return throughput_device.available()


def cuda() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def to_device(t, device):
    """``t`` (a tensor, a pair of them, or None) on ``device`` with the same sizes, strides
    and storage offset: strided and misaligned inputs stay so."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(to_device(u, device) for u in t)
    if t.is_contiguous() and t.storage_offset() == 0:
        return t.to(device)
    n = t.untyped_storage().nbytes() // t.element_size()
    view = torch.zeros(n, dtype=t.dtype, device=device).as_strided(
        t.size(), t.stride(), t.storage_offset()
    )
    view.copy_(t)
    return view


def to_cpu(t):
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(u.cpu() for u in t)
    return t.cpu()


class CpuHandle:
    """An EPHandle's fields on the CPU, for the checks; ``real`` is the handle."""

    def __init__(self, handle):
        self.real = handle

    def __getattr__(self, name):
        v = getattr(self.real, name)
        return v.cpu() if isinstance(v, torch.Tensor) else v


def device_ok(spec: HSpec) -> bool:
    """Whether a round of ``spec`` runs on the device path: rows the kernels copy in
    16-byte pieces (the others run on the portable path, the same results)."""
    item = 1 if spec.fp8 else spec.dtype.itemsize
    return (spec.H * item) % 16 == 0 and spec.H % 8 == 0


class DeviceRound(HRound):
    """``HRound`` on CUDA tensors (see the module docstring); ``path``: the path every
    call must run on."""

    def __init__(self, ctx, buf, spec: HSpec, tag: str = "", may_drop=(), path: str = "device"):
        super().__init__(ctx, buf, spec, tag, may_drop)
        self.device = cuda()
        self.want_path = path

    def _on_path(self, what: str) -> None:
        self.ctx.expect(
            self.buf.path == self.want_path,
            f"{what}: ran on the {self.buf.path} path, not the {self.want_path} path",
        )
        want = "cuda_ipc" if self.want_path == "device" else "pg"
        self.ctx.expect(self.buf.transport == want, f"{what}: transport {self.buf.transport!r}")

    def dispatch(self, handle=None, ins=None):
        spec, dev = self.spec, self.device
        ins = ins or self.ins
        mine = ins[self.me]
        x, w = to_device(mine.x_in, dev), to_device(mine.w, dev)
        t0 = time.monotonic()
        if handle is None:
            out = self.buf.dispatch(
                x, to_device(mine.idx, dev), w, num_experts=self.E,
                num_max_tokens_per_rank=spec.T, expert_alignment=spec.align,
                do_expand=spec.expand, do_cpu_sync=spec.sync,
            )  # fmt: skip
        else:
            out = self.buf.dispatch(x, topk_weights=w, handle=handle.real)
        torch.cuda.synchronize()
        self.dispatch_s = time.monotonic() - t0
        recv, recv_idx, recv_w, h, event = out
        self._on_path(f"{self.what}: dispatch")
        self.ctx.expect(
            handle is None or h is handle.real, "a cached dispatch returned another handle"
        )
        self.recv, self.recv_idx, self.recv_w = to_cpu(recv), recv_idx.cpu(), to_cpu(recv_w)
        self.handle = CpuHandle(h)
        event.current_stream_wait()
        self._after(f"{self.what}: dispatch")
        return out

    def combine(self):
        y, cw = self.expert_outputs()
        t0 = time.monotonic()
        combined, combined_w, event = self.buf.combine(
            y.to(self.device), self.handle.real, topk_weights=to_device(cw, self.device)
        )
        torch.cuda.synchronize()
        self.combine_s = time.monotonic() - t0
        self._on_path(f"{self.what}: combine")
        self.combined, self.combined_w = combined.cpu(), to_cpu(combined_w)
        event.current_stream_wait()
        self._after(f"{self.what}: combine")


def _same(ctx, a, b, what: str) -> None:
    if isinstance(a, tuple) or isinstance(b, tuple):
        ok = isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
        ctx.expect(ok, f"{what}: one path gave a pair, the other not")
        if ok:
            for i, (u, v) in enumerate(zip(a, b, strict=True)):
                _same(ctx, u, v, f"{what}[{i}]")
        return
    if a is None or b is None:
        ctx.expect(a is None and b is None, f"{what}: None on one path only")
        return
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    ctx.expect_equal(a, b, what)


def against_portable(ctx, buf, spec: HSpec, tag: str) -> None:
    """A device round of ``spec`` (checked against the model), then the same round on the
    portable path; every output of the two must be the same bits."""
    spec = fit(spec, ctx.world_size)
    path = "device" if device_ok(spec) else "portable"
    d = DeviceRound(ctx, buf, spec, tag, path=path).run()
    p = HRound(ctx, buf, spec, tag).run()
    what = f"{tag}: device against portable"
    for name in ("recv", "recv_idx", "recv_w", "combined", "combined_w"):
        _same(ctx, getattr(d, name), getattr(p, name), f"{what}: {name}")
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", "recv_src_metadata",
                 "dst_buffer_slot_idx"):  # fmt: skip
        _same(ctx, getattr(d.handle, name), getattr(p.handle, name), f"{what}: handle.{name}")
    for name in ("num_recv_tokens_per_expert_list", "num_recv_tokens", "num_expanded_tokens"):
        ctx.expect(
            getattr(d.handle, name) == getattr(p.handle, name),
            f"{what}: handle.{name} {getattr(d.handle, name)} != {getattr(p.handle, name)}",
        )


# --- the cases ------------------------------------------------------------------------------

_state: dict = {}


def get_buf(ctx, **kw):
    key = tuple(sorted(kw.items()))
    if key not in _state:
        from mooncake.mooncake_elastic_buffer import ElasticBuffer

        cuda()
        _state[key] = ElasticBuffer(dist.group.WORLD, **{**MAKE, **kw})
    return _state[key]


def c_round(ctx, spec: HSpec, name: str, single: bool = False):
    against_portable(ctx, get_buf(ctx, allow_multiple_reduction=not single), spec, name)


def c_num_sms(ctx):
    """``num_sms`` sets the grid (the fewest it takes, and one past the GPU's share):
    the results do not change."""
    buf = get_buf(ctx)
    spec = fit(HSpec(T=64, H=256, K=4, epr=4, ns=(64, 33), cached=1), ctx.world_size)
    for sms in (1, 2, 3, 10_000):
        r = DeviceRound(ctx, buf, spec, f"sms{sms}")

        def with_sms(*args, _sms=sms, _orig=buf.dispatch, **kwargs):
            return _orig(*args, num_sms=_sms, **kwargs)

        buf.dispatch = with_sms
        try:
            r.run()
        finally:
            del buf.dispatch


def c_workspace(ctx):
    """The device path's workspace does not grow with T, and it is reported."""
    buf = get_buf(ctx)
    # a small round first: the workspace is made at the first dispatch (this case may run
    # first, with -k)
    DeviceRound(ctx, buf, fit(HSpec(T=4, H=128, ns=(3,)), ctx.world_size), "small-T").run()
    before = buf.device_workspace_bytes
    DeviceRound(ctx, buf, fit(HSpec(T=512, H=128, ns=(512, 300)), ctx.world_size), "big-T").run()
    ctx.expect(before > 0 and buf.device_workspace_bytes == before,
               f"workspace {before} -> {buf.device_workspace_bytes}")  # fmt: skip


# Many tokens of few bytes on a buffer made for them (small rings): each channel sends
# several batches and both rings wrap round, waiting for room (the other cases fit one
# batch per channel).
WRAP_MAKE = {"hidden": 128, "num_topk": 4}
WRAP_SPEC = HSpec(T=4096, H=128, K=4, epr=2, ns=(4096, 3001), cached=1)


def c_rings_wrap(ctx, single: bool = False):
    buf = get_buf(ctx, allow_multiple_reduction=not single, **WRAP_MAKE)
    spec = fit(WRAP_SPEC, ctx.world_size)
    DeviceRound(ctx, buf, spec, "wrap-single" if single else "wrap").run()


def c_combine_too_wide(ctx):
    """A combine whose rows are wider than the rings were made for (16 KiB against 512 B)
    raises ValueError naming x on every rank alike (at world 1 there are no rings), and
    the buffer goes on."""
    buf = get_buf(ctx, allow_multiple_reduction=True, **WRAP_MAKE)
    spec = fit(HSpec(T=8, H=128, K=4, epr=2, ns=(8, 5)), ctx.world_size)
    ins = make_inputs(7, ctx.rank, spec, ctx.world_size, "wide")
    dev = cuda()
    recv_x, _, _, handle, _ = buf.dispatch(
        ins.x_in.to(dev), ins.idx.to(dev), ins.w.to(dev),
        num_experts=spec.epr * ctx.world_size, num_max_tokens_per_rank=spec.T,
    )  # fmt: skip
    wide = torch.zeros(recv_x.shape[0], 4096, dtype=torch.float32, device=dev)
    try:
        buf.combine(wide, handle)
        ctx.expect(ctx.world_size == 1, "a combine of 16 KiB rows on 512-byte rings ran")
    except ValueError as e:
        ctx.expect(ctx.world_size > 1 and "x's rows" in str(e), f"rank {ctx.rank}: {e}")
    torch.cuda.synchronize()
    DeviceRound(ctx, buf, spec, "after-wide").run()


def c_bad_ids(ctx):
    """An expert id out of range on one rank: that rank's synced dispatch raises ValueError
    naming it, every rank's results are the others' exact rows, and the buffer works."""
    buf = get_buf(ctx)
    spec = fit(HSpec(T=4, H=128, K=2, epr=2, ns=(3,)), ctx.world_size)
    ins = make_inputs(3, ctx.rank, spec, ctx.world_size, "bad")
    idx = ins.idx.clone()
    if ctx.rank == 0:
        idx[0, 0] = 10_000
    dev = cuda()
    try:
        buf.dispatch(ins.x_in.to(dev), idx.to(dev), ins.w.to(dev), num_experts=spec.epr * ctx.world_size,
                     num_max_tokens_per_rank=spec.T)  # fmt: skip
        ctx.expect(ctx.rank != 0, "rank 0's dispatch with expert 10000 did not raise")
    except ValueError as e:
        ctx.expect(ctx.rank == 0 and "10000" in str(e), f"rank {ctx.rank}: {e}")
    torch.cuda.synchronize()
    DeviceRound(ctx, buf, spec, "after-bad").run()


def c_short_x(ctx):
    """A combine given x trimmed below the dispatch's valid rows (rank 0, after a dispatch
    without CPU sync, whose count the host does not know): rank 0's next call raises
    ValueError naming x and the valid rows (the others go on without it), and the buffer
    works after. (Trimmed to exactly the valid rows is a round of every grid:
    ``trimmed-combine-x``.)"""
    buf = get_buf(ctx)
    spec = fit(HSpec(T=8, H=128, K=2, epr=2, ns=(8,), neg=0.0), ctx.world_size)
    ins = make_inputs(5, ctx.rank, spec, ctx.world_size, "short")
    dev = cuda()
    args = dict(num_experts=spec.epr * ctx.world_size, num_max_tokens_per_rank=spec.T)
    recv_x, _, recv_w, h, _ = buf.dispatch(
        ins.x_in.to(dev), ins.idx.to(dev), ins.w.to(dev), do_cpu_sync=False, **args
    )
    valid = int(h.psum_num_recv_tokens_per_scaleup_rank[-1])
    ctx.expect(valid > 0, "no rows received")
    keep = valid - 1 if ctx.rank == 0 else valid
    buf.combine(recv_x[:keep], h, topk_weights=recv_w[:keep])
    torch.cuda.synchronize()
    try:
        buf.dispatch(ins.x_in.to(dev), ins.idx.to(dev), ins.w.to(dev), **args)
        ctx.expect(ctx.rank != 0, "rank 0's call after its short combine did not raise")
    except ValueError as e:
        ctx.expect(ctx.rank == 0 and "x of" in str(e) and "valid rows" in str(e),
                   f"rank {ctx.rank}: {e}")  # fmt: skip
    torch.cuda.synchronize()
    DeviceRound(ctx, buf, spec, "after-short").run()


def c_one_copy(ctx):
    """``MOONCAKE_EP_HT_ONE_COPY=1`` (the launch's environment): each source offers its x
    (a replier its x and weights), and from the round after a peer mapped the allocation
    that holds it, the peer reads the rows there, not through the ring: the counts say
    so for dispatch and combine, and every round is exact (``DeviceRound`` checks it
    against the model and the portable path). BF16, then pre-quantised FP8, whose scales
    are offered too; then every rank frees its cached allocations (``empty_cache``) while
    the peers map some of them, and rounds go on."""
    buf = get_buf(ctx)

    def rounds(spec, tag):
        DeviceRound(ctx, buf, spec, f"one-copy-first-{tag}").run()
        before = buf.device_one_copy
        for i in range(3):
            DeviceRound(ctx, buf, spec, f"one-copy-{i}-{tag}").run()
        after = buf.device_one_copy
        ctx.expect(after["on"], "MOONCAKE_EP_HT_ONE_COPY=1, yet the device path's one copy is off")
        for what in ("dispatch", "combine"):
            key = f"{what}_in_place"
            ctx.expect(after[key] > before[key] and after["mapped"] > 0,
                       f"{tag}: no {what} rows read in place over 3 rounds after the first "
                       f"({before} -> {after})")  # fmt: skip

    for fp8 in ("", "f32"):
        spec = fit(HSpec(H=7168, T=24, K=8, epr=256 // ctx.world_size, ns=(24, 17), fp8=fp8,
                         cached=1), ctx.world_size)  # fmt: skip
        rounds(spec, fp8 or "bf16")
    # Torch frees its cached allocations, the exported ones among them, which the peers
    # still map (CUDA leaves a free before the mapping's close undefined: this shows what
    # the driver does); later rounds export and map the new ones, and stay exact.
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.empty_cache()
    dist.barrier()
    rounds(fit(HSpec(H=7168, T=24, K=8, epr=256 // ctx.world_size, ns=(24, 17)), ctx.world_size),
           "after-free")  # fmt: skip


def device_cases(world: int, one_copy: bool = False) -> list[Case]:
    P = functools.partial
    specs = dict(ht_cases._grid())
    specs.update(ht_cases._extra(world))
    specs["fp32-large"] = HSpec(dtype=torch.float32, H=1024, T=16, ns=(16, 9), cached=1)
    specs["k8-e256"] = HSpec(H=7168, T=24, K=8, epr=256 // world, ns=(24, 17), cached=1)
    specs["k8-e256-fp8-expand"] = HSpec(H=7168, T=24, K=8, epr=256 // world, ns=(24, 17),
                                        fp8="f32", expand=True, align=16)  # fmt: skip
    cases = [Case(f"dev/{n}", P(c_round, spec=s, name=n)) for n, s in specs.items()]
    cases += [
        Case("dev/single-reduction/sync",
             P(c_round, spec=HSpec(expand=True, align=4, K=4, epr=3), name="single-sync",
               single=True)),
        Case("dev/single-reduction/nosync",
             P(c_round, spec=HSpec(expand=True, sync=False, align=4, K=4, epr=3),
               name="single-nosync", single=True)),
        Case("dev/rings-wrap", c_rings_wrap),
        Case("dev/rings-wrap/single-reduction", P(c_rings_wrap, single=True)),
        Case("dev/combine-too-wide", c_combine_too_wide),
        Case("dev/num-sms", c_num_sms),
        Case("dev/workspace", c_workspace),
        Case("dev/bad-ids", c_bad_ids),
        Case("dev/combine-short-x", c_short_x),
    ]  # fmt: skip
    if one_copy and world > 1:
        cases.append(Case("dev/one-copy", c_one_copy))
    return cases


# --- a rank killed mid-dispatch, then a replacement -----------------------------------------

SPEC = HSpec(T=6, H=256, K=3, epr=2, ns=(6, 4, 5, 3), cached=1, fp8="odd")


class _DieBeforeRows:
    """The victim's device path: its next dispatch launch kills it, after its layout pass
    has told the others what it sends (its kernels finished) and before any row moves."""

    def __init__(self, ext):
        self._ext = ext

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def dispatch(self, *args, **kwargs):
        torch.cuda.synchronize()
        os.kill(os.getpid(), signal.SIGKILL)
        return self._ext.dispatch(*args, **kwargs)


def fault_rank(rank, world_size, port, plan):
    """A device round on all; the victim dies inside its next fresh dispatch (between the
    layout pass and the rows); the survivors' dispatch masks it and drops its rows; a round
    with it masked and a cached dispatch along a handle from before; a replacement joins
    (recover_ranks, update_ep_member / ElasticBuffer); stale handles are refused; rounds at
    full strength. Returns the rounds' records."""
    from ft_ranks import admit

    victim = plan["victim"]
    chk = Checks(rank, world_size, "ht-device-fault")
    out = {"rounds": [], "role": plan["role"]}
    cuda()
    W, store, buf = ht_fault.start(rank, world_size, port, plan, MAKE)
    if plan["role"] == "joiner":
        ht_fault.meet_stale_calls(chk, world_size, buf, out)
    else:
        first = DeviceRound(chk, buf, SPEC, "before").run()
        ht_fault.keep(out, chk, buf, first, "before")
        if rank == victim:
            buf._device.ext = _DieBeforeRows(buf._device.ext)
            store.set("armed", "1")
            DeviceRound(chk, buf, SPEC, "dying", may_drop=range(world_size)).run()
            raise RuntimeError("the victim outlived its dispatch")
        r = DeviceRound(chk, buf, SPEC, "during", may_drop=(victim,)).run()
        ht_fault.keep(out, chk, buf, r, "during", masked_in=r.masked_in,
                      events=buf._members.mask_events())  # fmt: skip
        r = DeviceRound(
            chk, buf, replace(SPEC, expand=True, align=4, cached=0), "after_death"
        ).run()
        ht_fault.keep(out, chk, buf, r, "after_death")
        first.may_drop = {victim}
        ins = first.cached("old")
        ht_fault.keep(out, chk, buf, first, "cached_old")
        admit(W, [victim])
        buf.update_ep_member()
        dev = cuda()
        x = to_device(ins[rank].x_in, dev)
        out["stale_dispatch"] = ht_fault.error_of(
            lambda: buf.dispatch(x, topk_weights=ins[rank].w.to(dev), handle=first.handle.real)
        )
        y, _ = first.expert_outputs()
        out["stale_combine"] = ht_fault.error_of(lambda: buf.combine(y.to(dev), first.handle.real))
    out["generation"] = buf.generation
    ht_fault.rejoined(DeviceRound, chk, buf, SPEC, out)
    store.set(f"done/{rank}", "1")
    return out


# --- a short round for compute-sanitizer (ht_device_round.py) -------------------------------


def sanitizer_rank(rank: int, world: int, port: int, deadline_s: int = 600,
                   wrap: bool = False) -> list[str]:  # fmt: skip
    """BF16 tokens with a cached dispatch, pre-quantised FP8 expanded without CPU sync,
    and a single-reduction combine: every kernel of the device path runs; with ``wrap``
    a round whose rings wrap too (WRAP_SPEC). ``deadline_s``: the kernels' and the
    group's (generous by default: kernels run many times slower under the sanitizer;
    short in a smoke run, so that a hang comes back as a masked peer and a report
    rather than a killed process). Returns the failed expectations."""
    import traceback

    from mooncake.launch import init_rank
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    make = {"hidden": 512, "num_topk": 4, "num_cpu_timeout_secs": deadline_s,
            "num_gpu_timeout_secs": deadline_s}  # fmt: skip
    cuda()
    # The group's own deadline is not the kernels': host work (CUDA's start, the checks
    # of the large round) may keep a rank from its next op for longer than 20 s.
    init_rank(rank, world, port, timeout_s=max(120, deadline_s))
    chk = Checks(rank, world, "ht-device-round")
    try:
        buf = ElasticBuffer(dist.group.WORLD, **make)
        DeviceRound(chk, buf, HSpec(T=40, H=512, K=4, epr=2, ns=(40, 23), cached=1), "bf16").run()
        DeviceRound(chk, buf, HSpec(T=24, H=256, K=3, epr=3, ns=(24, 5), fp8="odd", expand=True,
                                    align=4, sync=False), "fp8-expand").run()  # fmt: skip
        single = ElasticBuffer(dist.group.WORLD, allow_multiple_reduction=False, **make)
        DeviceRound(chk, single, HSpec(T=16, H=128, K=4, epr=3, expand=True, align=2),
                    "single").run()  # fmt: skip
        if wrap:
            timeouts = {k: v for k, v in make.items() if "timeout" in k}
            wrapping = ElasticBuffer(dist.group.WORLD, **WRAP_MAKE, **timeouts)
            DeviceRound(chk, wrapping, fit(WRAP_SPEC, world), "wrap").run()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - reported as a failure
        chk.fail(traceback.format_exc())
    dist.destroy_process_group()
    return chk.failures
