"""Rank-side code of test_ep.py: an independent model of EP routing, verified rounds of
dispatch + combine, the case lists of the launches, and the ranks of the kill test.

The model (:func:`route_model`, :func:`combine_model`) is plain Python: loops over
source ranks, tokens and top-k slots, sharing nothing with ``mooncake.ep.portable_rows``.

Inputs identify themselves: token ``t`` of rank ``r`` has ``x[t, 0] = r`` and
``x[t, 1] = t``, and small integers elsewhere, all exact in bf16/fp16/fp32. The
"experts" are exact too (``(row + e % 16) * 2**(e % 3 - 1)`` for expert ``e``), and
the top-k weights are signed powers of two, so a combine without FP8 must equal the
reference bit for bit (the fp32 sums are exact; the one rounding is the same). With FP8
the received data and scales must be exactly ``mooncake.fp8.quantize`` of the source's
token, the dequantised rows within ``mooncake.fp8.error_bound`` of ``x``, and the
combine within a bound derived from it (the expert is ``deq * (e + 1)`` in bf16).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import time
import zlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

from launcher import Case
from reference import mismatch

BLOCK = 128

# --- inputs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """The shape of one round; every rank builds every rank's inputs from it."""

    T: int = 8  # num_max_dispatch_tokens_per_rank
    H: int = 128
    K: int = 2
    epr: int = 2  # local experts per rank (E = epr * R)
    ns: tuple = (5,)  # tokens of rank r: ns[r % len(ns)]
    dtype: torch.dtype = torch.bfloat16
    fp8: bool = False
    neg: float = 0.1  # share of -1 selections
    dup: float = 0.1  # share of tokens whose last selection repeats their first
    wdtype: torch.dtype = torch.float32
    idx_dtype: torch.dtype = torch.int64
    timeout_us: int = -1
    strided: bool = False  # x and topk_idx as non-contiguous views
    numpy_ints: bool = False  # T, E and timeout_us as numpy ints, as an engine reads them

    def n_of(self, rank: int) -> int:
        return self.ns[rank % len(self.ns)]


@dataclass
class Inputs:
    x: torch.Tensor  # [n, H]
    idx: torch.Tensor  # [n, K]
    w: torch.Tensor  # [n, K]
    idx_list: list = field(default_factory=list)


def seed_for(*parts) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode()) & 0x7FFFFFFF


def make_inputs(seed: int, rank: int, spec: Spec, R: int) -> Inputs:
    """Rank ``rank``'s tokens: distinct experts per token (as torch.topk gives), then
    ``neg`` of the selections set to -1 and ``dup`` of the tokens repeating their first
    expert in their last slot, keeping at most T rows per (source, expert)."""
    n, H, K, E = spec.n_of(rank), spec.H, spec.K, spec.epr * R
    assert K <= E, (K, E)
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randint(-8, 9, (n, H), generator=g, dtype=torch.int64)
    if H >= 2:
        x[:, 0] = rank
        x[:, 1] = torch.arange(n)
    idx = (
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
        if n
        else (torch.zeros(0, K, dtype=torch.int64))
    )
    idx[torch.rand(n, K, generator=g) < spec.neg] = -1
    if K > 1:
        d = torch.rand(n, generator=g) < spec.dup
        idx[d, K - 1] = idx[d, 0]
    rows = idx.tolist()
    seen: dict[int, int] = {}
    for row in rows:  # at most T rows per (source, expert), the receive capacity
        for k, e in enumerate(row):
            if e >= 0:
                if seen.get(e, 0) == spec.T:
                    row[k] = -1
                else:
                    seen[e] = seen.get(e, 0) + 1
    idx = torch.tensor(rows, dtype=torch.int64).reshape(n, K)
    sign = torch.randint(0, 2, (n, K), generator=g) * 2 - 1
    w = 2.0 ** torch.randint(-3, 2, (n, K), generator=g).double() * sign
    x, idx = x.to(spec.dtype), idx.to(spec.idx_dtype)
    if spec.strided:  # every other column of a wider buffer; idx transposed twice
        wide = torch.full((n, 2 * H), 99.0, dtype=spec.dtype)
        wide[:, ::2] = x
        x = wide[:, ::2]
        idx = idx.t().contiguous().t()
    return Inputs(x, idx, w.to(spec.wdtype), idx.tolist())


