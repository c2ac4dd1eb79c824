"""A verified round of the ElasticBuffer (``mooncake.mooncake_elastic_buffer``): dispatch,
cached dispatches, experts, combine, each checked against ``ht_model`` (plain Python).

Inputs identify themselves: token ``t`` of rank ``r`` has ``x[t, 0] = r`` and ``x[t, 1]
= t`` (small integers elsewhere); received rows must equal the source's rows bit for bit
(pre-quantised FP8 data and scales too). The experts here are the caller's: without
expanding, each received token's ``sum over its local slots of weight * row * (j % 3 +
1)`` (``j`` its local expert) in fp32, slot by slot; expanded, each row's ``weight * row
* (j % 3 + 1)``. The model computes the same per token from the source's inputs, and
the combine the documented way (fp32, slot by slot in top-k order, one rounding), so the
combined tokens must match bit for bit. Rows the experts must not read (padding, rows
past the valid ones) are filled with garbage, which combine must ignore.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

import ht_model as model
from ep_cases import seed_for

BLOCK = 128


@dataclass(frozen=True)
class HSpec:
    """The shape of one round; every rank builds every rank's inputs from it."""

    T: int = 6
    H: int = 128
    K: int = 3
    epr: int = 2  # local experts per rank (E = epr * R)
    ns: tuple = (5,)  # tokens of rank r: ns[r % len(ns)]
    dtype: torch.dtype = torch.bfloat16
    fp8: str = ""  # "": plain x; "f32": (data, fp32 scales per 128); "odd": those, strided;
    #                "i32": (data, packed int32 words [N, H/512])
    weights: bool = True
    neg: float = 0.2  # share of -1 selections
    idx_dtype: torch.dtype = torch.int64
    expand: bool = False
    align: int = 1
    sync: bool = True
    cached: int = 0  # cached dispatches (and combines) after the fresh one
    strided: bool = False  # x a non-contiguous view
    offset: bool = False  # x a contiguous view at an odd place of its storage
    cdtype: torch.dtype | None = None  # the experts' output dtype (None: x's, bf16 for FP8)
    combine_weights: bool = True
    trim: bool = False  # combine's x (and weights) trimmed to the valid rows, as upstream's callers
    numpy_ints: bool = False  # the int arguments as numpy ints, as an engine reads them from arrays

    def n_of(self, rank: int) -> int:
        return self.ns[rank % len(self.ns)]

    def out_dtype(self) -> torch.dtype:
        return self.cdtype or (torch.bfloat16 if self.fp8 else self.dtype)


