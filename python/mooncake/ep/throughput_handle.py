"""The high-throughput regime's handle: :class:`EPHandle` (public, upstream's fields) and
:class:`Plan` (private: what one dispatch sent where, for a cached dispatch and for
combine).

Shapes: ``N`` tokens on this rank, ``K`` top-k, ``R`` ranks, ``E/R`` local experts,
``T`` = ``num_max_tokens_per_rank``, ``M`` received tokens (rows of ``recv_x`` without
expanding), ``S`` (token, destination rank) pairs this rank sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)
class Plan:
    """One dispatch's routing, kept by its handle (``EPHandle.native_handle``).

    Tensors are int64 on the outputs' device unless said otherwise; a device path will
    keep what it needs beside them.
    """

    buffer: int  # the id of the ElasticBuffer that dispatched
    generation: int  # its membership generation then (update_ep_member bumps it)
    seq: int  # the dispatch's number on that buffer; combine rows carry it
    device: torch.device  # where the outputs live (x's device)
    exchange_device: torch.device  # where the rows moved (x's, or the host when staged)
    num_ranks: int
    num_experts: int
    num_topk: int
    max_tokens: int  # T
    num_tokens: int  # N
    rows_allocated: int  # rows of recv_x without expanding: M, or R*T without CPU sync
    expanded_allocated: int  # rows of recv_x with do_expand (0 without it)
    # --- the send side: one row per (token, destination), sorted by (destination, token)
    send_token: torch.Tensor  # [S]
    send_dest: torch.Tensor  # [S]
    send_slots: torch.Tensor  # bool [S, K]: the top-k slots whose expert is on that rank
    send_splits: torch.Tensor  # [R]: rows sent to each rank (0 where not mutual)
    # --- the receive side, in arrival order (sources in rank order, tokens in order)
    recv_splits: torch.Tensor  # [R]: rows received from each rank (exchange rows)
    kept: torch.Tensor  # bool [R]: the sources whose rows count (alive after the exchange)
    kept_rows: torch.Tensor  # [M]: the exchange row of each received token
    recv_src: torch.Tensor  # [M]: its source rank
    recv_token: torch.Tensor  # [M]: its index on the source
    recv_local: torch.Tensor  # [M, K]: local expert of each slot, -1 elsewhere
    expanded_row: torch.Tensor | None  # [M, K]: its row of recv_x with do_expand, else -1


class EPHandle:
    """What ``ElasticBuffer.dispatch`` returns for its ``combine`` and for a cached
    dispatch (``dispatch(x, handle=h)``): upstream's fields, and the routing plan.

    Tensors are int32 on ``x``'s device unless said otherwise:

    Attributes:
        do_expand: whether ``recv_x`` has one row per (token, local expert).
        num_experts: ``E``.
        expert_alignment: each local expert's row count is padded to a multiple of it.
        num_max_tokens_per_rank: ``T``.
        num_sms: the SM count the call was given (the portable path uses none).
        topk_idx: a copy of the dispatch's ``[N, K]`` expert ids.
        num_recv_tokens_per_expert_list: per local expert, the tokens it received,
            padded to ``expert_alignment`` (a Python list); empty without CPU sync.
        psum_num_recv_tokens_per_scaleup_rank: ``[R]``, inclusive prefix sum of the
            tokens received from each rank (a token counts once per rank); the last
            entry is the number of valid rows of ``recv_topk_idx``.
        psum_num_recv_tokens_per_expert: ``[E/R]``. Without expanding: the inclusive
            prefix sum of the padded per-expert counts. With it: entry ``j`` is the
            first row of expert ``j`` plus its (unpadded) count, so its rows are
            ``[psum[j] - num_unaligned_recv_tokens_per_expert[j], psum[j])``.
        num_unaligned_recv_tokens_per_expert: ``[E/R]``, the unpadded counts.
        recv_src_metadata: ``[num_recv_tokens, K + 2]``: the source's global token index
            (``source rank * T + token``), ``source rank * K + `` its first top-k slot
            on this rank, then per slot its row of ``recv_x`` when expanded (-1
            otherwise); -1 past the valid rows.
        dst_buffer_slot_idx: ``[N, K]``: for the first slot of each (token,
            destination rank), ``rank * T +`` the token's place among those sent to
            that rank; -1 for the other slots.
        token_metadata_at_forward, channel_linked_list: None (hybrid mode's).
        num_recv_tokens: rows of ``recv_x`` without expanding (exact after a CPU sync,
            else the worst case ``R * T``).
        num_expanded_tokens: rows of ``recv_x`` with expanding (0 without).
        native_handle: the routing plan (private); None in a handle built by hand,
            which dispatch and combine refuse.
    """

    def __init__(
        self,
        do_expand: bool,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: torch.Tensor,
        num_recv_tokens_per_expert_list: list[int],
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        psum_num_recv_tokens_per_expert: torch.Tensor,
        recv_src_metadata: torch.Tensor,
        dst_buffer_slot_idx: torch.Tensor,
        token_metadata_at_forward: torch.Tensor | None,
        channel_linked_list: torch.Tensor | None,
        native_handle: Plan | None = None,
        generation: int | None = None,
        *,
        num_expanded_tokens: int = 0,
        num_unaligned_recv_tokens_per_expert: torch.Tensor | None = None,
    ) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.native_handle = native_handle
        self._generation = generation
        self.num_recv_tokens = int(recv_src_metadata.shape[0])
        self.num_expanded_tokens = num_expanded_tokens