def fit(spec: Spec, world: int) -> Spec:
    """``spec`` with enough experts per rank for K distinct ones."""
    return replace(spec, epr=max(spec.epr, -(-spec.K // world)))


# --- the model ----------------------------------------------------------------------------


def route_model(idx_lists, R: int, E: int, views):
    """``recv[d][j]``: the ``(source, token)`` rows local expert ``j`` of rank ``d`` gets, in
    order: sources in rank order, tokens in order, one row per selection. ``views[r][q]``:
    whether rank ``r`` counts rank ``q`` active; ``s`` sends to ``d`` when both agree."""
    epr = E // R
    recv = [[[] for _ in range(epr)] for _ in range(R)]
    for d in range(R):
        for j in range(epr):
            e = d * epr + j
            for s in range(R):
                if not (views[s][d] and views[d][s]):
                    continue
                for t, row in enumerate(idx_lists[s]):
                    for v in row:
                        if v == e:
                            recv[d][j].append((s, t))
    return recv


def expert_fn(rows: torch.Tensor, e: int, spec: Spec) -> torch.Tensor:
    """The expert ``e``: exact in the output dtype (see the module docstring)."""
    if spec.fp8:
        return (rows.float() * (e + 1)).to(torch.bfloat16)
    return ((rows.float() + (e % 16)) * 2.0 ** ((e % 3) - 1)).to(spec.dtype)


def dequant(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 data and per-128-channel scales to fp32 (written here, not mooncake.fp8's)."""
    return data.float() * scales.repeat_interleave(BLOCK, dim=-1)


def quantized(x: torch.Tensor):
    """The source's quantisation of its tokens (``mooncake.fp8.quantize``)."""
    from mooncake import fp8

    return fp8.quantize(x)


def expected_scales(x: torch.Tensor) -> torch.Tensor:
    """``max(amax(block), 1e-4) / 448`` per token and block of 128 channels."""
    n, h = x.shape
    amax = x.float().reshape(n, h // BLOCK, BLOCK).abs().amax(dim=-1)
    return amax.clamp_min(1e-4) / 448.0


def combine_model(ins: Inputs, me: int, R: int, E: int, spec: Spec, used, extra=()):
    """Per token of rank ``me``: the terms ``(weight, expert output, e)`` of the
    selections whose expert's rank ``d`` has ``used[d]``, or whose expert is in ``extra``."""
    epr = E // R
    rows = ins.x
    if spec.fp8:
        data, scales = quantized(ins.x)
        rows = dequant(data, scales)
    terms = []
    for t, row in enumerate(ins.idx_list):
        mine = []
        for k, e in enumerate(row):
            if e < 0 or not (used[e // epr] or e in extra):
                continue
            mine.append((float(ins.w[t, k]), expert_fn(rows[t : t + 1], e, spec)[0], e))
        terms.append(mine)
    return terms


# --- checks -------------------------------------------------------------------------------


class Checks:
    """The expectations of worker.RankContext, for code outside the case launcher."""

    def __init__(self, rank: int, world_size: int, case: str):
        self.rank, self.world_size, self.case = rank, world_size, case
        self.failures: list[str] = []

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.fail(message)

    def expect_equal(self, actual, expected, what: str = "result") -> None:
        problem = mismatch(actual, expected)
        if problem:
            self.fail(f"{what}: {problem}")


def expect_value_error(ctx, fn, words, what: str):
    """Calls ``fn``; records a failure unless it raises ValueError naming every word
    (case-insensitive; a tuple: any one of them). Returns the message or None."""
    try:
        fn()
    except ValueError as e:
        text = str(e).lower()
        missing = [
            w
            for w in words
            if not any(a.lower() in text for a in (w if isinstance(w, tuple) else (w,)))
        ]
        if missing:
            ctx.fail(f"{what}: ValueError does not mention {missing}: {e}")
        return str(e)
    except Exception as e:  # noqa: BLE001 - reported as the wrong kind of error
        ctx.fail(f"{what}: expected ValueError ({words}), got {type(e).__name__}: {e}")
        return None
    ctx.fail(f"{what}: expected ValueError ({words}), nothing was raised")
    return None


def pg_view(R: int) -> list[int]:
    from mooncake import pg

    return [int(v) for v in pg.get_active_ranks(dist.group.WORLD)[:R].tolist()]


def finish(event, hook, mode: str, ctx, what: str) -> None:
    """Completes a call made in ``mode`` (sync, async, with, hook)."""
    if mode == "sync":
        ctx.expect(callable(hook), f"{what}: no callable hook without return_recv_hook")
        hook()  # nothing to do, as upstream's
        event.current_stream_wait()  # harmless on a finished call
    elif mode == "async":
        ctx.expect(callable(hook), f"{what}: no callable hook with async_finish")
        event.current_stream_wait()
        hook()  # nothing to do: the event finished the call
        event.current_stream_wait()
    elif mode == "with":
        with event:
            pass
    elif mode == "hook":
        ctx.expect(callable(hook), f"{what}: no hook with return_recv_hook=True")
        hook()
        hook()  # twice is harmless
    else:
        raise ValueError(mode)


def mode_flags(mode: str) -> dict:
    return {"async_finish": mode in ("async", "with"), "return_recv_hook": mode == "hook"}


class Round:
    """One dispatch + combine on every rank, checked against the model.

    ``masks``: per rank, its ``active_ranks`` (None: pass None, the process group's
    view). ``may_drop``: ranks the calls may set to 0 (they died; one that dies during a
    call may have delivered part of its share first, whole per expert); ``must_drop``:
    ranks dispatch must set to 0 (dead before the call: nothing of theirs arrives). ``act``: a tensor to pass (and keep) instead of a fresh one.
    """

    def __init__(self, ctx, buf, spec: Spec, tag: str = "", masks=None, act=None):
        spec = fit(spec, ctx.world_size)
        self.ctx, self.buf, self.spec = ctx, buf, spec
        self.R, self.me = ctx.world_size, ctx.rank
        self.E = spec.epr * self.R
        self.what = f"{tag or 'round'}"
        seed = seed_for(ctx.case, tag)
        self.ins = [make_inputs(seed, r, spec, self.R) for r in range(self.R)]
        self.masks = masks
        if act is not None:
            self.act = act
        elif masks is not None:
            self.act = torch.tensor(masks[self.me], dtype=torch.int32)
        else:
            self.act = None

    # --- dispatch ---

    def dispatch(self, mode: str = "sync", stats=None, unwaited=False):
        """``unwaited``: an async_finish call's event is kept in ``self.event``, not
        waited on."""
        ins, spec = self.ins[self.me], self.spec
        self.before = None if self.act is None else self.act.tolist()
        T, E, timeout_us = spec.T, self.E, spec.timeout_us
        if spec.numpy_ints:
            T, E, timeout_us = np.int32(T), np.int64(E), np.int64(timeout_us)
        t0 = time.monotonic()
        out = self.buf.dispatch(
            ins.x,
            ins.idx,
            self.act,
            T,
            E,
            timeout_us,
            use_fp8=spec.fp8,
            cumulative_local_expert_recv_stats=stats,
            **mode_flags(mode),
        )
        self.recv_x, self.count, self.handle, event, hook = out
        self.event = event
        if not unwaited:
            finish(event, hook, mode, self.ctx, f"{self.what}: dispatch")
        self.dispatch_s = time.monotonic() - t0
        return out

    def views_after_dispatch(self, may_drop=(), must_drop=None):
        """The model's views: the given masks, less the ranks this call dropped."""
        R, ctx = self.R, self.ctx
        if self.act is None:
            now = pg_view(R)
            start = [1] * R
        else:
            now = [int(v) for v in self.act.tolist()]
            start = self.before
        dropped = {q for q in range(R) if start[q] and not now[q]}
        raised = {q for q in range(R) if now[q] and not start[q]}
        ctx.expect(not raised, f"{self.what}: dispatch set ranks {sorted(raised)} to 1")
        may_drop = set(may_drop) | set(must_drop or ())
        ctx.expect(
            dropped <= may_drop,
            f"{self.what}: dispatch masked ranks {sorted(dropped)} (active_ranks {now}); "
            f"only {sorted(may_drop)} may be masked",
        )
        if must_drop is not None:
            ctx.expect(
                dropped == set(must_drop),
                f"{self.what}: dispatch masked {sorted(dropped)}, want exactly {sorted(must_drop)}",
            )
        if self.masks is not None:
            base = self.masks
        elif self.act is not None:  # a tensor kept across rounds: every rank's view alike
            base = [start] * R
        else:
            base = [[1] * R for _ in range(R)]
        self.dropped = dropped
        self.views = [[int(base[r][q] and q not in dropped) for q in range(R)] for r in range(R)]
        return now

    def check_dispatch(self, may_drop=(), must_drop=None):
        ctx, spec, R, me, E = self.ctx, self.spec, self.R, self.me, self.E
        what = f"{self.what}: dispatch"
        failures_before = len(ctx.failures)
        self.views_after_dispatch(may_drop, must_drop)
        expected = route_model([i.idx_list for i in self.ins], R, E, self.views)[me]
        # A rank that died during this call (masked by it, not dead before it) may have
        # delivered part of its share first: each local expert has all of its rows from
        # that rank or none.
        partial = self.dropped - set(must_drop or ())
        if partial:
            expected = self._partial_rows(expected, partial)
        self.expected = expected
        epr, T, H = spec.epr, spec.T, spec.H
        count, handle = self.count, self.handle
        ctx.expect(
            count.dtype == torch.int32 and list(count.shape) == [epr],
            f"{what}: recv_count {count.dtype} {list(count.shape)}, want int32 [{epr}]",
        )
        want_counts = [len(rows) for rows in expected]
        ctx.expect(
            count.tolist() == want_counts,
            f"{what}: recv_count {count.tolist()}, want {want_counts}",
        )
        ctx.expect(
            isinstance(handle, tuple)
            and len(handle) == 5
            and tuple(handle[2:]) == (T, H, E)
            and handle.num_max_dispatch_tokens_per_rank == T
            and handle.hidden == H
            and handle.num_experts == E
            and handle[0] is handle.src_info
            and handle[1] is handle.layout_range,
            f"{what}: handle fields {tuple(handle[2:]) if isinstance(handle, tuple) else handle}",
        )
        src, lr = handle.src_info, handle.layout_range
        ctx.expect(
            src.dtype == torch.int32 and list(src.shape) == [epr, R * T],
            f"{what}: src_info {src.dtype} {list(src.shape)}, want int32 [{epr}, {R * T}]",
        )
        ctx.expect(
            lr.dtype == torch.int64 and list(lr.shape) == [epr, R],
            f"{what}: layout_range {lr.dtype} {list(lr.shape)}, want int64 [{epr}, {R}]",
        )
        if len(ctx.failures) == failures_before:
            self._check_rows(expected, what)
        return expected

    def _partial_rows(self, expected, partial):
        """``expected`` with the rows of the ranks in ``partial`` added back for each local
        expert whose layout_range says it got them all from that rank."""
        R, me = self.R, self.me
        views = [[int(v or q in partial) for q, v in enumerate(row)] for row in self.views]
        full = route_model([i.idx_list for i in self.ins], R, self.E, views)[me]
        lr = self.handle.layout_range.tolist()
        rows = []
        for j, want in enumerate(full):
            took = {
                s for s in partial if lr[j][s] & 0xFFFFFFFF == sum(1 for q, _ in want if q == s)
            }
            rows.append([(s, t) for s, t in want if s not in partial or s in took])
        return rows

    def _check_rows(self, expected, what):
        ctx, spec, R = self.ctx, self.spec, self.R
        epr, T, H = spec.epr, spec.T, spec.H
        src, lr = self.handle.src_info.tolist(), self.handle.layout_range.tolist()
        if spec.fp8:
            ok = (
                isinstance(self.recv_x, tuple)
                and len(self.recv_x) == 2
                and self.recv_x[0].dtype == torch.float8_e4m3fn
                and list(self.recv_x[0].shape) == [epr, R * T, H]
                and self.recv_x[1].dtype == torch.float32
                and list(self.recv_x[1].shape) == [epr, R * T, H // BLOCK]
                # upstream's layout: a transposed view, token stride 1
                and self.recv_x[1].stride() == (H // BLOCK * R * T, 1, R * T)
            )
            ctx.expect(
                ok,
                f"{what}: recv_x is not (fp8 [{epr}, {R * T}, {H}], fp32 scales of token stride "
                f"1), got scales of stride {getattr(self.recv_x[1], 'stride', lambda: None)()}",
            )
            if not ok:
                return
            q = [quantized(i.x) if i.x.shape[0] else None for i in self.ins]
        else:
            ok = self.recv_x.dtype == spec.dtype and list(self.recv_x.shape) == [epr, R * T, H]
            ctx.expect(
                ok,
                f"{what}: recv_x {self.recv_x.dtype} {list(self.recv_x.shape)}, want "
                f"{spec.dtype} [{epr}, {R * T}, {H}]",
            )
            if not ok:
                return
        for j, rows in enumerate(expected):
            n = len(rows)
            tokens = [t for _, t in rows]
            got_src = src[j][:n]
            ctx.expect(got_src == tokens, f"{what}: expert {j}: src_info {got_src}, want {tokens}")
            tail = src[j][n:]
            ctx.expect(
                all(v == -1 for v in tail),
                f"{what}: expert {j}: src_info past recv_count ({n}) holds "
                f"{sorted(set(tail) - {-1})[:5]}, want -1",
            )
            offset = 0
            for s in range(R):
                c = sum(1 for ss, _ in rows if ss == s)
                got_c, got_off = lr[j][s] & 0xFFFFFFFF, lr[j][s] >> 32
                good = got_c == c and (got_off == offset if c else got_off in (0, offset))
                ctx.expect(
                    good,
                    f"{what}: layout_range[{j}][{s}] = (offset {got_off}, count {got_c}), "
                    f"want (offset {offset}, count {c})",
                )
                offset += c
            if not n:
                continue
            if spec.fp8:
                data, scales = self.recv_x[0][j, :n], self.recv_x[1][j, :n]
                want_d = torch.stack([q[s][0][t] for s, t in rows])
                want_s = torch.stack([q[s][1][t] for s, t in rows])
                ctx.expect_equal(
                    data.view(torch.uint8), want_d.view(torch.uint8), f"{what}: expert {j} fp8 data"
                )
                ctx.expect_equal(scales, want_s, f"{what}: expert {j} scales")
                x = torch.stack([self.ins[s].x[t] for s, t in rows])
                ctx.expect_equal(
                    scales, expected_scales(x), f"{what}: expert {j} scales vs amax/448"
                )
                from mooncake import fp8

                err = (dequant(data, scales) - x.float()).abs()
                bound = fp8.error_bound(x, scales)
                if bool((err > bound).any()):
                    i = int((err - bound).argmax())
                    ctx.fail(
                        f"{what}: expert {j}: dequantised rows off by {err.flatten()[i]:.3g} > "
                        f"bound {bound.flatten()[i]:.3g}"
                    )
            else:
                want = torch.stack([self.ins[s].x[t] for s, t in rows])
                ctx.expect_equal(self.recv_x[j, :n], want, f"{what}: expert {j} rows")

    # --- experts and combine ---

    def expert_outputs(self) -> torch.Tensor:
        """Expert outputs in recv_x's layout; rows past recv_count are NaN (ignored)."""
        spec, me = self.spec, self.me
        out_dtype = torch.bfloat16 if spec.fp8 else spec.dtype
        y = torch.full((spec.epr, self.R * spec.T, spec.H), float("nan"), dtype=out_dtype)
        for j, n in enumerate(self.count.tolist()):
            if not n:
                continue
            if spec.fp8:
                rows = dequant(self.recv_x[0][j, :n], self.recv_x[1][j, :n])
            else:
                rows = self.recv_x[j, :n]
            y[j, :n] = expert_fn(rows, me * spec.epr + j, spec)
        return y

    def combine(self, mode="sync", zero_copy=False, use_out=False, cmask=None, y=None,
                unwaited=False):  # fmt: skip
        spec, ins = self.spec, self.ins[self.me]
        what = f"{self.what}: combine"
        y = self.expert_outputs() if y is None else y
        if zero_copy:
            zbuf = self.buf.get_next_combine_buffer(self.handle)
            want_shape = [spec.epr, self.R * spec.T, spec.H]
            self.ctx.expect(
                list(zbuf.shape) == want_shape and zbuf.dtype == y.dtype,
                f"{what}: combine buffer {zbuf.dtype} {list(zbuf.shape)}, want {y.dtype} "
                f"{want_shape}",
            )
            zbuf.copy_(y)
            y = zbuf
        out = torch.full((ins.x.shape[0], spec.H), float("nan"), dtype=y.dtype) if use_out else None
        cact = self.act
        if cmask is not None:
            cact = torch.tensor(cmask[self.me], dtype=torch.int32)
        self.cact, self.cbefore = cact, None if cact is None else cact.tolist()
        t0 = time.monotonic()
        combined, event, hook = self.buf.combine(
            y,
            ins.idx,
            ins.w,
            cact,
            spec.timeout_us,
            self.handle,
            zero_copy=zero_copy,
            out=out,
            **mode_flags(mode),
        )
        self.event = event
        if not unwaited:
            finish(event, hook, mode, self.ctx, what)
        self.combine_s = time.monotonic() - t0
        if use_out:
            self.ctx.expect(combined is out, f"{what}: did not return out")
        self.combined = combined
        return combined

    def check_combine(self, may_drop=()):
        ctx, spec, R, me = self.ctx, self.spec, self.R, self.me
        what = f"{self.what}: combine"
        if self.cact is None:
            now = pg_view(R)
            start = [1] * R
        else:
            now = [int(v) for v in self.cact.tolist()]
            start = self.cbefore
        dropped = {q for q in range(R) if start[q] and not now[q]}
        ctx.expect(
            dropped <= set(may_drop),
            f"{what}: masked {sorted(dropped)}; only {sorted(may_drop)} may be masked",
        )
        used = [bool(self.views[me][d] and self.views[d][me] and now[d]) for d in range(R)]
        ins = self.ins[me]
        out = self.combined
        n = ins.x.shape[0]
        out_dtype = torch.bfloat16 if spec.fp8 else spec.dtype
        ok = out.dtype == out_dtype and list(out.shape) == [n, spec.H]
        ctx.expect(ok, f"{what}: {out.dtype} {list(out.shape)}, want {out_dtype} [{n}, {spec.H}]")
        if not ok:
            return
        # A rank that died during this combine may have sent some of its experts' outputs
        # first: each of its experts counts whole or not at all. Every choice is tried; the
        # check passes when one of them does (and reports the one without them otherwise).
        kept = [bool(self.views[me][d] and self.views[d][me]) for d in range(R)]
        epr = self.E // R
        chosen = sorted(
            {
                e
                for row in ins.idx_list
                for e in row
                if e >= 0 and e // epr in dropped and kept[e // epr]
            }
        )
        if len(chosen) > 8:  # too many to try one by one: all or none of each rank's
            choices = [set(), set(chosen)]
        else:
            choices = [
                {e for b, e in enumerate(chosen) if mask >> b & 1}
                for mask in range(1 << len(chosen))
            ]
        before = len(ctx.failures)
        for extra in reversed(choices):  # the empty choice last: its failures stay
            del ctx.failures[before:]
            self._check_terms(combine_model(ins, me, R, self.E, spec, used, extra), what)
            if len(ctx.failures) == before:
                return

    def _check_terms(self, terms, what):
        """The combined tokens against the model's terms of each token."""
        spec, ins, out = self.spec, self.ins[self.me], self.combined
        n, out_dtype = ins.x.shape[0], out.dtype
        ref = torch.zeros(n, spec.H, dtype=torch.float64)
        mag = torch.zeros(n, spec.H, dtype=torch.float64)
        for t, mine in enumerate(terms):
            for wt, y, _ in mine:
                ref[t] += wt * y.double()
                mag[t] += abs(wt) * y.double().abs()
        if not spec.fp8:
            self.ctx.expect_equal(out, ref.to(out_dtype), f"{what}: combined tokens")
            return
        # FP8: fp32 accumulation in any order, one rounding to bf16.
        tol = ref.abs() * 2.0**-8 + mag * spec.K * 2.0**-23
        self._within(out.double(), ref, tol, f"{what}: combined vs the dequantised reference")
        # Against x itself: the FP8 error, the bf16 expert output, the final rounding.
        from mooncake import fp8

        exact = torch.zeros(n, spec.H, dtype=torch.float64)
        err = torch.zeros(n, spec.H, dtype=torch.float64)
        if n:
            scales = expected_scales(ins.x)
            eb = fp8.error_bound(ins.x, scales).double()
            xd = ins.x.double()
            for t, mine in enumerate(terms):
                for wt, _, e in mine:
                    exact[t] += wt * (e + 1) * xd[t]
                    err[t] += abs(wt) * (e + 1) * (eb[t] + (xd[t].abs() + eb[t]) * 2.0**-8)
        tol = err + (exact.abs() + err) * 2.0**-8 + mag * spec.K * 2.0**-23 + 1e-30
        self._within(out.double(), exact, tol, f"{what}: combined vs x (fp8.error_bound)")

    def _within(self, got, want, tol, what):
        bad = (got - want).abs() > tol
        if bool(bad.any()) or bool(got.isnan().any()):
            i = (
                int(bad.flatten().nonzero()[0])
                if bool(bad.any())
                else int(got.isnan().flatten().nonzero()[0])
            )
            self.ctx.fail(
                f"{what}: {int(bad.sum())} elements out of bound; e.g. [{i}] {got.flatten()[i]:.6g} "
                f"vs {want.flatten()[i]:.6g} (tolerance {tol.flatten()[i]:.3g})"
            )

    def run(
        self, dmode="sync", cmode="sync", zero_copy=False, use_out=False, cmask=None, stats=None
    ):
        self.dispatch(dmode, stats=stats)
        self.check_dispatch()
        self.combine(cmode, zero_copy=zero_copy, use_out=use_out, cmask=cmask)
        self.check_combine()
        return self


# --- the launch's Buffer ------------------------------------------------------------------

_state: dict = {}


def get_buffer(ctx):
    """The launch's Buffer (made collectively on first use, so that -k works)."""
    if "buf" not in _state:
        from mooncake.mooncake_ep_buffer import Buffer

        _state["buf"] = Buffer(dist.group.WORLD)
    return _state["buf"]


SMALL = Spec(T=4, H=128, K=2, epr=2, ns=(3,))


def good_round(ctx, tag="good"):
    """A small verified round: the group still works."""
    Round(ctx, get_buffer(ctx), SMALL, tag).run()


# --- routing and combine cases ------------------------------------------------------------


def c_round(ctx, spec: Spec, **kw):
    Round(ctx, get_buffer(ctx), spec).run(**kw)


def c_buffer_init(ctx):
    """The Buffer of the launch: portable path, size and rank from the group."""
    buf = get_buffer(ctx)
    ctx.expect(buf.num_ranks == ctx.world_size, f"num_ranks {buf.num_ranks}")
    ctx.expect(buf.rank == ctx.rank, f"rank {buf.rank}")
    ctx.expect(buf.path == "portable", f"path {buf.path!r}")
    ctx.expect(buf.num_ep_buffer_bytes == 0, f"num_ep_buffer_bytes {buf.num_ep_buffer_bytes}")


def c_upstream_attributes(ctx):
    """What upstream code reads off a Buffer and calls on it (an engine computes
    ``expected_m`` from ``group_size``): the attributes, the runtime's answers, the
    size-hint names, capture(), connect() and a dispatch with upstream's positional
    ``topk_weights``."""
    from mooncake.mooncake_ep_buffer import Buffer, EventOverlap

    buf = get_buffer(ctx)
    ctx.expect(buf.group_size == ctx.world_size, f"group_size {buf.group_size}")
    ctx.expect(buf.backend is dist.group.WORLD, "backend is the group")
    ctx.expect(buf.device_type == "cuda", f"device_type {buf.device_type!r}")
    ctx.expect(buf.runtime.ibgda_disabled() is True, "runtime.ibgda_disabled()")
    ctx.expect(buf.runtime.p2p_enabled() is False, "runtime.p2p_enabled() without a workspace")
    hint = Buffer.get_ep_buffer_size_hint(8, 128, ctx.world_size, 2 * ctx.world_size)
    for name in ("get_low_latency_buffer_size_hint", "get_rdma_size_hint"):
        got = getattr(Buffer, name)(8, 128, ctx.world_size, 2 * ctx.world_size)
        ctx.expect(got == hint, f"{name}: {got} against {hint}")
    event = Buffer.capture()
    ctx.expect(isinstance(event, EventOverlap), "capture() gives an EventOverlap")
    # With CUDA (the GPU machine's run) it records an event on the current stream.
    recorded = isinstance(event.event, torch.cuda.Event)
    ctx.expect(recorded == torch.cuda.is_available(), f"capture() event {event.event!r}")
    ctx.expect(event.extra_tensors is None, "capture() extra_tensors")
    event.current_stream_wait()
    buf.connect()  # collective; nothing to map without a workspace
    buf.connect(is_update=True)  # update_ep_member
    r = Round(ctx, buf, SMALL, "upstream_topk_weights")
    ins = make_inputs(seed_for("upstream", ctx.rank), ctx.rank, SMALL, ctx.world_size)
    weights = ins.w.to(torch.float32)
    out = buf.dispatch(ins.x, ins.idx, None, SMALL.T, r.E, -1, False, False, False, weights)
    ctx.expect(len(out) == 5, f"dispatch returns {len(out)} items")
    y, _, _ = buf.combine(out[0], ins.idx, weights, None, -1, out[2])
    ctx.expect(y.shape == ins.x.shape, f"combine output {tuple(y.shape)}")
    # Engines keep upstream's handle as a plain tuple: a copy combines as the handle.
    for copy in (tuple(out[2]), list(out[2])):
        again, _, _ = buf.combine(out[0], ins.idx, weights, None, -1, copy)
        ctx.expect(torch.equal(again, y), f"combine with a {type(copy).__name__} of the handle")
    buf.get_next_combine_buffer(tuple(out[2]))
    forged = (out[2][0].clone(), *tuple(out[2])[1:])  # not this dispatch's tensors
    expect_value_error(
        ctx,
        lambda: buf.combine(out[0], ins.idx, weights, None, -1, forged),
        ("handle",),
        "a tuple that copies no dispatch",
    )
    good_round(ctx, "after_upstream_calls")


def c_foreign_group(ctx):
    """A Buffer over an engine's own EP group without a mooncake backend (gloo here;
    NCCL is the same code): it warns that the group does not report failed ranks, then
    routes, quantises and masks (the caller's ``active_ranks``) as over a mooncake group."""
    import warnings

    from mooncake.mooncake_ep_buffer import Buffer

    if "foreign_buf" not in _state:
        group = dist.new_group(backend="gloo")  # collective: every rank runs this case
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _state["foreign_buf"] = Buffer(group, 0)
        said = [str(w.message) for w in caught]
        ctx.expect(any("no mooncake backend" in m for m in said), f"no warning: {said}")
    buf = _state["foreign_buf"]
    ctx.expect(buf.group_size == ctx.world_size and buf.backend is buf.group, "attributes")
    ctx.expect(buf.group is not dist.group.WORLD, "the Buffer keeps the foreign group")
    for fp8 in (False, True):
        Round(ctx, buf, Spec(K=3, ns=(5, 2, 4), fp8=fp8), f"foreign_fp8_{fp8}").run()
    R = ctx.world_size
    if R > 1:
        masks = [[0 if q == R - 1 else 1 for q in range(R)] for _ in range(R)]
        r = Round(ctx, buf, Spec(K=3, ns=(6, 3)), "foreign_masked", masks=masks)
        r.run()
        ctx.expect(r.act.tolist() == masks[ctx.rank], f"active_ranks became {r.act.tolist()}")
    good_round(ctx, "after_foreign")


def c_stats(ctx):
    """cumulative_local_expert_recv_stats adds each call's recv_count to what it held."""
    buf = get_buffer(ctx)
    spec = Spec(T=6, H=128, K=3, epr=3, ns=(6, 2, 0, 5))
    stats = torch.arange(spec.epr, dtype=torch.int32) * 100
    want = stats.clone()
    for i in range(3):
        r = Round(ctx, buf, spec, f"call{i}")
        r.dispatch(["sync", "async", "hook"][i], stats=stats)
        r.check_dispatch()
        want += r.count
        ctx.expect_equal(stats, want, f"stats after call {i}")
        r.combine()
        r.check_combine()


def c_active_explicit_ones(ctx):
    """active_ranks all ones (passed, not None) is left unchanged."""
    R = ctx.world_size
    r = Round(ctx, get_buffer(ctx), Spec(ns=(4, 7)), masks=[[1] * R for _ in range(R)])
    r.run()
    ctx.expect(r.act.tolist() == [1] * R, f"active_ranks became {r.act.tolist()}")


def c_active_rank_out(ctx, out: int):
    """Every rank marks rank ``out`` 0: it receives and sends nothing (not even to
    itself), its experts are skipped in every combine; nobody's tensor changes."""
    R = ctx.world_size
    masks = [[0 if q == out else 1 for q in range(R)] for _ in range(R)]
    r = Round(ctx, get_buffer(ctx), Spec(K=3, ns=(6, 3, 5)), masks=masks)
    r.run()
    if ctx.rank == out:
        ctx.expect(r.count.sum().item() == 0, f"rank {out} (inactive) received {r.count.tolist()}")
        ctx.expect(bool((r.combined == 0).all()), "the inactive rank's combine is not all zeros")
    ctx.expect(r.act.tolist() == masks[ctx.rank], f"active_ranks became {r.act.tolist()}")


def c_active_asymmetric(ctx):
    """Rank 0 marks rank 1 inactive, rank 1 marks nobody: the pair exchanges nothing in
    either direction; everything else flows."""
    R = ctx.world_size
    masks = [[1] * R for _ in range(R)]
    masks[0][1] = 0
    Round(ctx, get_buffer(ctx), Spec(K=4, ns=(5, 6, 2)), masks=masks).run()


def c_combine_masks_more(ctx, out: int):
    """Dispatch with everyone active, combine with rank ``out`` marked 0 everywhere: its
    experts' contributions are excluded on every rank (rank ``out`` too)."""
    R = ctx.world_size
    masks = [[1] * R for _ in range(R)]
    cmask = [[0 if q == out else 1 for q in range(R)] for _ in range(R)]
    r = Round(ctx, get_buffer(ctx), Spec(K=4, ns=(5, 3)), masks=masks)
    r.run(cmask=cmask)


def c_active_none_is_pg_view(ctx):
    """active_ranks=None in both calls: the process group's view (all ranks here)."""
    from mooncake import pg

    R = ctx.world_size
    view = pg_view(R)
    ctx.expect(view == [1] * R, f"pg.get_active_ranks {view}")
    r = Round(ctx, get_buffer(ctx), Spec(K=3, ns=(4, 2)), masks=None)
    r.run()
    ones = Round(ctx, get_buffer(ctx), Spec(K=3, ns=(4, 2)), masks=[[1] * R] * R)
    ones.run()
    ctx.expect(
        r.count.tolist() == ones.count.tolist()
        and torch.equal(r.combined, ones.combined)
        and torch.equal(r.handle.src_info, ones.handle.src_info),
        "active_ranks=None differs from all ones",
    )
    ctx.expect(pg.get_num_synced_ranks() == R, "num_synced_ranks changed")


def c_modes(ctx, dmode, cmode, zero_copy=False, use_out=False, fp8=False):
    spec = Spec(T=6, K=3, ns=(6, 4, 1), fp8=fp8, timeout_us=10_000_000)
    Round(ctx, get_buffer(ctx), spec).run(dmode, cmode, zero_copy=zero_copy, use_out=use_out)


def c_zero_copy_halves(ctx):
    """Two dispatches in flight: each has its own combine buffer (the halves), both combine
    correctly with zero_copy in either order; a third dispatch reuses the first one's
    half, so get_next_combine_buffer and zero_copy combine refuse the first handle."""
    buf = get_buffer(ctx)
    spec = Spec(T=5, K=2, ns=(5, 2))
    a, b = Round(ctx, buf, spec, "a"), Round(ctx, buf, spec, "b")
    a.dispatch()
    a.check_dispatch()
    b.dispatch("hook")
    b.check_dispatch()
    za, zb = buf.get_next_combine_buffer(a.handle), buf.get_next_combine_buffer(b.handle)
    ctx.expect(za.data_ptr() != zb.data_ptr(), "two dispatches in flight share a combine buffer")
    b.combine("async", zero_copy=True)
    b.check_combine()
    a.combine("sync", zero_copy=True, use_out=True)
    a.check_combine()
    c = Round(ctx, buf, spec, "c")
    c.dispatch()
    c.check_dispatch()
    expect_value_error(
        ctx, lambda: buf.get_next_combine_buffer(a.handle), ["reused"], "stale handle"
    )
    zc = buf.get_next_combine_buffer(c.handle)
    ctx.expect(zc.data_ptr() == za.data_ptr(), "the third dispatch did not reuse the first half")
    y = a.expert_outputs()
    expect_value_error(
        ctx,
        lambda: buf.combine(
            y, a.ins[ctx.rank].idx, a.ins[ctx.rank].w, None, -1, a.handle, zero_copy=True
        ),
        ["reused"],
        "zero_copy combine with a stale handle",
    )
    b.combine(zero_copy=True)  # b is the second-latest: still fine
    b.check_combine()
    c.combine(zero_copy=True)
    c.check_combine()


def c_async_unwaited_then_sync(ctx):
    """Two calls in flight, the first an async_finish call whose event nobody waited on
    before the second, synchronous one; their combines the other way round: every result
    as the model's. (On CPU tensors this is the portable path's exchanges; the device
    path's ordering of such calls is ep_device_ranks' fp8/async_unwaited case.)"""
    buf = get_buffer(ctx)
    spec = Spec(T=6, K=3, ns=(6, 4, 1))
    a, b = Round(ctx, buf, spec, "a"), Round(ctx, buf, spec, "b")
    a.dispatch("async", unwaited=True)
    b.dispatch("sync")
    b.check_dispatch()
    a.event.current_stream_wait()
    a.check_dispatch()
    b.combine("async", unwaited=True)
    a.combine("sync")
    a.check_combine()
    b.event.current_stream_wait()
    b.check_combine()


def c_combine_twice(ctx):
    """A handle may be combined twice (e.g. a retried step): same result."""
    r = Round(ctx, get_buffer(ctx), Spec(K=3, ns=(4, 5)))
    r.run()
    first = r.combined.clone()
    r.combine("async")
    r.check_combine()
    ctx.expect(torch.equal(first, r.combined), "the second combine differs")


def route_cases(world: int) -> list[Case]:
    P = functools.partial
    cases = [
        Case("buffer/init", c_buffer_init),
        Case("buffer/upstream", c_upstream_attributes),
        Case("buffer/foreign_group", c_foreign_group),
    ]
    for K in range(1, 9):
        spec = Spec(T=8, K=K, epr=2 if K < 8 else 3, ns=(8, 5, 3, 0, 7), neg=0.15, dup=0.2)
        cases.append(Case(f"route/bf16_h128_k{K}", P(c_round, spec=spec)))
    # The device tests' largest shapes (ep_device_ranks: k16, e1024, e1024/fp8/one-block)
    # compare the device path with this path bit for bit; here this path meets the model
    # at those shapes.
    e1024 = 1024 // world
    cases += [
        Case("route/k16", P(c_round, spec=Spec(T=8, H=256, K=16, epr=16, ns=(8, 3), dup=0.2))),
        Case("route/e1024_k16", P(c_round, spec=Spec(T=8, H=256, K=16, epr=e1024, ns=(8, 5)))),
        Case(
            "route/e1024_k8_fp8",
            P(c_round, spec=Spec(T=16, H=256, K=8, epr=e1024, ns=(16, 9), fp8=True)),
        ),
    ]
    for K, fp8 in ((1, True), (4, True), (8, True), (4, False)):
        spec = Spec(T=4, H=256, K=K, epr=2, ns=(4, 1), fp8=fp8)
        cases.append(Case(f"route/{'fp8' if fp8 else 'bf16'}_h256_k{K}", P(c_round, spec=spec)))
    cases += [
        Case("route/fp8_h128_k3", P(c_round, spec=Spec(T=8, K=3, ns=(8, 3, 6), fp8=True))),
        Case("route/bf16_h7168", P(c_round, spec=Spec(T=2, H=7168, K=2, epr=1, ns=(2, 1)))),
        Case(
            "route/fp8_h7168", P(c_round, spec=Spec(T=2, H=7168, K=3, epr=1, ns=(2, 1), fp8=True))
        ),
        Case("route/fp16", P(c_round, spec=Spec(T=7, K=4, ns=(7, 3), dtype=torch.float16))),
        Case("route/fp32", P(c_round, spec=Spec(T=7, K=4, ns=(2, 7), dtype=torch.float32))),
        Case(
            "route/fp32_h7168",
            P(c_round, spec=Spec(T=2, H=7168, K=2, epr=1, ns=(1, 2), dtype=torch.float32)),
        ),
        Case("route/int32_idx", P(c_round, spec=Spec(K=3, ns=(5, 2), idx_dtype=torch.int32))),
        Case("route/bf16_weights", P(c_round, spec=Spec(K=3, ns=(5, 4), wdtype=torch.bfloat16))),
        Case(
            "route/fp16_weights_fp8",
            P(c_round, spec=Spec(K=3, ns=(5, 4), wdtype=torch.float16, fp8=True)),
        ),
        Case("route/strided_inputs", P(c_round, spec=Spec(K=3, ns=(5, 4), strided=True))),
        Case(
            "route/numpy_ints",
            P(c_round, spec=Spec(K=3, ns=(5, 4), numpy_ints=True, timeout_us=5_000_000)),
        ),
        Case(
            "route/strided_inputs_fp8",
            P(c_round, spec=Spec(K=3, ns=(5, 4), strided=True, fp8=True)),
        ),
        Case("route/one_expert_per_rank", P(c_round, spec=Spec(K=4, epr=1, ns=(6, 3)))),
        Case("route/five_experts_per_rank", P(c_round, spec=Spec(K=6, epr=5, ns=(6, 3)))),
        Case("route/neg_heavy", P(c_round, spec=Spec(K=3, ns=(6, 5), neg=0.6))),
        Case("route/all_neg", P(c_round, spec=Spec(K=3, ns=(4, 2), neg=1.0))),
        Case("route/dup_heavy", P(c_round, spec=Spec(K=4, epr=1, ns=(6, 5), dup=0.9, neg=0.0))),
        Case("route/zero_tokens_some", P(c_round, spec=Spec(K=3, ns=(0, 4, 0, 3)))),
        Case("route/zero_tokens_all", P(c_round, spec=Spec(K=3, ns=(0,)))),
        Case(
            "route/zero_tokens_fp8_h256",
            P(c_round, spec=Spec(H=256, K=3, ns=(0, 4, 0, 3), fp8=True)),
        ),
        Case("route/n_eq_t_8", P(c_round, spec=Spec(T=8, K=4, ns=(8,)))),
        Case("route/n_eq_t_128", P(c_round, spec=Spec(T=128, K=4, ns=(128, 64)))),
        Case("route/n_eq_t_128_fp8", P(c_round, spec=Spec(T=128, K=2, epr=1, ns=(128,), fp8=True))),
        Case("route/timeout_set", P(c_round, spec=Spec(K=3, ns=(5, 3), timeout_us=5_000_000))),
        Case("route/stats_accumulate", c_stats),
        Case("route/combine_twice", c_combine_twice),
        Case("route/async_unwaited_then_sync", c_async_unwaited_then_sync),
        Case("active/explicit_ones", c_active_explicit_ones),
        Case("active/none_is_pg_view", c_active_none_is_pg_view),
    ]
    if world == 1:  # a crash mid-dispatch: elsewhere the peers would wait for their timeout
        cases += [
            Case("route/strided_n0", P(c_round, spec=Spec(K=2, ns=(0,), strided=True))),
            Case("route/strided_1x1", P(c_round, spec=Spec(H=1, K=2, ns=(1,), strided=True))),
            Case("route/fp8_n0_h128", P(c_round, spec=Spec(K=2, ns=(0,), fp8=True))),
        ]
    if world > 1:
        cases += [
            Case("active/rank_last_out", P(c_active_rank_out, out=world - 1)),
            Case("active/rank0_out", P(c_active_rank_out, out=0)),
            Case("active/combine_masks_rank1", P(c_combine_masks_more, out=1)),
        ]
    else:
        cases.append(Case("active/self_out", P(c_active_rank_out, out=0)))
    if world > 2:
        cases.append(Case("active/asymmetric", c_active_asymmetric))
    for dm, cm, zc, uo, f8 in (
        ("async", "sync", False, False, False),
        ("with", "async", False, True, False),
        ("hook", "hook", False, False, False),
        ("sync", "with", True, False, False),
        ("hook", "async", True, True, True),
        ("async", "hook", False, True, True),
        ("sync", "sync", True, True, False),
    ):
        name = f"modes/d_{dm}-c_{cm}{'-zero_copy' if zc else ''}{'-out' if uo else ''}{'-fp8' if f8 else ''}"
        cases.append(Case(name, P(c_modes, dmode=dm, cmode=cm, zero_copy=zc, use_out=uo, fp8=f8)))
    cases += [
        Case("modes/zero_copy_halves", c_zero_copy_halves),
    ]
    return cases


# --- bad input ----------------------------------------------------------------------------


def dispatch_args(r: Round) -> dict:
    ins = r.ins[r.me]
    return dict(
        x=ins.x,
        topk_idx=ins.idx,
        active_ranks=None,
        num_max_dispatch_tokens_per_rank=r.spec.T,
        num_experts=r.E,
        timeout_us=r.spec.timeout_us,
        use_fp8=r.spec.fp8,
    )


def combine_args(r: Round, y: torch.Tensor) -> dict:
    ins = r.ins[r.me]
    return dict(
        x=y, topk_idx=ins.idx, topk_weights=ins.w, active_ranks=None, timeout_us=-1, handle=r.handle
    )


@dataclass(frozen=True)
class Bad:
    """A bad argument: ``mutate(args, extra, ctx)`` breaks the call's arguments on a bad
    rank (``args["buf"]``: another Buffer to call); ``prepare(ctx)`` runs on every rank
    first (collective set-up) and returns ``extra``. The bad rank's ValueError must name
    every one of ``words``."""

    name: str
    op: str  # dispatch | combine
    mutate: object
    words: tuple
    min_world: int = 1
    prepare: object = None
    one_rank: bool = True


def _set(**kw):
    def mutate(args, extra, ctx):
        args.update(kw)

    return mutate


def _other_buffer(ctx):
    """A second Buffer (collective) and a finished dispatch of it."""
    from mooncake.mooncake_ep_buffer import Buffer

    if "other" not in _state:
        _state["other"] = Buffer(dist.group.WORLD)
    r = Round(ctx, _state["other"], SMALL, "other")
    r.dispatch()
    return {"handle": r.handle}


def _small_buffer(ctx):
    """A Buffer with exactly the workspace SMALL needs."""
    from mooncake.mooncake_ep_buffer import Buffer

    if "small" not in _state:
        R = ctx.world_size
        nbytes = Buffer.get_ep_buffer_size_hint(SMALL.T, SMALL.H, R, SMALL.epr * R)
        _state["small"] = Buffer(dist.group.WORLD, nbytes)
    return {"small": _state["small"]}


def _m(fn):
    """A mutation computed from the current arguments: ``fn(args, extra, ctx) -> dict``."""

    def mutate(args, extra, ctx):
        args.update(fn(args, extra, ctx))

    return mutate


def _other_expert(args, extra, ctx):
    idx = args["topk_idx"].clone()
    idx[0, 0] = (int(idx[0, 0]) + 1) % (SMALL.epr * ctx.world_size) if idx[0, 0] >= 0 else 0
    return {"topk_idx": idx}


DISPATCH_BAD = [
    Bad(
        "num_experts_not_divisible",
        "dispatch",
        _m(lambda a, e, c: {"num_experts": a["num_experts"] + 1}),
        ("num_experts", "divisible"),
        2,
    ),
    Bad(
        "tokens_over_T",
        "dispatch",
        _m(lambda a, e, c: {"num_max_dispatch_tokens_per_rank": a["x"].shape[0] - 1}),
        ("num_max_dispatch_tokens_per_rank", "3 tokens"),
    ),
    Bad(
        "fp8_hidden_not_128",
        "dispatch",
        _m(lambda a, e, c: {"x": a["x"][:, :100].contiguous(), "use_fp8": True}),
        ("hidden", "100", "128", "use_fp8"),
    ),
    Bad(
        "expert_id_too_big",
        "dispatch",
        _m(lambda a, e, c: {"topk_idx": a["topk_idx"].clone().fill_(a["num_experts"])}),
        lambda c: (
            "topk_idx",
            f"expert {SMALL.epr * c.world_size};",
            f"[0, {SMALL.epr * c.world_size})",
        ),
    ),
    Bad(
        "expert_id_below_minus_1",
        "dispatch",
        _m(
            lambda a, e, c: {
                "topk_idx": a["topk_idx"].clone().index_fill_(0, torch.tensor([1]), -2)
            }
        ),
        ("topk_idx", "-2"),
    ),
    Bad(
        "x_int", "dispatch", _m(lambda a, e, c: {"x": a["x"].to(torch.int32)}), ("x must", "int32")
    ),
    Bad(
        "x_not_tensor", "dispatch", _m(lambda a, e, c: {"x": a["x"].tolist()}), ("x must", "tensor")
    ),
    Bad("x_1d", "dispatch", _m(lambda a, e, c: {"x": a["x"][0]}), ("x must", "dimensions")),
    Bad(
        "topk_idx_float",
        "dispatch",
        _m(lambda a, e, c: {"topk_idx": a["topk_idx"].float()}),
        ("topk_idx", "float32"),
    ),
    Bad(
        "topk_idx_rows",
        "dispatch",
        _m(lambda a, e, c: {"topk_idx": a["topk_idx"][:-1]}),
        ("topk_idx", "row"),
    ),
    Bad(
        "active_ranks_int64",
        "dispatch",
        _m(lambda a, e, c: {"active_ranks": torch.ones(c.world_size, dtype=torch.int64)}),
        ("active_ranks", "int64"),
    ),
    Bad(
        "active_ranks_length",
        "dispatch",
        _m(lambda a, e, c: {"active_ranks": torch.ones(c.world_size + 1, dtype=torch.int32)}),
        ("active_ranks", "shape"),
    ),
    Bad(
        "async_and_hook",
        "dispatch",
        _set(async_finish=True, return_recv_hook=True),
        ("async_finish", "return_recv_hook"),
    ),
    Bad("timeout_0", "dispatch", _set(timeout_us=0), ("timeout_us", "0")),
    Bad("timeout_minus_5", "dispatch", _set(timeout_us=-5), ("timeout_us", "-5")),
    Bad("timeout_float", "dispatch", _set(timeout_us=1.5e6), ("timeout_us",)),
    Bad(
        "T_float",
        "dispatch",
        _set(num_max_dispatch_tokens_per_rank=8.0),
        ("num_max_dispatch_tokens_per_rank",),
    ),
    Bad("use_fp8_int", "dispatch", _set(use_fp8=1), ("use_fp8",)),
    Bad(
        "stats_dtype",
        "dispatch",
        _m(
            lambda a, e, c: {
                "cumulative_local_expert_recv_stats": torch.zeros(SMALL.epr, dtype=torch.int64)
            }
        ),
        ("cumulative_local_expert_recv_stats", "int64"),
    ),
    Bad(
        "stats_shape",
        "dispatch",
        _m(
            lambda a, e, c: {
                "cumulative_local_expert_recv_stats": torch.zeros(SMALL.epr + 1, dtype=torch.int32)
            }
        ),
        ("cumulative_local_expert_recv_stats", "shape"),
    ),
    Bad(
        "buffer_bytes_too_small",
        "dispatch",
        _m(lambda a, e, c: {"buf": e["small"], "num_max_dispatch_tokens_per_rank": SMALL.T + 1}),
        ("num_ep_buffer_bytes", "get_ep_buffer_size_hint"),
        prepare=_small_buffer,
    ),
    Bad(
        "buffer_bytes_too_small_hidden",
        "dispatch",
        _m(lambda a, e, c: {"buf": e["small"], "x": torch.ones(3, 256, dtype=torch.bfloat16)}),
        ("num_ep_buffer_bytes", "hidden=256"),
        prepare=_small_buffer,
    ),
]

COMBINE_BAD = [
    Bad("x_shape", "combine", _m(lambda a, e, c: {"x": a["x"][:, :, :-1]}), ("x must", "shape")),
    Bad(
        "x_int",
        "combine",
        _m(lambda a, e, c: {"x": a["x"].nan_to_num().to(torch.int16)}),
        ("x must", "int16"),
    ),
    Bad(
        "topk_weights_int",
        "combine",
        _m(lambda a, e, c: {"topk_weights": a["topk_weights"].to(torch.int64)}),
        ("topk_weights", "int64"),
    ),
    Bad(
        "topk_weights_shape",
        "combine",
        _m(lambda a, e, c: {"topk_weights": a["topk_weights"][:, :1]}),
        ("topk_weights", "shape"),
    ),
    Bad("topk_idx_differs", "combine", _m(_other_expert), ("topk_idx", "differs")),
    Bad(
        "topk_idx_float",
        "combine",
        _m(lambda a, e, c: {"topk_idx": a["topk_idx"].float()}),
        ("topk_idx", "float32"),
    ),
    Bad(
        "handle_other_buffer",
        "combine",
        _m(lambda a, e, c: {"handle": e["handle"]}),
        ("handle", "another buffer"),
        prepare=_other_buffer,
    ),
    Bad(
        "handle_foreign_tuple",  # a copy of the handle is taken (buffer/upstream)
        "combine",
        _m(lambda a, e, c: {"handle": (a["handle"][0].clone(), *a["handle"][1:])}),
        ("handle", "tuple"),
    ),
    Bad("handle_none", "combine", _set(handle=None), ("handle", "nonetype")),
    Bad(
        "zero_copy_not_buffer",
        "combine",
        _m(lambda a, e, c: {"x": a["x"].clone(), "zero_copy": True}),
        ("zero_copy", "get_next_combine_buffer"),
    ),
    Bad(
        "active_ranks_int64",
        "combine",
        _m(lambda a, e, c: {"active_ranks": torch.ones(c.world_size, dtype=torch.int64)}),
        ("active_ranks", "int64"),
    ),
    Bad(
        "active_ranks_length",
        "combine",
        _m(lambda a, e, c: {"active_ranks": torch.ones(c.world_size + 2, dtype=torch.int32)}),
        ("active_ranks", "shape"),
    ),
    Bad(
        "async_and_hook",
        "combine",
        _set(async_finish=True, return_recv_hook=True),
        ("async_finish", "return_recv_hook"),
    ),
    Bad("timeout_0", "combine", _set(timeout_us=0), ("timeout_us",)),
    Bad("timeout_minus_5", "combine", _set(timeout_us=-5), ("timeout_us", "-5")),
    Bad(
        "out_shape",
        "combine",
        _m(lambda a, e, c: {"out": torch.empty(2, SMALL.H, dtype=torch.bfloat16)}),
        ("out", "shape"),
    ),
    Bad(
        "out_dtype",
        "combine",
        _m(lambda a, e, c: {"out": torch.empty(3, SMALL.H, dtype=torch.float32)}),
        ("out", "float32"),
    ),
    Bad(
        "x_other_float_dtype",
        "combine",
        _m(lambda a, e, c: {"x": a["x"].float()}),
        ("x", "bfloat16"),
    ),
]


def _call(buf, op, args):
    args = dict(args)
    b = args.pop("buf", buf)
    return getattr(b, op)(**args)


def c_bad(ctx, bad: Bad, index: int, peer_words=None):
    """Bad input on every rank, then on one rank only: ValueError on every rank (the bad
    rank's names the argument; the others' says which rank rejected its arguments);
    after each, a verified round shows the group still works."""
    buf, R = get_buffer(ctx), ctx.world_size
    variants = [("all", set(range(R)))]
    if R > 1 and bad.one_rank:
        variants.append(("one", {index % R}))
    for label, bad_ranks in variants:
        extra = bad.prepare(ctx) if bad.prepare else {}
        r = Round(ctx, buf, SMALL, f"{label}/call")
        if bad.op == "dispatch":
            args = dispatch_args(r)
        else:
            r.dispatch()
            args = combine_args(r, r.expert_outputs())
        if ctx.rank in bad_ranks:
            bad.mutate(args, extra, ctx)
            words = bad.words(ctx) if callable(bad.words) else bad.words
            expect_value_error(
                ctx, functools.partial(_call, buf, bad.op, args), words, f"{label}: bad rank"
            )
        else:
            (b,) = bad_ranks
            words = (
                peer_words
                if peer_words is not None
                else ((f"rank {b} ", "rejected") if bad.op == "dispatch" else ())
            )
            expect_value_error(
                ctx,
                functools.partial(_call, buf, bad.op, args),
                words,
                f"{label}: peer of rank {b}",
            )
        good_round(ctx, f"{label}/after")


def c_disagree(ctx, field_: str):
    """Valid arguments that disagree across ranks (rank 0 differs): ValueError on every
    rank naming the disagreement; the group goes on."""
    buf = get_buffer(ctx)
    r = Round(ctx, buf, SMALL, "call")
    args = dispatch_args(r)
    if ctx.rank == 0:
        if field_ == "T":
            args["num_max_dispatch_tokens_per_rank"] += 1
        elif field_ == "H":
            args["x"] = torch.ones(3, 256, dtype=torch.bfloat16)
        elif field_ == "fp8":
            args["use_fp8"] = True
        elif field_ == "E":
            args["num_experts"] *= 2
            args["topk_idx"] = args["topk_idx"].clone()
    expect_value_error(
        ctx,
        functools.partial(_call, buf, "dispatch", args),
        ("disagree on the call",),
        f"disagree on {field_}",
    )
    good_round(ctx)


def c_corrupt_counts(ctx):
    """Rank 1's counts row for rank 0 arrives corrupt (more than T tokens for an
    expert): rank 0 alone can see it, and every rank's dispatch fails, rank 0's with
    RuntimeError naming rank 1, the others' with ValueError naming rank 0 and why; the
    group goes on."""
    buf = get_buffer(ctx)
    r = Round(ctx, buf, SMALL, "corrupt")
    args = dispatch_args(r)
    members = buf._portable.members
    if ctx.rank == 1:
        exchange = members.all_to_all

        def corrupting(device, out, inp, out_splits, in_splits, timeout_us):
            members.all_to_all = exchange  # once: the counts exchange of this call
            inp = inp.clone()
            from mooncake.ep import portable_rows

            inp[0, portable_rows.META_COLS] = args["num_max_dispatch_tokens_per_rank"] + 5
            return exchange(device, out, inp, out_splits, in_splits, timeout_us)

        members.all_to_all = corrupting
    call = functools.partial(_call, buf, "dispatch", args)
    if ctx.rank == 0:
        try:
            call()
            ctx.fail("corrupt counts: rank 0 raised nothing")
        except RuntimeError as e:
            ctx.expect("rank 1" in str(e) and "corrupt" in str(e), f"rank 0: {e}")
    else:
        expect_value_error(ctx, call, ("rank 0", "corrupt"), f"rank {ctx.rank}")
    members.__dict__.pop("all_to_all", None)
    good_round(ctx, "after_corrupt")


def c_bad_one_rank_experts_width(ctx):
    """One rank passes a num_experts whose E // R differs from the others' (so its counts
    row is wider): the others must still be told that this rank rejected its arguments."""
    buf, R = get_buffer(ctx), ctx.world_size
    for bad_e in (2 * SMALL.epr * R + 1, 1, 0):
        r = Round(ctx, buf, SMALL, f"E{bad_e}")
        args = dispatch_args(r)
        if ctx.rank == R - 1:
            args["num_experts"] = bad_e
            expect_value_error(
                ctx,
                functools.partial(_call, buf, "dispatch", args),
                ("num_experts",),
                f"E={bad_e}: bad rank",
            )
        else:
            expect_value_error(
                ctx,
                functools.partial(_call, buf, "dispatch", args),
                (f"rank {R - 1} ", "rejected"),
                f"E={bad_e}: peer of rank {R - 1}",
            )
        good_round(ctx, f"after{bad_e}")


def c_duplicates_over_capacity(ctx):
    """Every rank selects expert 0 twice for each of its T tokens: 2RT rows for a local
    expert whose recv_x holds R*T. Expected: a ValueError on every rank (before anything
    is sent), and the group goes on."""
    buf, R = get_buffer(ctx), ctx.world_size
    T = 4
    x = torch.ones(T, 128, dtype=torch.bfloat16)
    idx = torch.zeros(T, 2, dtype=torch.int64)
    expect_value_error(
        ctx, lambda: buf.dispatch(x, idx, None, T, 2 * R, -1, use_fp8=False), (), "2RT rows"
    )
    good_round(ctx)


def c_combine_peers_told(ctx, bad: Bad):
    """Bad combine arguments on one rank: the others' ValueError says a rank rejected its
    arguments (not an all_to_all detail)."""
    c_bad(ctx, replace(bad, one_rank=True), ctx.world_size - 1, peer_words=("rejected",))


def c_not_finished(ctx, mode: str):
    """combine and get_next_combine_buffer before the dispatch's hook()/event ran:
    ValueError on every rank; afterwards the same handle combines correctly."""
    buf = get_buffer(ctx)
    r = Round(ctx, buf, Spec(K=3, ns=(4, 2)))
    ins = r.ins[ctx.rank]
    out = buf.dispatch(ins.x, ins.idx, None, r.spec.T, r.E, -1, use_fp8=False, **mode_flags(mode))
    r.recv_x, r.count, r.handle, event, hook = out
    r.before = None
    y = torch.zeros(r.spec.epr, ctx.world_size * r.spec.T, r.spec.H, dtype=torch.bfloat16)
    expect_value_error(
        ctx, lambda: buf.combine(y, ins.idx, ins.w, None, -1, r.handle), ("hook",), "combine first"
    )
    expect_value_error(
        ctx,
        lambda: buf.get_next_combine_buffer(r.handle),
        ("hook",),
        "get_next_combine_buffer first",
    )
    if mode == "hook":
        hook()
    else:
        event.current_stream_wait()
    r.check_dispatch()
    r.combine()
    r.check_combine()


def c_buffer_bad(ctx):
    """Buffer(group, -1), Buffer(group, 1.5), Buffer(group, True), Buffer(non-group):
    ValueError (local checks, on every rank). (A gloo group is a group: see
    ``c_foreign_group``.)"""
    from mooncake.mooncake_ep_buffer import Buffer

    W = dist.group.WORLD
    expect_value_error(
        ctx, lambda: Buffer(W, -1), ("num_ep_buffer_bytes", "-1"), "Buffer(group, -1)"
    )
    expect_value_error(ctx, lambda: Buffer(W, 1.5), ("num_ep_buffer_bytes",), "Buffer(group, 1.5)")
    expect_value_error(
        ctx, lambda: Buffer(W, True), ("num_ep_buffer_bytes",), "Buffer(group, True)"
    )
    expect_value_error(ctx, lambda: Buffer("world", 0), ("group",), "Buffer('world')")
    expect_value_error(ctx, lambda: Buffer(None), ("group",), "Buffer(None)")
    expect_value_error(ctx, lambda: Buffer(pg_backend()), ("group",), "Buffer(backend object)")
    good_round(ctx)


def pg_backend():
    from mooncake import pg

    return pg._backend_of(dist.group.WORLD)


def c_buffer_disagree(ctx):
    """Ranks that construct their Buffer with different num_ep_buffer_bytes: ValueError
    naming it on every rank; the group and the launch's Buffer still work."""
    from mooncake.mooncake_ep_buffer import Buffer

    nbytes = 0 if ctx.rank == 0 else 1 << 20
    expect_value_error(
        ctx, lambda: Buffer(dist.group.WORLD, nbytes), ("disagree", "num_ep_buffer_bytes"), "Buffer"
    )
    good_round(ctx)


def c_small_buffer_enough(ctx):
    """A Buffer sized by get_ep_buffer_size_hint runs the shape it was sized for (and
    smaller ones), correctly."""
    buf = _small_buffer(ctx)["small"]
    Round(ctx, buf, SMALL, "exact").run()
    Round(ctx, buf, replace(SMALL, ns=(1, 0)), "fewer").run()
    Round(ctx, buf, replace(SMALL, fp8=True), "fp8").run()


def bad_cases(world: int) -> list[Case]:
    P = functools.partial
    cases = []
    for i, bad in enumerate(DISPATCH_BAD + COMBINE_BAD):
        if world >= bad.min_world:
            cases.append(Case(f"bad/{bad.op}/{bad.name}", P(c_bad, bad=bad, index=i)))
    cases += [
        Case("bad/dispatch/duplicates_over_capacity", c_duplicates_over_capacity),
        Case("bad/combine/before_hook", P(c_not_finished, mode="hook")),
        Case("bad/combine/before_event", P(c_not_finished, mode="async")),
        Case("bad/buffer/args", c_buffer_bad),
        Case("sizes/buffer_sized_by_hint", c_small_buffer_enough),
    ]
    if world > 1:
        cases += [
            Case("bad/buffer/ranks_disagree", c_buffer_disagree),
            Case("bad/dispatch/disagree_T", P(c_disagree, field_="T")),
            Case("bad/dispatch/disagree_H", P(c_disagree, field_="H")),
            Case("bad/dispatch/disagree_fp8", P(c_disagree, field_="fp8")),
            Case("bad_one_rank/dispatch/disagree_E", P(c_disagree, field_="E")),
            Case("bad_one_rank/dispatch/num_experts_other_width", c_bad_one_rank_experts_width),
            Case("bad_one_rank/dispatch/corrupt_counts", c_corrupt_counts),
            Case(
                "bad_one_rank/combine/peers_told_rejected",
                P(c_combine_peers_told, bad=COMBINE_BAD[4]),
            ),
        ]
    return cases


def ep_cases(world: int) -> list[Case]:
    return route_cases(world) + bad_cases(world)


def c_random(ctx, seed: int):
    """A random shape, dtype, mask and mode (the same on every rank), verified."""
    rng = random.Random(seed)
    R = ctx.world_size
    T = rng.choice([1, 2, 3, 8, 16, 33])
    fp8 = rng.random() < 0.4
    spec = Spec(
        T=T,
        H=rng.choice([128, 256, 384, 1024]) if fp8 else rng.choice([1, 7, 128, 200, 512]),
        K=rng.randint(1, 8),
        epr=rng.randint(1, 4),
        ns=tuple(rng.choice([0, T, rng.randint(0, T)]) for _ in range(R)),
        dtype=torch.bfloat16 if fp8 else rng.choice([torch.bfloat16, torch.float16, torch.float32]),
        fp8=fp8,
        neg=rng.choice([0.0, 0.1, 0.5]),
        dup=rng.choice([0.0, 0.2, 0.8]),
        wdtype=rng.choice([torch.float32, torch.bfloat16]),
        idx_dtype=rng.choice([torch.int64, torch.int32]),
        timeout_us=rng.choice([-1, 20_000_000]),
        strided=rng.random() < 0.2,
    )
    masks = None
    kind = rng.choice(["none", "ones", "out"] if R > 1 else ["none", "ones"])
    if kind == "ones":
        masks = [[1] * R for _ in range(R)]
    elif kind == "out":
        out = rng.randrange(R)
        masks = [[0 if q == out else 1 for q in range(R)] for _ in range(R)]
    modes = ["sync", "async", "with", "hook"]
    r = Round(ctx, get_buffer(ctx), spec, masks=masks)
    r.run(
        rng.choice(modes),
        rng.choice(modes),
        zero_copy=rng.random() < 0.3,
        use_out=rng.random() < 0.3,
    )


def random_cases(world: int, seed: int, count: int) -> list[Case]:
    return [
        Case(f"random/{i}", functools.partial(c_random, seed=seed * 100_003 + i))
        for i in range(count)
    ]


# --- the kill test (ranks of a mooncake.launch.LocalGroup) -----------------------------------

KILL_SPEC = Spec(T=6, H=128, K=3, epr=2, ns=(6, 4, 5, 3), timeout_us=3_000_000)


def _round_record(chk: Checks, r: Round, tag: str, **extra) -> dict:
    rec = {
        "tag": tag,
        "failures": list(chk.failures),
        "dispatch_s": getattr(r, "dispatch_s", None),
        "combine_s": getattr(r, "combine_s", None),
        **extra,
    }
    chk.failures.clear()
    return rec


def _full_round(chk: Checks, buf, tag: str, spec: Spec = KILL_SPEC) -> dict:
    R = chk.world_size
    r = Round(chk, buf, spec, tag, masks=[[1] * R for _ in range(R)])
    r.dispatch()
    r.check_dispatch(must_drop=())
    r.combine()
    r.check_combine()
    return _round_record(chk, r, tag, active=r.act.tolist())


def ep_kill_rank(rank, world_size, port, plan):
    """World 4 (max_world_size 4). Round "full" on every rank; then rank ``victim`` kills
    itself. The survivors (once the parent saw it gone) dispatch with every rank marked
    active and timeout_us = 3 s: the call returns in time with exactly the victim masked,
    no rows from it, and combine skips its experts; a second round passes
    active_ranks=None. A replacement starts; the survivors poll get_peer_state, call
    recover_ranks, then update_ep_member while the replacement constructs its Buffer;
    then a full-strength round on all four (part 1). Then rank ``victim2`` dies at a random
    moment of a sequence of rounds (a timer armed in round ``arm_round``); the
    survivors mask exactly it and every round stays correct (part 2). Then rank
    ``victim3`` dies right after its dispatch of round ``arm3``: the survivors' combine
    of that round leaves its experts out, and it is masked from then on (part 3). Last,
    of the two left, the parent stops the higher one (SIGSTOP): the other's dispatch
    (timeout_us = 3 s) masks it; resumed, its own next dispatch raises LeftOutError
    (a RuntimeError; left out) (part 4).

    Returns ``{"rounds": [...], "active": ...}``; each round record lists the failed
    expectations (empty: correct)."""
    from ft_ranks import kill_self_after, start_rank
    from mooncake import pg
    from mooncake.mooncake_ep_buffer import Buffer

    joiner = plan["role"] == "joiner"
    victim, victim2 = plan["victim"], plan["victim2"]
    chk = Checks(rank, world_size, "kill")
    out = {"rounds": [], "role": plan["role"]}
    if joiner:
        _, store = start_rank(
            rank,
            world_size,
            port,
            barrier=False,  # the healthy ranks are in the group already
            timeout_s=plan["timeout_s"],
            max_world_size=world_size,
            is_extension=True,
        )
        W = dist.group.WORLD
        pg.join_group(W)
        buf = Buffer(W)
    else:
        _, store = start_rank(
            rank, world_size, port, timeout_s=plan["timeout_s"], max_world_size=world_size
        )
        W = dist.group.WORLD
        buf = Buffer(W)
        out["rounds"].append(_full_round(chk, buf, "before"))
        if rank == victim:
            store.set("dying", "1")
            os.kill(os.getpid(), signal.SIGKILL)
        while not store.check(["dead"]):
            time.sleep(0.005)
        # The victim is gone: dispatch with it marked active, a 3 s deadline.
        R = world_size
        r = Round(chk, buf, KILL_SPEC, "after_death", masks=[[1] * R for _ in range(R)])
        r.dispatch()
        r.check_dispatch(must_drop=(victim,))
        from_victim = (r.handle.layout_range[:, victim] & 0xFFFFFFFF).tolist()
        chk.expect(not any(from_victim), f"rows from the dead rank: {from_victim}")
        r.combine()
        r.check_combine()
        out["rounds"].append(_round_record(chk, r, "after_death", active=r.act.tolist()))
        r2 = Round(chk, buf, KILL_SPEC, "after_death_none", masks=None)
        r2.dispatch()
        r2.check_dispatch(may_drop=(victim,))
        r2.combine()
        r2.check_combine(may_drop=(victim,))
        out["rounds"].append(_round_record(chk, r2, "after_death_none", pg=pg_view(R)))
        from ft_ranks import admit

        out["polls"] = admit(W, [victim])
        buf.update_ep_member()
    out["rounds"].append(_full_round(chk, buf, "rejoined"))
    out["pg_after_rejoin"] = pg_view(world_size)

    # Part 2: a death at a random moment of a sequence of rounds.
    R = world_size
    act = torch.ones(R, dtype=torch.int32)
    n_rounds = plan["arm_round"] + plan["rounds_after"]
    i = 0
    while rank == victim2 or i < n_rounds:
        if rank == victim2 and i == plan["arm_round"]:
            store.set("armed", "1")
            kill_self_after(plan["delay_s"])
        r = Round(chk, buf, KILL_SPEC, f"seq{i}", act=act)
        r.dispatch()
        r.check_dispatch(may_drop=(victim2,))
        r.combine()
        r.check_combine(may_drop=(victim2,))
        out["rounds"].append(_round_record(chk, r, f"seq{i}", active=act.tolist()))
        i += 1
        if rank == victim2 and i > n_rounds + 200:
            raise RuntimeError("the victim was not killed")
    out["after_seq"] = act.tolist()

    # Part 3: rank ``victim3`` dies between its dispatch and its combine.
    victim3 = plan["victim3"]
    for i in range(plan["arm3"] + 3):
        r = Round(chk, buf, KILL_SPEC, f"tail{i}", act=act)
        r.dispatch()
        if rank == victim3 and i == plan["arm3"]:
            store.set("armed3", "1")
            os.kill(os.getpid(), signal.SIGKILL)
        r.check_dispatch(may_drop=(victim3,))
        r.combine()
        r.check_combine(may_drop=(victim3,))
        out["rounds"].append(_round_record(chk, r, f"tail{i}", active=act.tolist()))
    out["active"] = act.tolist()
    out["pg"] = pg_view(R)

    # Part 4: of the last two, the parent stops (SIGSTOP) the higher rank; the other's
    # dispatch with timeout_us = 3 s returns in time with it masked (the group leaves it
    # out); resumed, the stopped rank learns from its next dispatch that it was left out.
    last = [q for q in range(R) if act[q]]
    store.set(f"p4ready/{rank}", "1")
    if rank == last[-1]:
        _wait_store(store, "p4done")
        # What the EP device path looks at before every launch (one load): the group's
        # note, in this process's segment, that it was left out.
        out["left_out_flag"] = pg._backend_of(W).left_out()
        t0 = time.monotonic()
        r = Round(chk, buf, KILL_SPEC, "stopped_self", act=act)
        try:
            r.dispatch()
            out["stopped"] = ("ok", act.tolist(), time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - reported
            took = time.monotonic() - t0
            out["stopped"] = (type(e).__name__, str(e)[:300], took, getattr(e, "ranks", None))
        return out
    _wait_store(store, "stopped")
    r = Round(chk, buf, KILL_SPEC, "stopped_peer", act=act)
    r.dispatch()
    r.check_dispatch(must_drop=(last[-1],))
    r.combine()
    r.check_combine()
    out["rounds"].append(_round_record(chk, r, "stopped_peer", active=act.tolist()))
    out["pg_stopped"] = pg_view(R)
    out["left_out_flag"] = pg._backend_of(W).left_out()
    store.set("p4done", "1")
    return out


def _wait_store(store, key: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"store key {key} not set")
        time.sleep(0.005)


# --- a late rank beside a silent one (issue 15; a mooncake.launch.LocalGroup) ---------------

SILENT_SPEC = Spec(T=6, H=128, K=3, epr=2, ns=(6, 4, 5), timeout_us=2_500_000)


def _slow_between_exchanges(seconds: float) -> None:
    """Makes this process's dispatches spend ``seconds`` between the counts and the tokens
    exchange (in packing the tokens), as a loaded host would."""
    from mooncake.ep import portable_rows

    pack = portable_rows.pack_tokens

    def slow_pack(*args, **kwargs):
        time.sleep(seconds)
        return pack(*args, **kwargs)

    portable_rows.pack_tokens = slow_pack


def ep_silent_rank(rank, world_size, port, plan):
    """World 3. A full round; then rank 2 stays alive but skips a round, and rank 1 calls
    ``stagger_s`` after rank 0 and spends ``between_s`` between the two exchanges (both
    well inside one timeout_us). The group leaves rank 2 out at the counts exchange's
    deadline; the tokens exchange then has the whole timeout_us of its own, so rank 1,
    late but within each phase's budget, is not masked: both end the round with
    active_ranks [1, 1, 0], rows and combine exact for {0, 1}, and go on. Rank 2, once
    they are done, learns from its next dispatch that it was left out (LeftOutError).

    Returns ``{"rounds": [...], ...}``; each round record lists the failed expectations."""
    from ft_ranks import start_rank

    chk = Checks(rank, world_size, "silent")
    _, store = start_rank(rank, world_size, port, timeout_s=plan["timeout_s"])
    from mooncake.mooncake_ep_buffer import Buffer

    buf = Buffer(dist.group.WORLD)
    out = {"rounds": [_full_round(chk, buf, "before", SILENT_SPEC)]}
    store.set(f"ready/{rank}", "1")
    for r in range(world_size):
        _wait_store(store, f"ready/{r}")
    if rank == 2:  # silent until both others have returned from the round
        _wait_store(store, "done/0")
        _wait_store(store, "done/1")
        t0 = time.monotonic()
        try:
            _full_round(chk, buf, "silent_self", SILENT_SPEC)
            out["silent"] = ("ok", "", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - reported
            took = time.monotonic() - t0
            out["silent"] = (type(e).__name__, str(e)[:300], took, getattr(e, "ranks", None))
        return out
    if rank == 1:
        _slow_between_exchanges(plan["between_s"])
        time.sleep(plan["stagger_s"])
    R = world_size
    act = torch.ones(R, dtype=torch.int32)
    r = Round(chk, buf, SILENT_SPEC, "late", act=act)
    try:
        r.dispatch()
        r.check_dispatch(must_drop=(2,))
        r.combine()
        r.check_combine()
    except Exception as e:  # noqa: BLE001 - reported
        chk.fail(f"raised {type(e).__name__}: {str(e)[:300]}")
        out["rounds"].append(_round_record(chk, r, "late", active=act.tolist(), pg=None))
        return out
    finally:
        store.set(f"done/{rank}", "1")  # rank 2's silence ends
    out["rounds"].append(_round_record(chk, r, "late", active=act.tolist(), pg=pg_view(R)))
    r = Round(chk, buf, SILENT_SPEC, "after", act=act)
    r.run()
    out["rounds"].append(_round_record(chk, r, "after", active=act.tolist()))
    return out