def fit(spec: HSpec, world: int) -> HSpec:
    """``spec`` with enough experts for K distinct ones per token."""
    return replace(spec, epr=max(spec.epr, -(-spec.K // world)))


@dataclass
class Inputs:
    x: torch.Tensor  # [n, H] float (what the experts read)
    x_in: object  # what dispatch gets: x, or (data, scales)
    idx: torch.Tensor
    w: torch.Tensor | None
    idx_list: list


def make_inputs(seed: int, rank: int, spec: HSpec, R: int, tag: str = "") -> Inputs:
    n, H, K, E = spec.n_of(rank), spec.H, spec.K, spec.epr * R
    g = torch.Generator().manual_seed(seed_for(seed, rank, tag))
    x = torch.randint(-4, 5, (n, H), generator=g).float()
    if H >= 2:
        x[:, 0], x[:, 1] = rank, torch.arange(n)
    if n:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    else:
        idx = torch.zeros(0, K, dtype=torch.int64)
    idx[torch.rand(n, K, generator=g) < spec.neg] = -1
    sign = torch.randint(0, 2, (n, K), generator=g) * 2 - 1
    w = (2.0 ** torch.randint(-1, 2, (n, K), generator=g).float() * sign) if spec.weights else None
    x = x.to(spec.dtype)
    x_in = x
    if spec.fp8 in ("f32", "odd"):
        from mooncake import fp8

        data, scales = fp8.quantize(x)
        if spec.fp8 == "odd":  # column-major scales, and data every other row of a buffer
            scales = scales.t().contiguous().t()
            wide = torch.zeros(2 * n, H, dtype=data.dtype)
            wide[::2] = data
            data = wide[::2]
        x_in = (data, scales)
    elif spec.fp8 == "i32":
        data = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        words = torch.randint(-(2**31), 2**31 - 1, (n, max(1, H // 512)), generator=g)
        x_in = (data, words.to(torch.int32))
    elif spec.strided:
        wide = torch.full((n, 2 * H), 99.0, dtype=spec.dtype)
        wide[:, ::2] = x
        x_in = wide[:, ::2]
    elif spec.offset:  # 3 elements into its storage: rows not 8-byte aligned
        flat = torch.full((n * H + 3,), 99.0, dtype=spec.dtype)
        flat[3:] = x.flatten()
        x_in = flat[3:].view(n, H)
    return Inputs(x, x_in, idx.to(spec.idx_dtype), w, idx.tolist())


def as_rows(recv) -> torch.Tensor:
    """Received rows as fp32, as the experts read them (FP8: dequantised with fp32 scales;
    packed scales are not read)."""
    if isinstance(recv, tuple):
        data, scales = recv
        if scales.dtype == torch.float32:
            return data.float() * scales.repeat_interleave(BLOCK, dim=1)
        return data.float()
    return recv.float()


def expert(rows: torch.Tensor, j: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w * row * (j % 3 + 1)`` per row (fp32)."""
    return rows * w.unsqueeze(1) * (j % 3 + 1).float().unsqueeze(1)


def token_outputs(rows: torch.Tensor, local: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per token, fp32, slot by slot: the sum over its local slots of ``expert``."""
    acc = torch.zeros_like(rows)
    for k in range(local.shape[1]):
        j = local[:, k].long()
        acc += torch.where((j >= 0).unsqueeze(1), expert(rows, j.clamp_min(0), w[:, k]), 0.0)
    return acc


def _pick(t, i):
    return (t[0][i], t[1][i]) if isinstance(t, tuple) else t[i]


class HRound:
    """One dispatch (+ cached ones) and combine on every rank, checked against the model.

    ``may_drop``: ranks the calls may mask (they die); the model then follows the
    buffer's ``active_ranks`` after each call, which every survivor shares."""

    def __init__(self, ctx, buf, spec: HSpec, tag: str = "", may_drop=()):
        spec = fit(spec, ctx.world_size)
        self.ctx, self.buf, self.spec = ctx, buf, spec
        self.R, self.me = ctx.world_size, ctx.rank
        self.E = spec.epr * self.R
        self.what = tag or "round"
        self.seed = seed_for(ctx.case, tag)
        self.ins = [make_inputs(self.seed, r, spec, self.R) for r in range(self.R)]
        self.may_drop = set(may_drop)
        self.active = buf.active_ranks.tolist()
        self.masked_in = ""  # the call that masked a rank, if one did

    # --- who takes part ---

    def _after(self, what: str) -> list[int]:
        now = self.buf.active_ranks.tolist()
        raised = [q for q in range(self.R) if now[q] and not self.active[q]]
        dropped = {q for q in range(self.R) if self.active[q] and not now[q]}
        self.ctx.expect(not raised, f"{what}: unmasked ranks {raised}")
        self.ctx.expect(
            dropped <= self.may_drop,
            f"{what}: masked {sorted(dropped)} (active_ranks {now}); only "
            f"{sorted(self.may_drop)} may be",
        )
        self.dropped_now = dropped
        if dropped:
            self.masked_in = what
        self.active = now
        return now

    def link(self, s: int, d: int) -> bool:
        return bool(self.active[s] and self.active[d])

    # --- dispatch ---

    def dispatch(self, handle=None, ins=None):
        spec = self.spec
        ins = ins or self.ins
        mine = ins[self.me]
        t0 = time.monotonic()
        E, T, align = self.E, spec.T, spec.align
        if spec.numpy_ints:
            E, T, align = np.int64(E), np.int32(T), np.int64(align)
        if handle is None:
            out = self.buf.dispatch(
                mine.x_in, mine.idx, mine.w, num_experts=E, num_max_tokens_per_rank=T,
                expert_alignment=align, do_expand=spec.expand, do_cpu_sync=spec.sync,
            )  # fmt: skip
        else:
            out = self.buf.dispatch(mine.x_in, topk_weights=mine.w, handle=handle)
        self.dispatch_s = time.monotonic() - t0
        self.recv, self.recv_idx, self.recv_w, h, event = out
        self.ctx.expect(handle is None or h is handle, "a cached dispatch returned another handle")
        self.handle = h
        event.current_stream_wait()
        self._after(f"{self.what}: dispatch")
        return out

    def check_dispatch(self, ins=None, cached=False):
        ctx, spec, R, me, E = self.ctx, self.spec, self.R, self.me, self.E
        ins = ins or self.ins
        what = f"{self.what}: {'cached ' if cached else ''}dispatch"
        K, T, A = spec.K, spec.T, spec.align
        if not cached:
            self.rec = model.receive([i.idx_list for i in ins], R, E, me, A, self.link)
        rec = self.rec
        m = len(rec.tokens)
        alive = [int(self.active[s]) for s, _ in rec.tokens]
        rows = m if spec.sync else R * T
        h = self.handle
        ctx.expect(
            h.num_recv_tokens == rows, f"{what}: num_recv_tokens {h.num_recv_tokens} != {rows}"
        )
        # recv_topk_idx
        want_idx = torch.full((rows, K), -1, dtype=spec.idx_dtype)
        for i, local in enumerate(rec.local):
            if alive[i]:
                want_idx[i] = torch.tensor(local)
        ctx.expect_equal(self.recv_idx, want_idx, f"{what}: recv_topk_idx")
        # recv_x (and scales) and weights
        n_rows = rows
        placed = [(i, -1) for i in range(m)]
        if spec.expand:
            n_rows = sum(rec.padded) if spec.sync else model.worst_expanded(R, T, K, spec.epr, A)
            placed = rec.expanded
        ctx.expect(
            (h.num_expanded_tokens if spec.expand else h.num_recv_tokens) == n_rows,
            f"{what}: the handle's row count is not {n_rows}",
        )
        first = ins[me].x_in
        want = self._zeros(first, n_rows)
        want_w = torch.zeros((n_rows,) if spec.expand else (n_rows, K)) if spec.weights else None
        for r, item in enumerate(placed):
            if item is None:
                continue
            i, k = item
            s, t = rec.tokens[i]
            if not alive[i]:
                continue
            src = _pick(ins[s].x_in, t)
            if isinstance(want, tuple):
                want[0][r], want[1][r] = src[0], src[1]
            else:
                want[r] = src
            if want_w is not None:
                want_w[r] = ins[s].w[t][k] if spec.expand else ins[s].w[t]
        if isinstance(want, tuple):
            ok = isinstance(self.recv, tuple) and len(self.recv) == 2
            ctx.expect(ok, f"{what}: recv_x is not a (data, scales) pair")
            if ok:
                ctx.expect_equal(self.recv[0].view(torch.uint8), want[0].view(torch.uint8),
                                 f"{what}: recv_x data")  # fmt: skip
                ctx.expect_equal(self.recv[1], want[1], f"{what}: recv_x scales")
                ctx.expect(self.recv[1].is_contiguous(), f"{what}: scales not contiguous")
        else:
            ctx.expect_equal(self.recv, want, f"{what}: recv_x")
        if want_w is None:
            ctx.expect(self.recv_w is None, f"{what}: recv_topk_weights without topk_weights")
        else:
            ctx.expect_equal(self.recv_w, want_w, f"{what}: recv_topk_weights")
        if not cached:
            self._check_handle(rec, rows, what)

    @staticmethod
    def _zeros(first, n):
        if isinstance(first, tuple):
            return (torch.zeros(n, first[0].shape[1], dtype=first[0].dtype),
                    torch.zeros(n, first[1].shape[1], dtype=first[1].dtype))  # fmt: skip
        return torch.zeros(n, first.shape[1], dtype=first.dtype)

    def _check_handle(self, rec, rows, what):
        ctx, spec, R, me, h = self.ctx, self.spec, self.R, self.me, self.handle
        K, T = spec.K, spec.T
        i32 = torch.int32
        ctx.expect(
            (h.do_expand, h.num_experts, h.expert_alignment, h.num_max_tokens_per_rank)
            == (spec.expand, self.E, spec.align, T),
            f"{what}: handle fields {(h.do_expand, h.num_experts, h.expert_alignment)}",
        )
        ctx.expect_equal(h.topk_idx, self.ins[me].idx, f"{what}: handle.topk_idx")
        idx = self.ins[me].idx
        ctx.expect(
            h.topk_idx is not idx
            and (h.topk_idx.numel() == 0 or h.topk_idx.data_ptr() != idx.data_ptr()),
            f"{what}: handle.topk_idx is not a copy",
        )
        ctx.expect_equal(h.psum_num_recv_tokens_per_scaleup_rank,
                         torch.tensor(rec.psum_rank(), dtype=i32), f"{what}: psum per rank")  # fmt: skip
        ctx.expect_equal(h.psum_num_recv_tokens_per_expert,
                         torch.tensor(rec.psum_expert(spec.expand), dtype=i32),
                         f"{what}: psum per expert")  # fmt: skip
        ctx.expect_equal(h.num_unaligned_recv_tokens_per_expert,
                         torch.tensor(rec.counts, dtype=i32), f"{what}: unaligned counts")  # fmt: skip
        want_list = rec.padded if spec.sync else []
        ctx.expect(
            h.num_recv_tokens_per_expert_list == want_list,
            f"{what}: num_recv_tokens_per_expert_list {h.num_recv_tokens_per_expert_list}, "
            f"want {want_list}",
        )
        meta = torch.full((rows, K + 2), -1, dtype=i32)
        for i, row in enumerate(model.metadata(rec, T, K, spec.expand)):
            meta[i] = torch.tensor(row)
        ctx.expect_equal(h.recv_src_metadata, meta, f"{what}: recv_src_metadata")
        if not self.dropped_now:  # (a rank that died during the call had its slots)
            slots = model.dst_slots(self.ins[me].idx_list, me, R, self.E, T, self.link)
            want = torch.tensor(slots, dtype=i32).reshape(-1, K)
            ctx.expect_equal(h.dst_buffer_slot_idx, want, f"{what}: dst_buffer_slot_idx")
        ctx.expect(h.token_metadata_at_forward is None and h.channel_linked_list is None,
                   f"{what}: hybrid-mode fields are set")  # fmt: skip

    # --- experts and combine ---

    def expert_outputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The caller's experts over the received rows, and the weights to combine with
        (the received ones * 4 + this rank); garbage where combine must not read."""
        spec, rec, h = self.spec, self.rec, self.handle
        rows = as_rows(self.recv)
        cd = spec.out_dtype()
        if spec.expand:
            y = torch.full((rows.shape[0], spec.H), 77.0)
            ones = torch.ones(rows.shape[0]) if self.recv_w is None else self.recv_w
            start = (
                h.psum_num_recv_tokens_per_expert - h.num_unaligned_recv_tokens_per_expert
            ).tolist()
            for j, c in enumerate(h.num_unaligned_recv_tokens_per_expert.tolist()):
                r = slice(start[j], start[j] + c)
                jj = torch.full((c,), j, dtype=torch.int64)
                y[r] = expert(rows[r], jj, ones[r])
        else:
            w = torch.ones(rows.shape[0], spec.K) if self.recv_w is None else self.recv_w
            y = token_outputs(rows, self.recv_idx, w)
            y[len(rec.tokens) :] = 66.0
        cw = None
        if spec.combine_weights and self.recv_w is not None:
            cw = self.recv_w * 4 + self.me
        if spec.trim:  # the valid rows only (expanded: up to the last expert's)
            psum = h.psum_num_recv_tokens_per_expert
            keep = len(rec.tokens) if not spec.expand else int(psum[-1]) if psum.numel() else 0
            y, cw = y[:keep], None if cw is None else cw[:keep]
        return y.to(cd), cw

    def combine(self):
        y, cw = self.expert_outputs()
        t0 = time.monotonic()
        self.combined, self.combined_w, event = self.buf.combine(y, self.handle, topk_weights=cw)
        self.combine_s = time.monotonic() - t0
        event.current_stream_wait()
        self._after(f"{self.what}: combine")

    def check_combine(self, ins=None):
        ctx, spec, R, me, E = self.ctx, self.spec, self.R, self.me, self.E
        ins = ins or self.ins
        what = f"{self.what}: combine"
        mine = ins[me]
        n, cd, epr = len(mine.idx_list), spec.out_dtype(), spec.epr
        single = spec.expand and not self.buf.allow_multiple_reduction
        rows = as_rows(mine.x_in) if n else torch.zeros(0, spec.H)
        want = torch.zeros(n, spec.H, dtype=cd)
        want_w = torch.zeros(n, spec.K)
        w = mine.w if mine.w is not None else torch.ones(n, spec.K)
        for t, top in enumerate(mine.idx_list):
            acc = torch.zeros(spec.H)
            for k, term in enumerate(
                model.combine_terms(top, R, E, lambda d: self.link(me, d), single)
            ):
                if term is None:
                    continue
                d, covered = term
                local = torch.tensor([[e - d * epr if q in covered else -1
                                       for q, e in enumerate(top)]])  # fmt: skip
                if spec.expand:
                    part = torch.zeros(spec.H)
                    for q in covered:
                        j = torch.tensor([top[q] - d * epr])
                        part = part + expert(rows[t : t + 1], j, w[t, q : q + 1])[0].to(cd).float()
                    part = part.to(cd) if not single else part
                else:
                    part = token_outputs(rows[t : t + 1], local, w[t : t + 1])[0].to(cd)
                acc = acc + part.float()
                for q in covered if not single else [k]:
                    want_w[t, q] = w[t, q] * 4 + d
            want[t] = acc.to(cd)
        ctx.expect_equal(self.combined, want, f"{what}: combined_x")
        if spec.combine_weights and spec.weights:
            ctx.expect_equal(self.combined_w, want_w, f"{what}: combined_topk_weights")
        else:
            ctx.expect(self.combined_w is None, f"{what}: combined_topk_weights without weights")

    def cached(self, tag: str) -> list[Inputs]:
        """A cached dispatch along this round's handle (new inputs of ``tag``, the
        handle's routing) and its combine, checked; returns every rank's inputs."""
        ins = [make_inputs(self.seed, r, self.spec, self.R, tag) for r in range(self.R)]
        for i, old in zip(ins, self.ins, strict=True):
            i.idx, i.idx_list = old.idx, old.idx_list
        self.dispatch(handle=self.handle, ins=ins)
        self.check_dispatch(ins, cached=True)
        self.combine()
        self.check_combine(ins)
        return ins

    def run(self):
        self.dispatch()
        self.check_dispatch()
        self.combine()
        self.check_combine()
        for c in range(self.spec.cached):
            self.cached(f"cached{c}")
        return self
