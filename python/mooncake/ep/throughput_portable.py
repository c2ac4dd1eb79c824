"""The ElasticBuffer's portable path: dispatch and combine as torch ops over its members'
exchange (``group.GroupMembers``), for CPU tensors, and for CUDA tensors until a device
path serves them (staged through host memory when the group cannot move them).

The messages and the tensor work are ``throughput_rows``'; this module runs a call: its
argument checks, the exchanges, what a rank that failed during one means, and the
outputs. A fresh dispatch is two exchanges (counts, then tokens); a cached dispatch and a
combine are one each.

A rank whose arguments break a rule still takes part: in a fresh dispatch it sends a
counts row saying so; in a cached dispatch or a combine (one exchange) it rejects the
exchange (``members.reject``), so that every rank raises ValueError alike and the buffer
stays usable. A rank that dies during an exchange is left out by the process group, which
completes the exchange among the others with that rank's rows zero-filled: its rows are
dropped (it counts as having sent nothing) and the buffer masks it from then on.
"""

from __future__ import annotations

import torch

from .. import _checks
from . import throughput_rows as rows_
from .portable import Rephrased
from .throughput_handle import EPHandle, Plan
from .types import NO_WAIT

_DEVICE_CODES = {"cpu": 1, "cuda": 2}


def padded_rows(num_rows: int, topk: int, local_experts: int, alignment: int) -> int:
    """The most rows an expanded receive can need for ``num_rows`` received tokens."""
    rows = num_rows * min(topk, local_experts) + (alignment - 1) * local_experts
    return -(-rows // alignment) * alignment


def fresh_defaults(buf, data, topk_idx, num_experts, max_tokens, alignment, do_cpu_sync):
    """A fresh dispatch's arguments left None, filled in (both paths alike):
    ``num_experts`` as upstream's, ``topk_idx.max() + 1`` (a host read; the ranks must
    still agree on it), ``max_tokens`` the buffer's or ``N``, ``alignment`` 1,
    ``do_cpu_sync`` True.

    Returns:
        ``(num_experts, max_tokens, alignment, do_cpu_sync)``.
    """
    if (
        num_experts is None
        and isinstance(topk_idx, torch.Tensor)
        and topk_idx.dtype in _checks.INDEX_DTYPES
        and topk_idx.device == data.device
        and topk_idx.numel()
    ):
        top = int(topk_idx.max())
        num_experts = top + 1 if top >= 0 else None
    if max_tokens is None:
        max_tokens = buf.num_max_tokens_per_rank or data.shape[0] or None
    alignment = 1 if alignment is None else alignment
    do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
    return num_experts, max_tokens, alignment, do_cpu_sync


def _check_counts(rank: int, theirs: torch.Tensor, present: torch.Tensor, mine: list) -> None:
    """Reads the counts rows of the members ``present`` (bool [R]) after a fresh
    dispatch's counts exchange; ``mine`` is this rank's row (its agreed columns).

    Raises:
        ValueError: alike on every rank: a member rejected its arguments, made another
            call, or made this one with other arguments.
        RuntimeError: a member's count is out of range (corrupt data).
    """
    for s in present.nonzero().squeeze(1).tolist():
        row = theirs[s].tolist()
        if row[0] != rows_.META_MAGIC:
            raise ValueError(
                f"dispatch: ranks disagree on the call: rank {s} made another call (a cached "
                f"dispatch or a combine) while rank {rank} made a fresh dispatch"
            )
        if row[1] == rows_.STATUS_REJECTED:
            raise ValueError(
                f"dispatch: rank {s} rejected its arguments (its ValueError says why); nothing "
                f"was sent"
            )
        for col, name in rows_.AGREED.items():
            if row[col] != mine[col]:
                raise ValueError(
                    f"dispatch: ranks disagree on the call: rank {s} has {name} = {row[col]}, "
                    f"rank {rank} has {mine[col]}"
                )
        if not 0 <= row[11] <= mine[3]:
            raise RuntimeError(
                f"dispatch: rank {s} announces {row[11]} tokens, outside [0, "
                f"num_max_tokens_per_rank={mine[3]}]: its data is corrupt; nothing was received"
            )


def _short_x_error(x: torch.Tensor, handle) -> str | None:
    """A combine's x trimmed below the dispatch's valid rows (checked here, where they are
    known; the device path reads the missing rows as zero and reports them)."""
    plan = handle.native_handle
    rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
    if x.shape[0] >= rows:
        return None
    if handle.do_expand:  # up to the last expert's valid rows (its padding is not read)
        psum = handle.psum_num_recv_tokens_per_expert
        valid = int(psum[-1]) if psum.numel() else 0
    else:
        valid = plan.recv_token.numel()
    if x.shape[0] >= valid:
        return None
    return (
        f"x has {x.shape[0]} rows, fewer than the {valid} valid rows of the dispatch's layout "
        f"(it may be trimmed to them, not shorter)"
    )


class ThroughputPortable:
    """Dispatch and combine over ``members``' exchange; ``buf`` in the calls is the
    ElasticBuffer (its mask, call numbers, generation and timeouts)."""

    name = "portable"
    transport = "pg"  # the group's exchange moves the rows

    def __init__(self, members):
        self.members = members

    # --- where rows move ---------------------------------------------------------------

    def exchange_device(self, device: torch.device) -> torch.device | None:
        """Where rows of tensors on ``device`` move: there, or staged through the host
        (None: the group can move neither)."""
        for where in (device, torch.device("cpu")):
            if self.members.device_error(where) is None:
                return where
        return None

    def _reject(self, device, reason: str) -> None:
        """Takes this rank's part in the others' next exchange by failing it."""
        try:
            self.members.reject(device, reason)
        except (RuntimeError, ValueError):
            pass  # the exchange cannot run at all: the others' own exchange says so

    # --- dispatch ----------------------------------------------------------------------

    def dispatch_call(self, buf, x, topk_idx, topk_weights, num_experts, max_tokens,
                      alignment, handle, do_expand, do_cpu_sync, num_sms,
                      async_with_compute_stream):  # fmt: skip
        """``buf.dispatch`` on this path."""
        members = self.members
        R = members.num_ranks
        error, data, scales = _checks.throughput_x(x)
        if handle is not None:
            if error is None:
                error = _checks.throughput_dispatch_error(
                    R, data, scales, topk_idx, topk_weights, num_experts, max_tokens,
                    alignment, handle, do_expand, do_cpu_sync, num_sms,
                    async_with_compute_stream, buf._id, buf._generation, values=True,
                )  # fmt: skip
            return self._cached(buf, data, scales, topk_weights, handle, error)
        if error is None:
            num_experts, max_tokens, alignment, do_cpu_sync = fresh_defaults(
                buf, data, topk_idx, num_experts, max_tokens, alignment, do_cpu_sync
            )
            error = _checks.throughput_dispatch_error(
                R, data, scales, topk_idx, topk_weights, num_experts, max_tokens, alignment,
                None, do_expand, do_cpu_sync, num_sms, async_with_compute_stream, buf._id,
                buf._generation, values=True,
            )  # fmt: skip
        ex_dev = None
        if error is None:
            ex_dev = self.exchange_device(data.device)
            if ex_dev is None:
                error = f"x is on {data.device}, which the group's exchange cannot move"
        return self._fresh(
            buf, data, scales, topk_idx, topk_weights, num_experts, max_tokens, alignment,
            do_expand, do_cpu_sync, num_sms, error, ex_dev,
        )  # fmt: skip

    def _fresh(self, buf, data, scales, topk_idx, topk_weights, E, T, alignment, do_expand,
               do_cpu_sync, num_sms, error, ex_dev):  # fmt: skip
        members = self.members
        R, me = members.num_ranks, members.rank
        ok = error is None
        control = members.control_device()

        # 1. counts, shapes and consent
        meta = torch.zeros(R, rows_.META_COLS, dtype=torch.int64)
        meta[:, 0] = rows_.META_MAGIC
        meta[:, 1] = rows_.STATUS_OK if ok else rows_.STATUS_REJECTED
        meta[:, 12] = buf._seq + 1
        if ok:
            epr, K, H = E // R, topk_idx.shape[1], data.shape[1]
            sends = rows_.route(topk_idx, R, epr, me, T)
            accept = buf._active & members.present(R)
            meta[:, 2] = accept.long()
            mine = [0, 0, 0, T, E, K, H, rows_.payload_code(data, scales),
                    0 if scales is None else scales.shape[1], int(topk_weights is not None),
                    _DEVICE_CODES[data.device.type]]  # fmt: skip
            meta[:, 3:11] = torch.tensor(mine[3:11])
            meta[:, 11] = sends.counts.cpu()
        theirs = torch.zeros_like(meta, device=control)  # rows of ranks that send nothing: 0
        budget = buf._cpu_timeout_us if ok else -1
        try:
            members.all_to_all(control, theirs, meta.to(control), [1] * R, [1] * R, budget).wait()
        except ValueError as e:
            if error:
                raise ValueError(f"dispatch: {error}") from None
            raise ValueError(
                f"dispatch: ranks disagree on the call (a rank rejected its arguments, or made "
                f"another call); nothing was sent: {e}"
            ) from None
        theirs = theirs.cpu()
        present = members.present(R)
        buf._seq = max(int(theirs[present, 12].max()), buf._seq + 1)  # present: me too
        if error:
            raise ValueError(f"dispatch: {error}")
        try:
            _check_counts(me, theirs, present, mine)
        except RuntimeError as e:
            # Corrupt counts are seen by this rank alone: it rejects the tokens exchange,
            # so that every member's dispatch fails, naming it.
            self._reject(ex_dev, str(e))
            raise
        mutual = accept & present & (theirs[:, 2] == 1)

        # 2. tokens
        device = data.device
        to = mutual.to(device)[sends.dest]
        layout = rows_.row_layout(
            K, True, topk_weights is not None, H * data.element_size(),
            0 if scales is None else scales.shape[1] * 4,
        )  # fmt: skip
        send_token, send_dest = sends.token[to], sends.dest[to]
        out = rows_.pack(layout, send_token, rows_.KIND_FRESH, data, scales, topk_idx, topk_weights)
        send_splits = sends.counts.cpu() * mutual
        recv_splits = theirs[:, 11] * mutual
        recv = torch.empty(int(recv_splits.sum()), layout.nbytes, dtype=torch.uint8, device=ex_dev)
        work = members.all_to_all(
            ex_dev, recv, out.to(ex_dev), recv_splits, send_splits, buf._gpu_timeout_us
        )
        Rephrased(work, "dispatch: ranks disagree on the call; nothing was received").wait()
        kept = mutual & self._after_exchange(buf)
        recv = recv.to(device)

        # 3. the received tokens, in arrival order
        src_of = torch.repeat_interleave(torch.arange(R, device=device), recv_splits.to(device))
        kept_rows = kept.to(device)[src_of].nonzero().squeeze(1)
        got = recv.index_select(0, kept_rows)
        head = rows_.header(got)
        token, src = head[:, 0].long(), src_of[kept_rows]
        bad = (head[:, 1] != rows_.KIND_FRESH) | (token < 0) | (token >= T)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise RuntimeError(
                f"dispatch: a row from rank {int(src[i])} has header {head[i].tolist()}, not a "
                f"fresh dispatch's token below num_max_tokens_per_rank={T}: the data is corrupt"
            )
        global_idx = rows_.section(got, layout.idx, 4 * K, torch.int32)
        ex = rows_.experts_of(global_idx, me, epr, alignment)
        m = got.shape[0]
        rows_allocated = m if do_cpu_sync else R * T
        expanded = 0
        if do_expand:
            expanded = (
                int(ex.padded.sum()) if do_cpu_sync else padded_rows(R * T, K, epr, alignment)
            )
        plan = Plan(
            buf._id, buf._generation, buf._seq, device, ex_dev, R, E, K, T, data.shape[0],
            rows_allocated, expanded, send_token, send_dest, sends.slots[to],
            send_splits, recv_splits, kept, kept_rows, src, token, ex.local,
            ex.expanded_row if do_expand else None,
        )  # fmt: skip
        outs = self._outputs(plan, got, layout, data, scales, topk_idx, topk_weights)

        # 4. the handle
        counts = torch.bincount(src, minlength=R)
        metadata = torch.full((rows_allocated, K + 2), -1, dtype=torch.int32, device=device)
        if m:
            first_local = (ex.local >= 0).int().argmax(1)
            metadata[:m, 0] = (src * T + token).to(torch.int32)
            metadata[:m, 1] = (src * K + first_local).to(torch.int32)
            if do_expand:
                metadata[:m, 2:] = ex.expanded_row.to(torch.int32)
        psum_expert = ex.start + ex.counts if do_expand else torch.cumsum(ex.padded, 0)
        slot_dest = torch.where(topk_idx >= 0, topk_idx.long() // epr, R)
        reached = torch.cat([mutual, torch.zeros(1, dtype=torch.bool)]).to(device)[slot_dest]
        handle = EPHandle(
            do_expand, E, alignment, T, 0 if num_sms is None else num_sms, topk_idx.clone(),
            ex.padded.tolist() if do_cpu_sync else [],
            torch.cumsum(counts, 0).to(torch.int32),
            psum_expert.to(torch.int32),
            metadata,
            torch.where(reached, sends.dst_slot, -1),
            None,
            None,
            plan,
            buf._generation,
            num_expanded_tokens=expanded,
            num_unaligned_recv_tokens_per_expert=ex.counts.to(torch.int32),
        )  # fmt: skip
        return (*outs[:3], handle, NO_WAIT)

    def _outputs(self, plan: Plan, got, layout, data, scales, idx_like, topk_weights,
                 row_ok=None):  # fmt: skip
        """``(recv_x | (recv_x, scales), recv_topk_idx, recv_topk_weights)`` from the kept
        token rows ``got`` (in arrival order); ``recv_topk_idx`` takes ``idx_like``'s
        dtype; ``row_ok`` (bool [M]): the rows that count (None: all), the others read as
        a token of no expert."""
        device, m, K = plan.device, got.shape[0], plan.num_topk
        H = data.shape[1]
        local = plan.recv_local
        if row_ok is not None and not bool(row_ok.all()):
            # Zero bytes read as zero data, scales and weights, whatever their dtypes.
            got = torch.where(row_ok.unsqueeze(1), got, got.new_zeros(()))
            local = torch.where(row_ok.unsqueeze(1), local, -1)
        payload = rows_.section(got, layout.data, layout.data_bytes, data.dtype).reshape(m, H)
        sf = None
        if scales is not None:
            packs = scales.shape[1]
            sf = rows_.section(got, layout.scales, 4 * packs, scales.dtype).reshape(m, packs)
        w = None
        if topk_weights is not None:
            w = rows_.section(got, layout.weights, 4 * K, torch.float32)
        idx_dtype = idx_like.dtype
        recv_idx = torch.full((plan.rows_allocated, K), -1, dtype=idx_dtype, device=device)
        recv_idx[:m] = local.to(idx_dtype)
        if plan.expanded_row is None:
            rows_out = plan.rows_allocated
            recv_x = torch.zeros(rows_out, H, dtype=data.dtype, device=device)
            recv_x[:m] = payload
            recv_sf = None
            if sf is not None:
                recv_sf = torch.zeros(rows_out, sf.shape[1], dtype=sf.dtype, device=device)
                recv_sf[:m] = sf
            recv_w = None
            if w is not None:
                recv_w = torch.zeros(rows_out, K, dtype=torch.float32, device=device)
                recv_w[:m] = w
        else:
            rows_out, at = plan.expanded_allocated, plan.expanded_row
            recv_x = torch.zeros(rows_out, H, dtype=data.dtype, device=device)
            rows_.scatter_expanded(recv_x, payload, at)
            recv_sf = None
            if sf is not None:
                recv_sf = torch.zeros(rows_out, sf.shape[1], dtype=sf.dtype, device=device)
                rows_.scatter_expanded(recv_sf, sf, at)
            recv_w = None
            if w is not None:
                recv_w = torch.zeros(rows_out, dtype=torch.float32, device=device)
                i, k = (at >= 0).nonzero(as_tuple=True)
                recv_w[at[i, k]] = w[i, k]
        recv = (recv_x, recv_sf) if recv_sf is not None else recv_x
        return recv, recv_idx, recv_w

    def _cached(self, buf, data, scales, topk_weights, handle, error):
        """A dispatch along a handle's routing: one exchange, no counts, no CPU sync."""
        members = self.members
        plan = getattr(handle, "native_handle", None)
        if error:
            # The others' exchange runs where the handle's rows move (a bad handle: the
            # control device, where a rank's own fresh dispatch would meet them).
            where = plan.exchange_device if isinstance(plan, Plan) else members.control_device()
            self._reject(where, f"dispatch: {error}")
            raise ValueError(f"dispatch: {error}")
        K, H = plan.num_topk, data.shape[1]
        layout = rows_.row_layout(
            K, False, topk_weights is not None, H * data.element_size(),
            0 if scales is None else scales.shape[1] * 4,
        )  # fmt: skip
        out = rows_.pack(layout, plan.send_token, rows_.KIND_CACHED, data, scales, None,
                         topk_weights)  # fmt: skip
        ex_dev = plan.exchange_device
        recv = torch.empty(int(plan.recv_splits.sum()), layout.nbytes, dtype=torch.uint8,
                           device=ex_dev)  # fmt: skip
        work = members.all_to_all(
            ex_dev, recv, out.to(ex_dev), plan.recv_splits, plan.send_splits, buf._gpu_timeout_us
        )
        Rephrased(
            work,
            "dispatch: ranks disagree on the call (a rank rejected its arguments, made "
            "another call, or passes a handle of another shape); nothing was received",
        ).wait()
        now = self._after_exchange(buf)
        got = recv.to(plan.device).index_select(0, plan.kept_rows)
        row_ok = now.to(plan.device)[plan.recv_src]
        head = rows_.header(got)
        bad = row_ok & ((head[:, 1] != rows_.KIND_CACHED) | (head[:, 0].long() != plan.recv_token))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"dispatch: rank {int(plan.recv_src[i])} sent rows of another call (its header "
                f"{head[i, :2].tolist()}, this handle's token {int(plan.recv_token[i])}): the "
                f"ranks must pass handles of the same dispatch"
            )
        outs = self._outputs(plan, got, layout, data, scales, handle.topk_idx, topk_weights, row_ok)
        return (*outs, handle, NO_WAIT)

    def _after_exchange(self, buf) -> torch.Tensor:
        """The members still present after an exchange (bool [R]); the buffer masks the
        others from now on."""
        now = self.members.present(self.members.num_ranks)
        buf._active &= now
        buf._active_changes += 1
        return now

    # --- combine -----------------------------------------------------------------------

    def combine_call(self, buf, x, handle, topk_weights, num_sms, async_with_compute_stream):
        """``buf.combine`` on this path."""
        members = self.members
        R = members.num_ranks
        error = _checks.throughput_combine_error(
            x, handle, topk_weights, num_sms, async_with_compute_stream, buf._id,
            buf._generation,
        )  # fmt: skip
        if error is None:
            error = _short_x_error(x, handle)
        if error:
            plan = getattr(handle, "native_handle", None)
            where = plan.exchange_device if isinstance(plan, Plan) else members.control_device()
            self._reject(where, f"combine: {error}")
            raise ValueError(f"combine: {error}")
        plan = handle.native_handle
        single = handle.do_expand and not buf.allow_multiple_reduction
        back, token_of = rows_.reply_rows(
            x, topk_weights, plan.recv_token, plan.expanded_row, single, plan.seq
        )
        in_splits = torch.bincount(plan.recv_src[token_of], minlength=R).cpu()
        ret = rows_.expected_returns(plan.send_token, plan.send_dest, plan.send_slots, R, single)
        layout = rows_.combine_layout(plan.num_topk, topk_weights is not None, x.shape[1], x.dtype)
        ex_dev = plan.exchange_device
        returned = torch.empty(int(ret.splits.sum()), layout.nbytes, dtype=torch.uint8,
                               device=ex_dev)  # fmt: skip
        work = members.all_to_all(
            ex_dev, returned, back.to(ex_dev), ret.splits.cpu(), in_splits, buf._gpu_timeout_us
        )
        Rephrased(
            work,
            "combine: ranks disagree on the call (a rank rejected its arguments, or they pass "
            "handles of different dispatches, or x of other widths or dtypes); nothing was "
            "combined",
        ).wait()
        now = self._after_exchange(buf).to(plan.device)
        returned = returned.to(plan.device)
        head = rows_.header(returned)
        want_slot = ret.slot if single else torch.full_like(ret.slot, -1)
        bad = now[ret.dest] & (
            (head[:, 0].long() != ret.token)
            | (head[:, 1] != plan.seq)
            | (head[:, 2].long() != want_slot)
            | (head[:, 3] != rows_.payload_code(x, None))
        )
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"combine: rank {int(ret.dest[i])} combined another dispatch's output, or x "
                f"of another dtype (header {head[i].tolist()}, expected token "
                f"{int(ret.token[i])} of dispatch #{plan.seq}, dtype {x.dtype}): the ranks "
                f"must pass handles of the same dispatch and x of the same dtype"
            )
        combined, weights = rows_.sum_returns(
            returned, ret, plan.send_slots, plan.send_token, plan.send_dest, now,
            plan.num_tokens, plan.num_topk, layout, x.dtype, single,
        )  # fmt: skip
        return combined, weights, NO_WAIT
