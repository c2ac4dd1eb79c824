"""Upstream's elastic Buffer API in the elastic ranks (``elastic_ranks.py``).

* :class:`UpstreamForm`: an elastic buffer seen through upstream's elastic forms of
  ``dispatch`` and ``combine``. ``ep_cases.Round`` calls them in the process group's form
  (``active_ranks=None``, ``timeout_us=-1``); this proxy makes upstream's calls instead
  (all positional, or by keyword), checks what upstream's return (the handle is a plain
  4-tuple), and hands the round a ``DispatchHandle`` of the same items for its checks, so
  every round in this form is checked against the same model as the other form's.
  ``elastic_round.STYLES`` marks the styles that run it.
* :func:`upstream`: the ``upstream`` scenario of ``elastic_ranks.SCENARIOS``, three slots
  of capacity 4: ``create_elastic`` by keyword without a store, then
  ``set_tcp_store_group``; ``connect_ranks`` of every slot (this one included) with the
  default ``activate=True``; rounds; the same inputs through both forms, compared bit for
  bit; masks undone by ``clean_mask_buffer``; ``disconnect_ranks`` of every slot and a
  reconnect; ``get_comm_stream`` and ``get_local_buffer_tensor``; ``destroy`` of one slot,
  which the others mask, and a new buffer in its place.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ep_cases import make_inputs, seed_for
from mooncake.mooncake_ep_buffer import Buffer, DispatchHandle


class UpstreamForm:
    """``buf`` with upstream's elastic ``dispatch``/``combine`` under our form's names
    (see the module docstring); everything else is ``buf``'s.

    ``positional``: pass every argument by position (else by keyword, with the handle
    copied into a new tuple); ``default_experts``: leave ``num_experts`` out (upstream's
    default: the rank bound's experts) when the round covers the rank bound."""

    def __init__(self, buf, chk, positional: bool, default_experts: bool):
        self._buf, self._chk = buf, chk
        self._positional, self._default_experts = positional, default_experts
        self._upstream: dict[int, tuple] = {}  # id(round's handle) -> upstream's handle

    def __getattr__(self, name):
        return getattr(self._buf, name)

    def dispatch(
        self, x, topk_idx, active_ranks, T, E, timeout_us, use_fp8=None, async_finish=False,
        return_recv_hook=False, *, cumulative_local_expert_recv_stats=None,
    ):  # fmt: skip
        assert active_ranks is None and timeout_us == -1, "the elastic form has neither"
        stats, buf = cumulative_local_expert_recv_stats, self._buf
        if self._positional:
            out = buf.dispatch(
                x, topk_idx, T, E, stats, None, use_fp8, False, async_finish, return_recv_hook
            )
        else:
            kw = dict(use_fp8=use_fp8, async_finish=async_finish, return_recv_hook=return_recv_hook)
            if stats is not None:
                kw["cumulative_local_expert_recv_stats"] = stats
            if not (self._default_experts and E == buf.rank_bound * buf.num_experts_per_rank):
                kw["num_experts"] = E
            out = buf.dispatch(x=x, topk_idx=topk_idx, num_max_dispatch_tokens_per_rank=T, **kw)
        recv_x, count, h4, event, hook = out
        self._chk.expect(
            type(h4) is tuple and len(h4) == 4 and tuple(h4[2:]) == (T, x.shape[1]),
            f"upstream-form dispatch: handle {type(h4).__name__} of {len(h4)} items "
            f"{tuple(h4[2:]) if isinstance(h4, tuple) else ''}, want (src_info, "
            f"layout_range, {T}, {x.shape[1]})",
        )
        handle = DispatchHandle(*h4[:4], E)  # the items the round's checks read
        self._upstream[id(handle)] = (handle, h4)
        return recv_x, count, handle, event, hook

    def get_next_combine_buffer(self, handle):
        return self._buf.get_next_combine_buffer(self._upstream[id(handle)][1])

    def combine(
        self, x, topk_idx, topk_weights, active_ranks, timeout_us, handle, zero_copy=False,
        async_finish=False, return_recv_hook=False, out=None,
    ):  # fmt: skip
        assert active_ranks is None and timeout_us == -1, "the elastic form has neither"
        h4 = self._upstream.pop(id(handle))[1]
        if self._positional:
            return self._buf.combine(
                x, topk_idx, topk_weights, h4, False, zero_copy, async_finish, return_recv_hook,
                out, None,
            )  # fmt: skip
        return self._buf.combine(
            x=x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            handle=tuple(list(h4)),  # a copy, as engines keep it
            zero_copy=zero_copy,
            async_finish=async_finish,
            return_recv_hook=return_recv_hook,
            out=out,
        )


# --- the upstream scenario ----------------------------------------------------------------


def _attributes(rk, buf, what: str, **want) -> None:
    got = {k: getattr(buf, k) for k in want}
    rk.chk.expect(got == want, f"{what}: attributes {got}, want {want}")


def _same_in_both_forms(rk, buf, plan, fp8: bool) -> None:
    """One round's inputs through our form and upstream's: recv_x, recv_count, the
    handle's tensors and the combined tokens agree bit for bit (both forms run the
    buffer's mask and timeout_ms)."""
    from elastic_round import SPEC, ElasticRound

    dev = torch.device(ElasticRound.device)
    R = max(plan) + 1
    spec = replace(SPEC, fp8=fp8, K=min(SPEC.K, SPEC.epr * R))
    ins = make_inputs(seed_for(rk.p["seed"], rk.phase, fp8), rk.slot, spec, R)
    x, idx, w = ins.x.to(dev), ins.idx.to(dev), ins.w.to(dev)
    E = spec.epr * R
    got = []
    for form in ("ours", "upstream"):
        if form == "ours":
            recv_x, count, handle, _, _ = buf.dispatch(x, idx, None, spec.T, E, -1, use_fp8=fp8)
        else:
            recv_x, count, handle, _, _ = buf.dispatch(x, idx, spec.T, use_fp8=fp8)
        data = recv_x[0].view(torch.uint8) if fp8 else recv_x
        y = recv_x[0].float() * recv_x[1].repeat_interleave(128, 2) if fp8 else recv_x.float()
        y = (2 * y).to(torch.bfloat16)
        if form == "ours":
            combined, _, _ = buf.combine(y, idx, w, None, -1, handle)
        else:
            combined, _, _ = buf.combine(y, idx, w, handle)
        parts = [data, recv_x[1] if fp8 else None, count, handle[0], handle[1], combined]
        got.append([None if t is None else t.cpu() for t in parts])
    names = ["recv_x", "scales", "recv_count", "src_info", "layout_range", "combined"]
    counts = got[0][2].tolist()
    for name, a, b in zip(names, got[0], got[1], strict=True):
        if a is None:
            continue
        same = a.shape == b.shape
        if same and name in ("recv_x", "scales", "src_info"):  # rows past recv_count: any
            same = all(torch.equal(a[j, :c], b[j, :c]) for j, c in enumerate(counts))
        elif same:
            same = torch.equal(a, b)
        rk.chk.expect(same, f"both forms (fp8={fp8}): {name} differs")


def upstream(rk) -> None:
    """Slots 0, 1 and 2 of capacity 4 (see the module docstring). Phases: ``create``,
    ``connect``, ``forms``, ``clean``, ``reconnect``, ``local``, ``destroy``."""
    from elastic_ranks import others
    from elastic_round import SPEC, ElasticRound

    me, trio, pair, n = rk.slot, [0, 1, 2], [0, 1], rk.p["rounds"]
    on_cuda = ElasticRound.device == "cuda"
    rk.phase = "create"
    kw = dict(timeout_ms=rk.p["timeout_ms"], metadata_timeout_ms=60000, store_prefix="up/")
    buf = Buffer.create_elastic(rank=me, explicitly_destroy=True, **kw)
    _attributes(
        rk, buf, "created", rank=me, group_size=0, group=None, backend=None, runtime=None,
        device_type="cuda", disable_ll_nvlink=False, explicitly_destroy=True,
        tcp_store_group=None, timeout_ms=rk.p["timeout_ms"], metadata_timeout_ms=60000,
        num_rdma_bytes=None,
    )  # fmt: skip
    hint = Buffer.get_ep_buffer_size_hint(SPEC.T, SPEC.H, rk.cap, rk.epr * rk.cap)
    try:
        buf.update_memory_buffers(rk.cap, rk.epr, hint)
        rk.chk.fail("update_memory_buffers without a store did not raise")
    except RuntimeError as e:
        rk.chk.expect("set_tcp_store_group" in str(e), f"no store: {e}")
    buf.set_tcp_store_group(rk.store)
    buf.update_memory_buffers(num_ranks=rk.cap, num_experts_per_rank=rk.epr, num_rdma_bytes=hint)
    _attributes(
        rk, buf, "allocated", group_size=rk.cap, num_rdma_bytes=hint, tcp_store_group=rk.store
    )
    rk.chk.expect(buf.runtime is not None, "runtime is None after update_memory_buffers")
    rk.check("created")
    rk.end_phase()

    rk.phase = "connect"
    buf.connect_ranks(trio)  # this slot too, and upstream's default: activate=True
    rk.expect_slots(buf, trio, "connected with the defaults")
    rk.check("connected")
    rk.sync(rk.phase, trio)
    rk.rounds(buf, n, trio)
    rk.end_phase()

    rk.phase = "forms"
    rk.sync(rk.phase, trio)
    for fp8 in (False, True):
        _same_in_both_forms(rk, buf, trio, fp8)
    rk.check("same")
    rk.end_phase()

    rk.phase = "clean"
    rk.sync(rk.phase, trio)
    for q in others(trio, me):
        buf.update_mask_buffer(q, True)
    buf.update_mask_buffer(me, False)  # this slot: nothing to do
    rk.expect_slots(buf, [me], "all masked", staged=others(trio, me))
    rk.check("masked")
    rk.sync("clean-go", trio)
    buf.clean_mask_buffer()  # every staged slot published again (each waits for its peer)
    rk.expect_slots(buf, trio, "after clean_mask_buffer")
    rk.check("cleaned")
    rk.sync("cleaned", trio)
    rk.rounds(buf, n, trio, start=100)
    rk.end_phase()

    rk.phase = "reconnect"
    rk.sync(rk.phase, trio)
    buf.disconnect_ranks(trio)  # this slot is skipped
    rk.expect_slots(buf, [me], "disconnected")
    rk.check("disconnected")
    rk.sync("reconnect-go", trio)
    buf.connect_ranks(trio)
    rk.expect_slots(buf, trio, "reconnected")
    rk.check("reconnected")
    rk.sync("reconnected", trio)
    rk.rounds(buf, n, trio, start=200)
    rk.end_phase()

    rk.phase = "local"
    _local(rk, buf, on_cuda, hint)
    rk.check("local")
    rk.end_phase()

    rk.phase = "destroy"
    rk.sync(rk.phase, trio)
    if me == 2:
        buf.destroy()
        for what, call in [
            ("destroy", buf.destroy),
            ("barrier", buf.barrier),
            ("dispatch", lambda: buf.dispatch(torch.zeros(1, SPEC.H), torch.zeros(1, 1), SPEC.T)),
            ("update_memory_buffers", lambda: buf.update_memory_buffers(rk.cap, rk.epr)),
        ]:
            try:
                call()
                rk.chk.fail(f"{what} after destroy did not raise")
            except RuntimeError as e:
                rk.chk.expect("destroyed" in str(e), f"{what} after destroy: {e}")
        rk.chk.expect(buf.runtime is None, "runtime after destroy")
        rk.store.set("tl/up/destroyed", "1")
        rk.wait_keys(["tl/up/masked/0", "tl/up/masked/1"])
        buf = Buffer.create_elastic(rank=me, tcp_store_group=rk.store, **kw)  # in its place
        buf.update_memory_buffers(rk.cap, rk.epr, hint)
        buf.connect_ranks(pair)
    else:
        rk.wait_keys(["tl/up/destroyed"])
        t0 = time.monotonic()
        took = buf.barrier()
        detect_s = time.monotonic() - t0
        rk.chk.expect(took == pair, f"barrier after slot 2's destroy: {took}, want {pair}")
        rk.chk.expect(buf.slot_state(2) == "staged", f"slot_state(2) {buf.slot_state(2)!r}")
        rk.check("masked", detect_s=detect_s)
        rk.rounds(buf, 2, pair, start=300)
        buf.disconnect_ranks([2])
        rk.store.set(f"tl/up/masked/{me}", "1")
        buf.connect_ranks([2])  # waits for the new buffer in slot 2
    rk.expect_slots(buf, trio, "slot 2's new buffer connected")
    rk.check("replaced")
    rk.sync("replaced", trio)
    rk.rounds(buf, n, trio, start=400)
    rk.end_phase()


def _local(rk, buf, on_cuda: bool, hint: int) -> None:
    """get_comm_stream and get_local_buffer_tensor: the workspace's views where there is
    one (CUDA), a RuntimeError naming what is missing where there is none."""
    if on_cuda:
        stream = buf.get_comm_stream()
        rk.chk.expect(isinstance(stream, torch.cuda.Stream), f"get_comm_stream: {stream!r}")
        whole = buf.get_local_buffer_tensor(torch.uint8)
        words = buf.get_local_buffer_tensor(torch.int32, torch.Size([4, 8]), offset=64)
        rk.chk.expect(
            whole.is_cuda and whole.dim() == 1 and whole.numel() >= hint,
            f"the whole workspace: {whole.device} {list(whole.shape)}, want >= {hint} bytes",
        )
        rk.chk.expect(
            list(words.shape) == [4, 8]
            and words.dtype == torch.int32
            and words.data_ptr() == whole.data_ptr() + 64
            and words.is_contiguous(),
            f"a view at 64: {words.dtype} {list(words.shape)} at +"
            f"{words.data_ptr() - whole.data_ptr()}",
        )
        return
    if torch.cuda.is_available():
        return  # CUDA here but CPU tensors: nothing to say about a workspace
    for what, call, word in [
        ("get_comm_stream", buf.get_comm_stream, "CUDA"),
        ("get_local_buffer_tensor", lambda: buf.get_local_buffer_tensor(torch.int32), "workspace"),
    ]:
        try:
            call()
            rk.chk.fail(f"{what} on a machine without CUDA did not raise")
        except RuntimeError as e:
            rk.chk.expect(word in str(e), f"{what}: {e}")
