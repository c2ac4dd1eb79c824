"""Rank-side cases of ``test_elastic_buffer.py``: the ElasticBuffer's rounds over every
argument combination (verified by ``ht_round`` against ``ht_model``), its attributes,
and the rules that need several ranks to show (one rank's bad arguments, ranks that
disagree, stale handles, a destroyed buffer). The single-rank argument rules are rows of
``test_argument_checks.py``.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from ep_cases import expect_value_error
from ht_round import HRound, HSpec, make_inputs
from launcher import Case

_state: dict = {}


def get_ebuf(ctx, **kw):
    """The launch's ElasticBuffer with these constructor arguments (made collectively on
    first use, so that -k works)."""
    key = tuple(sorted(kw.items()))
    if key not in _state:
        from mooncake.mooncake_elastic_buffer import ElasticBuffer

        _state[key] = ElasticBuffer(dist.group.WORLD, **kw)
    return _state[key]


SMALL = HSpec(T=4, H=128, K=2, epr=2, ns=(3,))


def good_round(ctx, tag: str = "good") -> None:
    """A small verified round (fresh, cached, combine): the buffer still works."""
    HRound(ctx, get_ebuf(ctx), replace(SMALL, cached=1), tag).run()


def c_round(ctx, spec: HSpec, single: bool = False, **kw):
    buf = get_ebuf(ctx, allow_multiple_reduction=not single, **kw)
    HRound(ctx, buf, spec).run()


# --- rounds ---------------------------------------------------------------------------------


def _grid() -> dict[str, HSpec]:
    """Payload x expand x CPU sync x alignment; cached dispatches where they apply."""
    out = {}
    for payload in ("bf16", "f32", "odd"):
        for expand in (False, True):
            for sync in (True, False):
                for align in (1, 8):
                    name = f"{payload}/{'expand' if expand else 'tokens'}/"
                    name += f"{'sync' if sync else 'nosync'}/align{align}"
                    out[name] = HSpec(
                        fp8="" if payload == "bf16" else payload, expand=expand, sync=sync,
                        align=align, cached=0 if expand else 1,
                    )  # fmt: skip
    return out


def _extra(world: int) -> dict[str, HSpec]:
    return {
        "fp8-packed-int32-scales": HSpec(H=512, fp8="i32", cached=1),
        "top1": HSpec(K=1),
        "top8": HSpec(K=8, T=8, ns=(8, 3)),
        "top32": HSpec(K=32, H=8, epr=-(-32 // world), neg=0.5),
        "no-minus-1": HSpec(neg=0.0, cached=1),
        "all-minus-1": HSpec(neg=1.0, cached=1),
        "all-minus-1-expand": HSpec(neg=1.0, expand=True, align=8),
        "zero-tokens-on-some-ranks": HSpec(ns=(0, 5, 0, 6), cached=1),
        "zero-tokens-everywhere": HSpec(ns=(0,), expand=True),
        "n-equals-T": HSpec(T=8, ns=(8,), cached=1),
        "n-equals-T-nosync-expand": HSpec(T=8, ns=(8,), expand=True, sync=False, align=4),
        "int32-ids": HSpec(idx_dtype=torch.int32, cached=1),
        "fp32": HSpec(dtype=torch.float32, cached=1),
        "fp16": HSpec(dtype=torch.float16, expand=True),
        "hidden-7": HSpec(H=7, cached=1),
        "hidden-7168": HSpec(H=7168, T=3, ns=(3, 2)),
        "strided-x": HSpec(strided=True, cached=1),
        "offset-x": HSpec(offset=True, cached=1),
        "no-weights": HSpec(weights=False, cached=1),
        "no-weights-expand": HSpec(weights=False, expand=True, align=2),
        "weights-not-combined": HSpec(combine_weights=False, cached=1),
        "experts-in-fp32": HSpec(cdtype=torch.float32),
        "align128-expand": HSpec(expand=True, align=128, T=4, ns=(4, 1)),
        "align128-tokens": HSpec(align=128),
        "many-experts": HSpec(epr=16, K=4, T=16, ns=(16, 9), expand=True, align=4),
        "cached-three-times": HSpec(cached=3),
        "numpy-ints": HSpec(numpy_ints=True, align=4, cached=1),
        "trimmed-combine-x": HSpec(sync=False, trim=True, cached=1),
        "trimmed-combine-x-expand": HSpec(sync=False, expand=True, align=8, trim=True),
        # with sync the rows are exact but for the last expert's padding, which goes
        "trimmed-combine-x-fp8-sync-expand": HSpec(fp8="f32", expand=True, align=8, trim=True),
    }


def c_single_reduction(ctx, sync: bool):
    c_round(ctx, HSpec(expand=True, sync=sync, align=4, K=4, epr=3), single=True)


def c_deterministic(ctx):
    """The same round twice on a deterministic buffer: every output bit for bit the same."""
    buf = get_ebuf(ctx, deterministic=True)
    outs = []
    for _ in range(2):
        r = HRound(ctx, buf, HSpec(expand=True, align=4, K=4, epr=3), "same").run()
        outs.append((r.recv, r.recv_idx, r.recv_w, r.combined, r.combined_w,
                     r.handle.recv_src_metadata))  # fmt: skip
    for a, b in zip(*outs, strict=True):
        ctx.expect_equal(a, b, "the second run")


def c_defaults(ctx):
    """T from the constructor, E inferred from the ids (every rank selects the last
    expert), expert_alignment 1, do_cpu_sync True: the documented defaults."""
    R, me = ctx.world_size, ctx.rank
    buf = get_ebuf(ctx, num_max_tokens_per_rank=6)
    E = 2 * R
    idx = torch.tensor([[E - 1, 0], [1, -1], [-1, -1]])
    x = torch.ones(3, 128, dtype=torch.bfloat16) * me
    recv, recv_idx, w, h, _ = buf.dispatch(x, idx)
    ctx.expect(w is None, "weights without topk_weights")
    ctx.expect((h.num_experts, h.num_max_tokens_per_rank, h.expert_alignment) == (E, 6, 1),
               f"defaults {(h.num_experts, h.num_max_tokens_per_rank, h.expert_alignment)}")  # fmt: skip
    # Rank 0 holds experts 0 and 1 (tokens 0 and 1 of every rank), rank R-1 expert E-1.
    want_rows = (2 * R if me == 0 else 0) + (R if me == R - 1 and R > 1 else 0)
    ctx.expect(recv.shape[0] == want_rows, f"{recv.shape[0]} rows, want {want_rows}")
    combined, cw, _ = buf.combine(torch.zeros(recv.shape[0], 128, dtype=torch.bfloat16), h)
    ctx.expect(cw is None and combined.shape == (3, 128), f"combine gave {combined.shape}, {cw}")


def c_attributes(ctx):
    """Upstream's attributes and queries, answered honestly."""
    from mooncake.mooncake_elastic_buffer import ElasticBuffer, EventOverlap

    R, me = ctx.world_size, ctx.rank
    buf = get_ebuf(ctx)
    want = {
        "rank_idx": me, "num_ranks": R, "transport": "pg", "requested_transport": "auto",
        "path": "portable", "num_scaleout_ranks": 1, "num_scaleup_ranks": R,
        "scaleout_rank_idx": 0, "scaleup_rank_idx": me, "num_rdma_ranks": 1,
        "num_nvlink_ranks": R, "num_bytes": 0, "deterministic": False, "sl_idx": 3,
        "num_allocated_qps": 0, "num_cpu_timeout_secs": 300, "num_gpu_timeout_secs": 100,
        "allow_hybrid_mode": True, "allow_multiple_reduction": True, "explicitly_destroy": False,
    }  # fmt: skip
    for name, v in want.items():
        ctx.expect(getattr(buf, name) == v, f"{name} = {getattr(buf, name)!r}, want {v!r}")
    ctx.expect(buf.group is dist.group.WORLD and buf.backend is buf.group, "group")
    ctx.expect(buf.get_physical_domain_size() == (1, R), f"{buf.get_physical_domain_size()}")
    ctx.expect(buf.get_logical_domain_size() == (1, R), f"{buf.get_logical_domain_size()}")
    ctx.expect(buf.runtime is not None and buf.runtime.ibgda_disabled(), "runtime")
    ctx.expect(buf.runtime.get_logical_domain_size() == (1, R), "runtime's domain")
    ctx.expect(buf.active_ranks.tolist() == [1] * R, f"active_ranks {buf.active_ranks}")
    ctx.expect(buf.active_ranks.dtype == torch.int32, "active_ranks dtype")
    ctx.expect(buf.generation == 1, f"generation {buf.generation}")
    # the docstring's rule (overlapping with compute, the default): a quarter of the GPU's
    # SMs, at most 24; 1 without CUDA
    sms = 1
    if torch.cuda.is_available():
        count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        sms = max(1, min(24, count // 4))
    got = buf.get_theoretical_num_sms(8, 2)
    ctx.expect(got == sms, f"get_theoretical_num_sms(8, 2) = {got}, want {sms}")
    ctx.expect(isinstance(ElasticBuffer.capture(), EventOverlap), "capture()")
    buf.barrier()
    buf.barrier(False, True)
    # num_bytes from the settings: the size hint
    sized = get_ebuf(ctx, num_max_tokens_per_rank=8, hidden=256, num_topk=4)
    hint = ElasticBuffer.get_buffer_size_hint(dist.group.WORLD, 8, 256, 4)
    ctx.expect(sized.num_bytes == hint > 0, f"num_bytes {sized.num_bytes}, hint {hint}")
    # numpy ints, as an engine reads its settings out of arrays: taken as the same ints
    T, H, K = np.int64(8), np.int32(256), np.int64(4)
    np_hint = ElasticBuffer.get_buffer_size_hint(dist.group.WORLD, T, H, K)
    ctx.expect(np_hint == hint and type(np_hint) is int, f"hint of numpy ints {np_hint!r}")
    by_np = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    for name in ("num_bytes", "num_max_tokens_per_rank", "hidden", "num_topk"):
        got, want = getattr(by_np, name), getattr(sized, name)
        ctx.expect(type(got) is int and got == want, f"{name} of numpy ints {got!r}, want {want}")
    HRound(ctx, by_np, replace(SMALL, T=8, numpy_ints=True, cached=1), "numpy").run()


def _a(v: int, a: int) -> int:
    return -(-v // a) * a


def hint_formula(R: int, T: int, H: int, K: int, fp8: bool, multiple: bool) -> int:
    """get_buffer_size_hint's docstring, written out: dispatch rows of align8(16 + 8K +
    P), combine rows of align8(16 + 4K + 2H), (R*T + T*min(R, K)) of each (times K for the
    combine without multiple reductions), the larger, 2 MiB aligned; K = 0 means 32."""
    K = K or 32
    p = H + 4 * -(-H // 128) if fp8 else 2 * H
    rows = R * T + T * min(R, K)
    d = rows * _a(16 + 8 * K + p, 8)
    c = rows * (1 if multiple else K) * _a(16 + 4 * K + 2 * H, 8)
    return _a(max(d, c), 2 << 20)


def c_size_hints(ctx):
    """The size hint is its documented formula (for this launch's R); the other hints
    are upstream's formulas."""
    from mooncake.mooncake_elastic_buffer import ElasticBuffer as B

    R, W = ctx.world_size, dist.group.WORLD
    for T, H, K, fp8, multiple in [(4096, 7168, 8, False, True), (4096, 7168, 8, True, True),
                                   (1, 1, 0, False, True), (128, 4096, 2, False, False),
                                   (33, 100, 32, True, False)]:  # fmt: skip
        got = B.get_buffer_size_hint(W, T, H, K, fp8, True, multiple)
        want = hint_formula(R, T, H, K, fp8, multiple)
        ctx.expect(got == want, f"hint {(T, H, K, fp8, multiple)}: {got}, want {want}")
    ctx.expect(B.get_buffer_size_hint(W, 8, 128) == hint_formula(R, 8, 128, 0, False, True),
               "hint with the defaults")  # fmt: skip
    ctx.expect(B.get_engram_storage_size_hint(10, 7168, 4) == _a(7168 * 2, 32) * 14, "engram")
    fp8_entry = _a(7168 + 4 * 56, 32)
    ctx.expect(B.get_engram_storage_size_hint(10, 7168, 4, torch.float8_e4m3fn) == fp8_entry * 14,
               "engram fp8")  # fmt: skip
    ctx.expect(B.get_pp_buffer_size_hint(100, 3) == 128 * 3 * 4, "pp")
    ctx.expect(B.get_agrs_buffer_size_hint(W, 12345) == 12345, "agrs")


def c_gloo_group(ctx):
    """Over a gloo group (an engine's own EP group): a warning, and verified rounds."""
    if "gloo" not in _state:
        from mooncake.mooncake_elastic_buffer import ElasticBuffer

        group = dist.new_group(list(range(ctx.world_size)), backend="gloo")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _state["gloo"] = ElasticBuffer(group)
        ctx.expect(any("mooncake backend" in str(w.message) for w in caught), "no warning")
    buf = _state["gloo"]
    HRound(ctx, buf, HSpec(cached=1), "gloo").run()
    HRound(ctx, buf, HSpec(expand=True, align=4, sync=False), "gloo-expand").run()


def route_cases(world: int) -> list[Case]:
    P = functools.partial
    cases = [Case(f"round/{n}", P(c_round, spec=s)) for n, s in _grid().items()]
    cases += [Case(f"round/{n}", P(c_round, spec=s)) for n, s in _extra(world).items()]
    cases += [
        Case("round/single-reduction/sync", P(c_single_reduction, sync=True)),
        Case("round/single-reduction/nosync", P(c_single_reduction, sync=False)),
        Case("deterministic", c_deterministic),
        Case("defaults", c_defaults),
        Case("attributes", c_attributes),
        Case("size-hints", c_size_hints),
    ]
    if world > 1:
        cases.append(Case("gloo-group", c_gloo_group))
    return cases


# --- rules that take several ranks ------------------------------------------------------------


def _args(ctx, spec=SMALL, tag="args"):
    """Correct dispatch arguments of this rank (keywords)."""
    R = ctx.world_size
    ins = make_inputs(7, ctx.rank, spec, R, tag)
    return dict(x=ins.x_in, topk_idx=ins.idx, topk_weights=ins.w, num_experts=spec.epr * R,
                num_max_tokens_per_rank=spec.T)  # fmt: skip


def c_one_rank_rejects(ctx, op: str):
    """Only rank 0 breaks a rule: it raises naming the argument, every other rank raises
    ValueError saying that a rank rejected its call; then a verified round."""
    buf = get_ebuf(ctx)
    bad = ctx.rank == 0
    args = _args(ctx)
    if op == "dispatch":
        if bad:
            args["topk_idx"] = args["topk_idx"].clone().fill_(99)
        words = ["topk_idx"] if bad else ["rank 0", "rejected"]
        expect_value_error(ctx, lambda: buf.dispatch(**args), words, "fresh dispatch")
    else:
        if op == "combine-short":  # x trimmed below the valid rows, after a dispatch without sync
            args["do_cpu_sync"] = False
        _, _, _, h, _ = buf.dispatch(**args)
        if op == "combine-short":
            valid = int(h.psum_num_recv_tokens_per_scaleup_rank[-1])
            ctx.expect(valid > 0 or not bad, "rank 0 received no rows to trim")
            y = torch.zeros(valid - 1 if bad else valid, SMALL.H, dtype=torch.bfloat16)
            words = ["x", "valid rows"] if bad else [("rank 0", "rejected", "disagree")]
            expect_value_error(ctx, lambda: buf.combine(y, h), words, "combine of a short x")
        elif op == "cached":
            a = dict(x=args["x"], topk_weights=args["topk_weights"], handle=h)
            if bad:
                a["do_cpu_sync"] = True
            words = ["do_cpu_sync"] if bad else [("rank 0", "rejected", "disagree")]
            expect_value_error(ctx, lambda: buf.dispatch(**a), words, "cached dispatch")
        else:
            y = torch.zeros(h.num_recv_tokens + (1 if bad else 0), SMALL.H, dtype=torch.bfloat16)
            words = ["x"] if bad else [("rank 0", "rejected", "disagree")]
            expect_value_error(ctx, lambda: buf.combine(y, h), words, "combine")
    good_round(ctx)


def c_disagree(ctx, field: str):
    """The ranks' calls disagree (rank 0 differs): ValueError on every rank naming what."""
    buf = get_ebuf(ctx)
    args = _args(ctx)
    words = ["disagree"]
    if ctx.rank == 0:
        if field == "T":
            args["num_max_tokens_per_rank"] += 1
        elif field == "dtype":
            args["x"] = args["x"].half()
        elif field == "weights":
            args["topk_weights"] = None
    words.append({"T": "num_max_tokens_per_rank", "dtype": "dtype", "weights": "topk_weights"}[
        field])  # fmt: skip
    expect_value_error(ctx, lambda: buf.dispatch(**args), words, f"dispatch with another {field}")
    good_round(ctx)


def c_mixed_calls(ctx):
    """Rank 0 makes a cached dispatch while the others make a fresh one: ValueError on
    every rank (the others' counts exchange meets rank 0's tokens)."""
    buf = get_ebuf(ctx)
    args = _args(ctx)
    _, _, _, h, _ = buf.dispatch(**args)
    if ctx.rank == 0:
        call = functools.partial(buf.dispatch, args["x"], topk_weights=args["topk_weights"],
                                 handle=h)  # fmt: skip
    else:
        call = functools.partial(buf.dispatch, **args)
    expect_value_error(ctx, call, [("disagree", "rejected")], "mixed fresh and cached")
    good_round(ctx)


def c_stale_generation(ctx):
    """After update_ep_member (collective, here without a membership change) the
    generation moves on and the earlier handles are refused, by a cached dispatch and by
    combine, on every rank alike; a fresh round works."""
    buf = get_ebuf(ctx)
    args = _args(ctx)
    recv, _, _, h, _ = buf.dispatch(**args)
    before = buf.generation
    buf.update_ep_member()
    ctx.expect(buf.generation == before + 1, f"generation {before} -> {buf.generation}")
    words = ["handle", "generation", "update_ep_member"]
    expect_value_error(ctx, lambda: buf.dispatch(args["x"], handle=h), words, "cached dispatch")
    y = torch.zeros(recv.shape[0], SMALL.H, dtype=torch.bfloat16)
    expect_value_error(ctx, lambda: buf.combine(y, h), words, "combine")
    good_round(ctx)


def c_other_buffers_handle(ctx):
    buf, other = get_ebuf(ctx), get_ebuf(ctx, deterministic=True)
    args = _args(ctx)
    recv, _, _, h, _ = other.dispatch(**args)
    y = torch.zeros(recv.shape[0], SMALL.H, dtype=torch.bfloat16)
    expect_value_error(ctx, lambda: buf.combine(y, h), ["handle", "another"], "combine")
    good_round(ctx)


def c_destroyed(ctx):
    """destroy(): not collective, twice is harmless; the calls after it raise RuntimeError
    naming it."""
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    buf = ElasticBuffer(dist.group.WORLD, explicitly_destroy=True)
    buf.destroy()
    buf.destroy()
    ctx.expect(buf.runtime is None, "runtime after destroy")
    for name, call in (
        ("dispatch", lambda: buf.dispatch(**_args(ctx))),
        ("barrier", buf.barrier),
        ("update_ep_member", buf.update_ep_member),
    ):
        with ctx.expect_raises(RuntimeError, name, "destroyed"):
            call()
    good_round(ctx)


class _StandInExt:
    """The extension as the device path's setup sees it (``throughput_device.connect``),
    on a machine without CUDA: the real module for everything else; a workspace that
    ``fail`` says fails on the last rank, in its making ("make"), its mapping ("map") or
    by a peer it cannot reach ("unreachable")."""

    EP_HT_MAX_RANKS, EP_HT_MAX_CHANNELS = 64, 32

    def __init__(self, real, rank: int, last: int, fail: str):
        self._real, self._fails = real, rank == last
        ext = self

        class EpHtDevice:
            def __init__(self, R, me, channels, ring_bytes, device):
                if ext._fails and fail == "make":
                    raise RuntimeError("CUDA: cudaMalloc of a device segment: out of memory")
                self.R = R

            def card(self) -> bytes:
                return bytes(256)

            def connect(self, cards):
                if ext._fails and fail == "map":
                    raise RuntimeError("CUDA: cudaIpcOpenMemHandle: invalid argument")
                reachable = [not (ext._fails and fail == "unreachable")] * self.R
                return reachable, [True] * self.R, 1

        self.EpHtDevice = EpHtDevice

    def ep_ht_gpu(self, index: int):
        return "0000:00:06.0", 132

    def __getattr__(self, name):
        return getattr(self._real, name)


def c_device_setup_falls_back_together(ctx):
    """The device path's setup (``throughput_device.connect``, with a stand-in extension)
    failing on one rank only, in each of its steps: every member answers None (the
    portable path) in step, none waits for another, the failing rank warns naming the
    step, and the buffer goes on."""
    import types

    from mooncake import pg
    from mooncake.ep import throughput_device as td

    buf, last = get_ebuf(ctx), ctx.world_size - 1
    data = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(4, buf.hidden))
    data.dim = lambda: 2
    words = {"make": "making the workspace", "map": "mapping", "unreachable": None}
    for fail, word in words.items():
        shim = types.SimpleNamespace(_ext=_StandInExt(pg._ext, ctx.rank, last, fail))
        saved, td.pg = td.pg, shim
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = td.connect(buf, data, buf.num_topk, 1)
        finally:
            td.pg = saved
        ctx.expect(got is None, f"{fail} failing on rank {last}: connect gave {got!r}")
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if ctx.rank == last and word:
            ctx.expect(any(word in m for m in said), f"{fail}: warnings {said}")
        elif said:
            ctx.fail(f"{fail}: rank {ctx.rank} warned {said}")
    good_round(ctx, "after-setup-failures")


def rule_cases(world: int) -> list[Case]:
    P = functools.partial
    cases = [
        Case("rules/stale-generation", c_stale_generation),
        Case("rules/other-buffers-handle", c_other_buffers_handle),
        Case("rules/destroyed", c_destroyed),
        Case("device-setup/falls-back-together", c_device_setup_falls_back_together),
    ]
    if world > 1:
        cases += [
            Case("rules/one-rank/dispatch", P(c_one_rank_rejects, op="dispatch")),
            Case("rules/one-rank/cached", P(c_one_rank_rejects, op="cached")),
            Case("rules/one-rank/combine", P(c_one_rank_rejects, op="combine")),
            Case("rules/one-rank/combine-short-x", P(c_one_rank_rejects, op="combine-short")),
            Case("rules/disagree/T", P(c_disagree, field="T")),
            Case("rules/disagree/dtype", P(c_disagree, field="dtype")),
            Case("rules/disagree/weights", P(c_disagree, field="weights")),
            Case("rules/mixed-fresh-and-cached", c_mixed_calls),
        ]
    return cases


def ht_cases(world: int) -> list[Case]:
    return route_cases(world) + rule_cases(world)
