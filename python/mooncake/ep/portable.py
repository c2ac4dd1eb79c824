"""The portable EP path: a Buffer's dispatch and combine as torch ops over its members.

It serves every call the device path does not (CPU tensors first of all), for
either kind of members (``group.GroupMembers`` or ``elastic.Slots``):
it only asks them how many ranks a call covers, who is present, and to run an
exchange. The messages and the tensor work are ``portable_rows``'; this module
runs a call: its argument checks, the counts and tokens exchanges, and the
receive half that ``hook()`` or the event may defer.

A rank whose arguments break a rule still takes part in the exchanges (sending
nothing, and saying so in its counts), so that every rank raises ValueError alike
and the members stay usable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _checks
from . import portable_rows
from .types import NO_HOOK, DispatchHandle, EventOverlap, HandleState


class _Pending:
    """The receive half of a call: wait for the exchange, then fill the outputs."""

    def __init__(self, work, finish: Callable[[], None]):
        self._work, self._finish, self._done = work, finish, False

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        if self._work is not None:
            self._work.wait()
        self._finish()


class Rephrased:
    """A Work whose ValueError (the ranks' calls disagree) gets a message saying so."""

    def __init__(self, work, what: str):
        self._work, self._what = work, what

    def wait(self) -> None:
        try:
            self._work.wait()
        except ValueError as e:
            raise ValueError(f"{self._what}: {e}") from None


@dataclass(slots=True, eq=False)
class Exchange:
    """What a dispatch sent where and received from whom: its combine sends the rows
    back the same way (``HandleState.exchange``)."""

    route: portable_rows.Route  # this rank's selections, sorted by destination
    sent: torch.Tensor  # bool [S]: the selections that went to a rank that took them
    send_splits: torch.Tensor  # int64 [R]: rows sent to each rank
    recv_splits: torch.Tensor  # int64 [R]: rows received from each rank
    arrival: portable_rows.Arrival | None = None  # where the received rows went (the receive half)
    recv_rows: int = 0


def _mark_failed(active_ranks, present: torch.Tensor) -> None:
    if active_ranks is None:
        return
    gone = (~present).nonzero().squeeze(1)
    if gone.numel():
        active_ranks[gone.to(active_ranks.device)] = 0


def check_peers(rank: int, theirs, present, T, H, E, use_fp8) -> None:
    """Reads the counts rows ``theirs`` of the members ``present`` (bool [R]) after a
    dispatch's counts exchange, on rank ``rank``.

    Raises:
        ValueError: alike on every rank, a member rejected its arguments or called
            with another shape.
        RuntimeError: a member's counts are out of range (corrupt data).
    """
    for s in present.nonzero().squeeze(1).tolist():
        row = theirs[s].tolist()
        if row[4] == portable_rows.STATUS_REJECTED:
            raise ValueError(
                f"dispatch: rank {s} rejected its arguments (its ValueError says why); "
                f"nothing was sent"
            )
        if row[:4] != [T, H, E, int(use_fp8)]:
            raise ValueError(
                f"dispatch: ranks disagree on the call: rank {s} has "
                f"num_max_dispatch_tokens_per_rank={row[0]}, hidden={row[1]}, "
                f"num_experts={row[2]}, use_fp8={bool(row[3])}; rank {rank} "
                f"has {T}, {H}, {E}, {use_fp8}"
            )
        # A source sends each of this rank's experts at most T tokens (a token
        # selects an expert once): more, or fewer than 0, is corrupt data, and
        # would size the receive buffers from it.
        counts = row[portable_rows.META_COLS :]
        if counts and not (0 <= min(counts) and max(counts) <= T):
            raise RuntimeError(
                f"dispatch: rank {s} announces between {min(counts)} and {max(counts)} "
                f"tokens for this rank's experts, outside [0, "
                f"num_max_dispatch_tokens_per_rank={T}]: its data is corrupt; nothing "
                f"was received"
            )


class PortablePath:
    """Dispatch and combine over ``members``' exchange; any device their exchange serves.

    ``buf`` in the calls is the Buffer: its workspace size, call numbers and zero-copy
    buffers are shared with its device path.
    """

    def __init__(self, members):
        self.members = members

    # --- dispatch ----------------------------------------------------------------------

    def dispatch_call(
        self, buf, x, topk_idx, active_ranks, T, num_experts, timeout_us, use_fp8, async_finish,
        return_recv_hook, stats,
    ):  # fmt: skip
        """``buf.dispatch`` on this path."""
        members = self.members
        R = members.call_ranks(num_experts)
        buf.path = "portable"
        error = _checks.dispatch_error(
            members, buf.num_ep_buffer_bytes, x, topk_idx, active_ranks, T, num_experts,
            timeout_us, use_fp8, stats, async_finish, return_recv_hook, values=True,
        )  # fmt: skip
        ok = error is None
        device = x.device if ok else None
        epr = members.local_experts(num_experts, R)
        # Each exchange has the whole timeout_us from its own start: a peer that answered
        # the counts is not masked in the tokens exchange because the counts exchange spent
        # the budget waiting for another, silent, peer.
        budget = timeout_us if ok else -1
        mask = (
            (members.present(R) if active_ranks is None else active_ranks.cpu().bool())
            if ok
            else torch.zeros(R, dtype=torch.bool)
        )

        # 1. counts, shapes and consent
        meta = torch.zeros(R, portable_rows.META_COLS + epr, dtype=torch.int64)
        if ok:
            H = x.shape[1]
            r = portable_rows.route(topk_idx, R, epr)
            meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = T, H, num_experts, int(use_fp8)
            meta[:, portable_rows.META_COLS :] = r.counts.cpu()
        meta[:, 4] = portable_rows.STATUS_OK if ok else portable_rows.STATUS_REJECTED
        meta[:, 5] = mask.long()
        meta = meta.to(device or "cpu")
        theirs = torch.zeros_like(meta)  # rows of ranks that send nothing stay 0
        try:
            members.all_to_all(device, theirs, meta, [1] * R, [1] * R, budget).wait()
        except ValueError as e:
            if error:
                raise ValueError(f"dispatch: {error}") from None
            raise ValueError(
                f"dispatch: ranks disagree on the call (a rank rejected its arguments, or they "
                f"pass different num_experts); nothing was sent: {e}"
            ) from None
        if error:
            raise ValueError(f"dispatch: {error}")
        theirs = theirs.cpu()
        present = members.present(R)
        try:
            check_peers(members.rank, theirs, present, T, H, num_experts, use_fp8)
        except RuntimeError as e:
            # Corrupt counts are seen by this rank alone: it takes its part in the tokens
            # exchange by rejecting it, so that every member's dispatch fails, naming it.
            members.reject(device, str(e))
            raise
        mutual = mask & present & (theirs[:, 5] == 1)

        # 2. tokens
        sent = mutual.to(r.dest.device)[r.dest]
        rows, row_bytes = portable_rows.pack_tokens(x, r, sent, use_fp8)
        buffer_counts = theirs[:, portable_rows.META_COLS :] * mutual.unsqueeze(1).long()
        send_splits = (r.counts.cpu() * mutual.unsqueeze(1).long()).sum(1)
        recv_splits = buffer_counts.sum(1)
        recv = torch.empty(int(recv_splits.sum()), row_bytes, dtype=torch.uint8, device=device)
        work = members.all_to_all(device, recv, rows, recv_splits, send_splits, budget)

        if use_fp8:
            recv_x = (
                torch.empty(epr, R * T, H, dtype=torch.float8_e4m3fn, device=device),
                # Token stride 1, as upstream's (and the device path's): FP8 grouped
                # GEMMs read the scales of one channel block for many tokens.
                torch.empty_strided(
                    (epr, R * T, H // 128),
                    (H // 128 * R * T, 1, R * T),
                    dtype=torch.float32,
                    device=device,
                ),
            )
        else:
            recv_x = torch.empty(epr, R * T, H, dtype=x.dtype, device=device)
        recv_count = torch.zeros(epr, dtype=torch.int32, device=device)
        buf._seq += 1
        exchange = Exchange(r, sent, send_splits, recv_splits)
        state = HandleState(
            buf._id,
            buf._seq,
            torch.bfloat16 if use_fp8 else x.dtype,
            x.shape[0],
            topk_idx.clone(),
            finished=False,
            exchange=exchange,
            members=buf._members_epoch,
        )
        handle = DispatchHandle(
            torch.full((epr, R * T), -1, dtype=torch.int32, device=device),
            torch.zeros(epr, R, dtype=torch.int64, device=device),
            T,
            H,
            num_experts,
            state,
        )

        def finish() -> None:
            now = members.present(R)
            _mark_failed(active_ranks, now)
            kept = (mutual & now).to(device)
            a = portable_rows.place(recv, buffer_counts.to(device), kept, T)
            portable_rows.unpack_tokens(recv, a, recv_x, x.dtype, H, use_fp8)
            handle.src_info[a.local_expert, a.column] = a.token.to(torch.int32)
            per_expert = a.counts.t()
            start = torch.cumsum(per_expert, 1) - per_expert
            handle.layout_range.copy_((start << 32) | per_expert)
            recv_count.copy_(per_expert.sum(1).to(torch.int32))
            if stats is not None:
                stats.add_(recv_count)
            exchange.arrival, exchange.recv_rows = a, recv.shape[0]
            state.finished = True

        pending = _Pending(work, finish)
        if not async_finish and not return_recv_hook:
            pending()
        event = EventOverlap(finish=pending if async_finish else None)
        return recv_x, recv_count, handle, event, pending if return_recv_hook else NO_HOOK

    # --- combine -----------------------------------------------------------------------

    def combine_call(
        self, buf, x, topk_idx, topk_weights, active_ranks, timeout_us, handle, zero_copy,
        async_finish, return_recv_hook, out,
    ):  # fmt: skip
        """``buf.combine`` for a handle of this path (or a bad one)."""
        members = self.members
        valid = isinstance(handle, DispatchHandle) and handle.state is not None
        R = handle.layout_range.shape[1] if valid else members.call_ranks(None, "combine")
        error = _checks.combine_error(
            buf._id, buf._seq, buf._combine_buffers, x, topk_idx, topk_weights, active_ranks,
            timeout_us, handle, zero_copy, async_finish, return_recv_hook, out,
            members=buf._members_epoch, values=True,
        )  # fmt: skip
        if error:
            # Still take part in the exchange (sending and expecting nothing), so
            # that the others fail alike instead of waiting for this rank.
            empty = torch.empty(0, dtype=torch.uint8)
            try:
                members.all_to_all(None, empty, empty, [0] * R, [0] * R, -1).wait()
            except (ValueError, RuntimeError):
                pass
            raise ValueError(f"combine: {error}")
        device = x.device
        state = handle.state
        ex = state.exchange
        back = portable_rows.gather_outputs(x, ex.arrival, ex.recv_rows)
        sent_rows = int(ex.send_splits.sum())
        returned = torch.empty(sent_rows, x.shape[2], dtype=x.dtype, device=device)
        work = members.all_to_all(
            device, returned, back, ex.send_splits, ex.recv_splits, timeout_us
        )
        work = Rephrased(
            work,
            "combine: ranks disagree on the call (a rank rejected its arguments, or they pass "
            "handles of different dispatches); nothing was combined",
        )
        mask = None if active_ranks is None else active_ranks.cpu().bool()
        num_tokens = state.num_tokens
        result = (
            out
            if out is not None
            else torch.empty(num_tokens, x.shape[2], dtype=x.dtype, device=device)
        )
        r, sent = ex.route, ex.sent

        def finish() -> None:
            now = members.present(R)
            _mark_failed(active_ranks, now)
            alive = now if mask is None else now & mask
            used = alive.to(device)[r.dest[sent]]
            acc = portable_rows.weighted_sum(returned, r, sent, used, topk_weights, num_tokens)
            result.copy_(acc)

        pending = _Pending(work, finish)
        if not async_finish and not return_recv_hook:
            pending()
        event = EventOverlap(finish=pending if async_finish else None)
        return result, event, pending if return_recv_hook else NO_HOOK
