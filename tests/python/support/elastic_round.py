"""One round of the elastic EP tests, checked against the model: :data:`SPEC` (its
shape), :data:`STYLES` (how rounds vary), :class:`ElasticRound` and :func:`play_round`.
The slot processes (``elastic_ranks``) and the parent's in-process checks play them.

Every round is checked against the plain-Python routing model of ``ep_cases``
(``route_model``, ``combine_model``): the inputs of round ``i`` of phase ``p`` on slot
``s`` come from ``(seed, p, i, s)``, so every process knows what every slot sent.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ep_cases import Round, Spec, make_inputs, seed_for  # this file's folder is sys.path[0]

#: The round shape: 8 tokens at most, hidden 128 (FP8 needs a multiple of 128), top-3 of
#: 2 experts per slot; slots send 5, 3, 8, 6, 0 or 7 tokens (slot s: ns[s % 6]).
SPEC = Spec(T=8, H=128, K=3, epr=2, ns=(5, 3, 8, 6, 0, 7))

#: How rounds vary (round i uses STYLES[i % len]): R ("bound": the rank bound, "cap":
#: the capacity, "mid": between), dispatch and combine completion, FP8, active_ranks
#: ("none": None, the buffer's mask; "plan": the active slots; "ones": all ones),
#: combine(out=...), zero-copy combine, cumulative_local_expert_recv_stats, and the call
#: form ("ours", or upstream's elastic one by keyword or by position:
#: upstream_elastic_ranks.UpstreamForm, where act is "none" and timeout_us the buffer's).
#: A style may add ``timeout_us`` (default -1: the buffer's timeout_ms).
# fmt: off
STYLES = (
    dict(R="bound", d="sync", c="sync", fp8=False, act="none", out=False, zc=False, stats=True),
    dict(R="cap", d="async", c="hook", fp8=False, act="plan", out=True, zc=False, stats=False),
    dict(R="bound", d="hook", c="async", fp8=True, act="none", out=False, zc=False, stats=True,
         form="upstream-kw"),
    dict(R="mid", d="with", c="sync", fp8=False, act="plan", out=True, zc=True, stats=True),
    dict(R="cap", d="sync", c="with", fp8=True, act="ones", out=True, zc=False, stats=False),
    dict(R="mid", d="hook", c="hook", fp8=False, act="none", out=True, zc=True, stats=False,
         form="upstream-pos"),
)
# fmt: on


class Aborted(Exception):
    """The parent stopped the timeline (another process failed)."""


# --- one round ------------------------------------------------------------------------------


class ElasticRound(Round):
    """ep_cases.Round over ``R`` slots of an elastic buffer.

    ``views[s][q]``: whether slot ``s`` counts slot ``q`` active (this process's view of
    the active set, for every slot); ``act``: the ``active_ranks`` tensor to pass, or None
    (the buffer's own mask, read back through ``query_mask_buffer`` for the checks).
    """

    #: Where this process's tensors live ("cpu", or "cuda": the device path when the
    #: buffer has a device workspace); the checks read CPU copies either way.
    device = "cpu"

    def __init__(self, chk, buf, spec, tag, seed, R, views, act):
        self.ctx, self.buf, self.spec = chk, buf, spec
        self.R, self.me, self.E = R, chk.rank, spec.epr * R
        self.what = tag
        self.ins = [make_inputs(seed, s, spec, R) for s in range(R)]
        self.masks = views
        self.act = act

    def _on_device(self, call):
        """Runs ``call`` (the base class's dispatch or combine) with this process's
        inputs, its ``active_ranks`` and every tensor the call makes on the device, then
        puts CPU copies where the checks read them."""
        dev = torch.device(self.device)
        mine, act = self.ins[self.me], self.act
        self.ins[self.me] = replace(mine, x=mine.x.to(dev), idx=mine.idx.to(dev), w=mine.w.to(dev))
        if act is not None:
            self.act = act.to(dev)
        try:
            with dev:
                out = call()
        finally:
            self.ins[self.me] = mine
            if act is not None:
                act.copy_(self.act.cpu())
                self.act = act
        return out

    def dispatch(self, mode="sync", stats=None):
        if self.device == "cpu":
            return super().dispatch(mode, stats)
        dstats = None if stats is None else stats.to(self.device)
        out = self._on_device(lambda: super(ElasticRound, self).dispatch(mode, stats=dstats))
        if stats is not None:
            stats.copy_(dstats.cpu())
        self.ran_on = self.buf.path
        self.recv_x = (
            tuple(t.cpu() for t in self.recv_x)
            if isinstance(self.recv_x, tuple)
            else self.recv_x.cpu()
        )
        self.count = self.count.cpu()
        return out

    def combine(self, mode="sync", zero_copy=False, use_out=False, cmask=None, y=None):
        if self.device == "cpu":
            return super().combine(mode, zero_copy, use_out, cmask, y)
        y = self.expert_outputs() if y is None else y
        y = y if zero_copy else y.to(self.device)
        out = self._on_device(
            lambda: super(ElasticRound, self).combine(mode, zero_copy, use_out, cmask, y)
        )
        if self.cact is not None:
            self.cact = self.cact.cpu()
        self.combined = self.combined.cpu()
        return out

    def buffer_view(self) -> list[int]:
        """1 = active, per slot below R, from query_mask_buffer (1 = masked)."""
        mask = torch.zeros(self.buf.num_ranks, dtype=torch.int32)
        self.buf.query_mask_buffer(mask)
        return [1 - int(v) for v in mask[: self.R].tolist()]

    def views_after_dispatch(self, may_drop=(), must_drop=None):
        if self.act is not None:
            return super().views_after_dispatch(may_drop, must_drop)
        # active_ranks=None: the buffer's mask is the view; it may only lose slots.
        ctx, R = self.ctx, self.R
        start, now = self.masks[self.me], self.buffer_view()
        dropped = {q for q in range(R) if start[q] and not now[q]}
        raised = {q for q in range(R) if now[q] and not start[q]}
        ctx.expect(not raised, f"{self.what}: slots {sorted(raised)} active, not in the plan")
        ctx.expect(
            dropped <= set(may_drop) | set(must_drop or ()),
            f"{self.what}: dispatch masked slots {sorted(dropped)}; only {sorted(may_drop)} may be",
        )
        if must_drop is not None:
            ctx.expect(
                dropped == set(must_drop),
                f"{self.what}: dispatch masked {sorted(dropped)}, want exactly {sorted(must_drop)}",
            )
        self.dropped = dropped
        self.views = [
            [int(self.masks[r][q] and q not in dropped) for q in range(R)] for r in range(R)
        ]
        return now

    def check_combine(self, may_drop=()):
        if self.cact is None:  # None: compare with the buffer's mask after the call
            self.cact = torch.tensor(self.buffer_view(), dtype=torch.int32)
            self.cbefore = list(self.views[self.me])
        super().check_combine(may_drop)


def play_round(
    chk,
    buf,
    seed,
    phase,
    i: int,
    plan,
    view=None,
    may_drop=(),
    must_drop=None,
    style=None,
    stats=None,
):
    """One dispatch + combine of ``buf`` checked against the model; returns the round and
    its record (with the failures, which are taken out of ``chk``).

    ``plan``: the slots taking part (alike on every process: they fix R and, with
    ``seed``, ``phase`` and ``i``, the inputs); ``view``: this process's active set when it
    may differ from the plan (a peer is dying); ``may_drop``/``must_drop``: slots the call
    may / must mask; ``style``: overrides of ``STYLES[i % len]``; ``stats``: (the
    cumulative_local_expert_recv_stats tensor, its expected value), both updated."""
    st = dict(STYLES[i % len(STYLES)], **(style or {}))
    me, cap, epr = buf.rank, buf.num_ranks, buf.num_experts_per_rank
    plan = sorted(plan)
    view = plan if view is None else sorted(view)
    tag = f"{phase}/{i}"
    if view == plan and must_drop is None:
        chk.expect(
            buf.active_slots == plan,
            f"{tag}: active_slots {buf.active_slots} before the round, want {plan}",
        )
    bound = max(plan) + 1
    R = {"bound": bound, "cap": cap, "mid": (bound + cap + 1) // 2}[st["R"]]
    spec = replace(
        SPEC, fp8=st["fp8"], K=min(SPEC.K, epr * R), epr=epr, timeout_us=st.get("timeout_us", -1)
    )
    views = [[int(s in view and q in view) for q in range(R)] for s in range(R)]
    act = {
        "none": None,
        "plan": torch.tensor(views[me], dtype=torch.int32),
        "ones": torch.ones(R, dtype=torch.int32),
    }[st["act"]]
    if st["act"] == "ones":  # slots outside the view are masked: they may be set to 0
        may_drop = set(may_drop) | {q for q in range(R) if q not in view}
    r = ElasticRound(chk, buf, spec, tag, seed_for(seed, phase, i), R, views, act)
    form = st.get("form", "ours")
    if form != "ours" and st["act"] == "none" and "timeout_us" not in st:
        from upstream_elastic_ranks import UpstreamForm

        quiet = not may_drop and must_drop is None  # the rank bound stays as it is
        r.buf = UpstreamForm(buf, chk, form == "upstream-pos", quiet and st["R"] == "bound")
    use = stats if st["stats"] and stats is not None else None
    t0 = time.monotonic()
    r.dispatch(st["d"], stats=None if use is None else use[0])
    r.check_dispatch(may_drop=may_drop, must_drop=must_drop)
    if use is not None:
        use[1].add_(r.count)
        chk.expect_equal(use[0], use[1], f"{tag}: cumulative_local_expert_recv_stats")
    r.combine(st["c"], zero_copy=st["zc"], use_out=st["out"])
    r.check_combine(may_drop=may_drop)
    rec = dict(
        phase=phase,
        tag=tag,
        path=getattr(r, "ran_on", "portable"),
        R=R,
        plan=plan,
        view=view,
        style=st,
        dropped=sorted(r.dropped),
        received=r.count.tolist(),
        layout=r.handle.layout_range.tolist(),
        recv_shape=list((r.recv_x[0] if spec.fp8 else r.recv_x).shape),
        dispatch_s=r.dispatch_s,
        combine_s=r.combine_s,
        took_s=time.monotonic() - t0,
        failures=list(chk.failures),
    )
    chk.failures.clear()
    return r, rec
