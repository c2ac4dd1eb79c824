"""The high-throughput portable path's messages and tensor work (``ElasticBuffer``).

Torch ops on the caller's device; ``throughput_portable`` runs a call with them over the
buffer's members. Three exchanges, each an uneven all-to-all of uint8 rows:

1. **counts** (a fresh dispatch only): every rank sends every rank one int64 row
   (:data:`META_COLS`): the call's shape, whether it rejected its arguments, whether it
   takes that rank's tokens (its mask), how many tokens it sends it, and the number it
   gives this dispatch (every rank takes the highest, so the numbers stay in step even
   after calls that failed on some ranks only).
2. **tokens**: one row per (token, destination rank), a token going to a rank once
   however many of its experts live there, sorted by (destination, token), so a
   receiver gets them by source rank, then token: the fixed order of ``recv_x``. A row
   is a 16-byte header (int32 source token, int32 call kind), then (fresh dispatch) the
   token's K expert ids as int32, (with weights) its K fp32 weights, then its data and
   (pre-quantised input) its scales, each section 8-byte aligned (:class:`RowLayout`).
3. **combine**: each receiver sends back, per received token, its expert output (with
   ``do_expand``, the fp32 sum of the token's expanded rows, rounded once to the dtype;
   with ``allow_multiple_reduction=False``, each expanded row on its own) in the order
   the tokens came, headed by (source token, dispatch number, top-k slot) so a source
   can tell another dispatch's rows from its own. Each token's rows are summed in fp32,
   slot by slot in top-k order, and rounded once.

Nothing here knows about failures beyond a bool per rank: rows of ranks outside it are
left out (they came zero-filled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import portable_rows

HEADER_BYTES = 16
#: The kinds of token rows; a receiver refuses rows of the other kind (ranks that mix a
#: fresh and a cached dispatch in one call).
KIND_FRESH, KIND_CACHED = 1, 2
#: Columns of a counts row: magic, status, accept, T, E, K, H, payload, packs, weights,
#: device, tokens, dispatch number (the ranks take the highest: combine rows carry it).
META_COLS = 13
META_MAGIC = 0x4854  # "HT": a counts row, not another call's tokens
STATUS_OK, STATUS_REJECTED = 1, 2
#: What each agreed column of a counts row means (column -> argument), for messages.
AGREED = {3: "num_max_tokens_per_rank", 4: "num_experts", 5: "num_topk", 6: "hidden",
          7: "x's dtype", 8: "scale columns", 9: "topk_weights given", 10: "x's device"}  # fmt: skip

_DTYPE_CODES = {
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float32: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.int32: 6,
}


def payload_code(data: torch.Tensor, scales: torch.Tensor | None) -> int:
    """The data (and scales) dtypes of a call as one int, for the ranks to compare."""
    return _DTYPE_CODES[data.dtype] + (16 * _DTYPE_CODES[scales.dtype] if scales is not None else 0)


def _align8(n: int) -> int:
    return -(-n // 8) * 8


@dataclass(frozen=True)
class RowLayout:
    """Byte offsets of a row's sections (each 8-byte aligned; absent ones are empty)."""

    idx: int
    weights: int
    data: int
    scales: int
    nbytes: int
    num_topk: int
    data_bytes: int
    scale_bytes: int


def row_layout(num_topk: int, with_idx: bool, with_weights: bool, data_bytes: int,
               scale_bytes: int = 0) -> RowLayout:  # fmt: skip
    idx = HEADER_BYTES
    weights = idx + (_align8(4 * num_topk) if with_idx else 0)
    data = weights + (_align8(4 * num_topk) if with_weights else 0)
    scales = data + _align8(data_bytes)
    return RowLayout(
        idx, weights, data, scales, _align8(scales + scale_bytes), num_topk, data_bytes,
        scale_bytes,
    )  # fmt: skip


def section(rows: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[offset, offset + nbytes)`` of every row, as ``dtype`` ``[rows, n]``."""
    return rows[:, offset : offset + nbytes].contiguous().view(dtype)


def _put(rows: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    """Writes ``values`` ([rows, n] of any dtype) at ``offset`` of every row."""
    raw = portable_rows.dense(values).view(torch.uint8)
    rows[:, offset : offset + raw.shape[1]].copy_(raw)


def header(rows: torch.Tensor) -> torch.Tensor:
    """int32 ``[rows, 4]``: the headers."""
    return section(rows, 0, HEADER_BYTES, torch.int32)


# --- dispatch: the send side --------------------------------------------------------------


@dataclass
class Sends:
    """Where this rank's tokens go: one row per (token, destination rank)."""

    token: torch.Tensor  # int64 [S], sorted by (destination, token)
    dest: torch.Tensor  # int64 [S]
    slots: torch.Tensor  # bool [S, K]: the slots whose expert is on that destination
    counts: torch.Tensor  # int64 [R]
    dst_slot: torch.Tensor  # int32 [N, K]: EPHandle.dst_buffer_slot_idx


def route(topk_idx: torch.Tensor, num_ranks: int, local_experts: int, rank: int,
          max_tokens: int) -> Sends:  # fmt: skip
    """The (token, destination) pairs of ``topk_idx`` ([N, K], -1 = none)."""
    n, k = topk_idx.shape
    idx = topk_idx.long()
    dest = torch.where(idx >= 0, idx // local_experts, -1)
    hit = torch.zeros(n, num_ranks + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(1, torch.where(dest >= 0, dest, num_ranks), True)
    pairs = hit[:, :num_ranks].t().nonzero()  # by destination, then token
    d, t = pairs[:, 0], pairs[:, 1]
    slots = dest[t] == d.unsqueeze(1)
    counts = torch.bincount(d, minlength=num_ranks)
    first = torch.cumsum(counts, 0) - counts
    place = torch.arange(d.numel(), device=idx.device) - first[d]
    dst_slot = torch.full((n, k), -1, dtype=torch.int32, device=idx.device)
    if d.numel():
        master = slots.int().argmax(1)
        dst_slot[t, master] = (rank * max_tokens + place).to(torch.int32)
    return Sends(t, d, slots, counts, dst_slot)


def pack(layout: RowLayout, tokens: torch.Tensor, kind: int, data: torch.Tensor,
         scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
         weights: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """The token rows of ``tokens`` (int64 [S]), as uint8 ``[S, layout.nbytes]``."""
    s = tokens.numel()
    rows = torch.zeros(s, layout.nbytes, dtype=torch.uint8, device=data.device)
    if s == 0:
        return rows
    head = torch.zeros(s, 4, dtype=torch.int32, device=data.device)
    head[:, 0], head[:, 1] = tokens, kind
    _put(rows, 0, head)
    if topk_idx is not None:
        _put(rows, layout.idx, topk_idx.index_select(0, tokens).to(torch.int32))
    if weights is not None:
        _put(rows, layout.weights, weights.index_select(0, tokens).float())
    end = layout.data + layout.data_bytes
    portable_rows.gather_rows(rows[:, layout.data : end], _row_bytes(data), tokens)
    if scales is not None:
        end = layout.scales + layout.scale_bytes
        portable_rows.gather_rows(rows[:, layout.scales : end], _row_bytes(scales), tokens)
    return rows


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows as uint8 ``[N, bytes]`` (dense)."""
    t = portable_rows.dense(t)
    return t.view(torch.uint8).reshape(t.shape[0], -1)


# --- dispatch: the receive side ------------------------------------------------------------


@dataclass
class Experts:
    """Per received token, its local experts; per local expert, its received tokens."""

    local: torch.Tensor  # int64 [M, K]: local expert of each slot, -1 elsewhere
    counts: torch.Tensor  # int64 [E/R], unpadded
    padded: torch.Tensor  # int64 [E/R], padded to the alignment
    start: torch.Tensor  # int64 [E/R]: first expanded row of each expert
    expanded_row: torch.Tensor  # int64 [M, K]: row of recv_x with do_expand, -1 elsewhere


def experts_of(global_idx: torch.Tensor, rank: int, local_experts: int,
               alignment: int) -> Experts:  # fmt: skip
    """``global_idx`` ([M, K] expert ids a token selected, any rank's) seen by ``rank``.

    Expanded rows: per local expert in order, its tokens in arrival order, each expert's
    block padded to a multiple of ``alignment``.
    """
    g = global_idx.long()
    mine = (g >= rank * local_experts) & (g < (rank + 1) * local_experts)
    local = torch.where(mine, g - rank * local_experts, -1)
    pairs = mine.nonzero()  # by token, then slot
    i, k = pairs[:, 0], pairs[:, 1]
    j = local[i, k]
    order = torch.argsort(j * max(g.shape[0], 1) + i, stable=True)
    i, k, j = i[order], k[order], j[order]
    counts = torch.bincount(j, minlength=local_experts)
    padded = -(-counts // alignment) * alignment
    start = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(j.numel(), device=g.device) - first[j]
    expanded = torch.full_like(local, -1)
    expanded[i, k] = start[j] + rank_in_expert
    return Experts(local, counts, padded, start, expanded)


def scatter_expanded(out: torch.Tensor, rows: torch.Tensor, expanded_row: torch.Tensor) -> None:
    """``out[expanded_row[i, k]] = rows[i]`` for every slot with a row."""
    i, k = (expanded_row >= 0).nonzero(as_tuple=True)
    if i.numel():
        out[expanded_row[i, k]] = rows[i]


# --- combine -------------------------------------------------------------------------------


def combine_layout(num_topk: int, with_weights: bool, hidden: int, dtype: torch.dtype) -> RowLayout:
    return row_layout(num_topk, False, with_weights, hidden * dtype.itemsize)


def reply_rows(x: torch.Tensor, weights: torch.Tensor | None, recv_token: torch.Tensor,
               expanded_row: torch.Tensor | None, single: bool,
               seq: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A receiver's combine rows, in arrival order, and which received token each row
    answers (int64, for the split sizes). Headers: (source token, dispatch number
    ``seq``, top-k slot or -1, the dtype's code).

    ``x``: ``[M, H]`` (one row per received token) or, with ``expanded_row``, the
    expanded ``[rows, H]``; ``weights``: ``[M, K]`` / ``[rows]`` or None.
    """
    m = recv_token.numel()
    k_all = expanded_row.shape[1] if expanded_row is not None else (
        weights.shape[1] if weights is not None else 0)  # fmt: skip
    if expanded_row is None:
        token_of = torch.arange(m, device=x.device)
        slot_of = torch.full((m,), -1, dtype=torch.int64, device=x.device)
        data = x[:m]
        w = weights[:m].float() if weights is not None else None
    elif single:
        token_of, slot_of = (expanded_row[:m] >= 0).nonzero(as_tuple=True)
        rows_of = expanded_row[token_of, slot_of]
        data = x.index_select(0, rows_of)
        w = None
        if weights is not None:
            w = torch.zeros(token_of.numel(), k_all, dtype=torch.float32, device=x.device)
            w[torch.arange(token_of.numel(), device=x.device), slot_of] = weights[rows_of].float()
    else:
        token_of = torch.arange(m, device=x.device)
        slot_of = torch.full((m,), -1, dtype=torch.int64, device=x.device)
        acc = torch.zeros(m, x.shape[1], dtype=torch.float32, device=x.device)
        w = (
            torch.zeros(m, k_all, dtype=torch.float32, device=x.device)
            if weights is not None
            else None
        )
        for k in range(k_all):  # in slot order: a fixed order of the fp32 sum
            r = expanded_row[:m, k]
            has = r >= 0
            picked = x.index_select(0, r.clamp_min(0)).float()
            acc += torch.where(has.unsqueeze(1), picked, 0.0)
            if w is not None:
                w[:, k] = torch.where(has, weights[r.clamp_min(0)].float(), 0.0)
        data = acc.to(x.dtype)
    layout = combine_layout(k_all, w is not None, x.shape[1], x.dtype)
    rows = torch.zeros(data.shape[0], layout.nbytes, dtype=torch.uint8, device=x.device)
    if data.shape[0]:
        head = torch.zeros(data.shape[0], 4, dtype=torch.int32, device=x.device)
        head[:, 0], head[:, 1], head[:, 2] = recv_token[token_of], seq, slot_of
        head[:, 3] = payload_code(x, None)
        _put(rows, 0, head)
        if w is not None:
            _put(rows, layout.weights, w)
        _put(rows, layout.data, data)
    return rows, token_of


@dataclass
class Returns:
    """What a source expects back from a combine: one row per (token, destination), or
    per (token, slot) without multiple reductions, in send order."""

    token: torch.Tensor  # int64 [P]
    slot: torch.Tensor  # int64 [P]: the slot the row stands for (its rank's first, or its own)
    dest: torch.Tensor  # int64 [P]
    splits: torch.Tensor  # int64 [R]


def expected_returns(token: torch.Tensor, dest: torch.Tensor, slots: torch.Tensor,
                     num_ranks: int, single: bool) -> Returns:  # fmt: skip
    if single:
        r, k = slots.nonzero(as_tuple=True)
        t, d = token[r], dest[r]
    else:
        t, d, k = token, dest, slots.int().argmax(1)
    return Returns(t, k, d, torch.bincount(d, minlength=num_ranks))


def sum_returns(rows: torch.Tensor, ret: Returns, slots: torch.Tensor, send_token: torch.Tensor,
                send_dest: torch.Tensor, used: torch.Tensor, num_tokens: int, num_topk: int,
                layout: RowLayout, dtype: torch.dtype,
                single: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Per token, the fp32 sum of the rows of ranks in ``used`` (bool [R]), slot by slot
    in top-k order, rounded once; and the weights each slot's rank sent back (0 where
    none), when the rows carry them."""
    device = rows.device
    hidden = layout.data_bytes // dtype.itemsize
    keep = used[ret.dest]
    index = torch.arange(ret.token.numel(), device=device)
    slot_row = torch.full((num_tokens, max(num_topk, 1)), -1, dtype=torch.int64, device=device)
    slot_row[ret.token[keep], ret.slot[keep]] = index[keep]
    data = section(rows, layout.data, layout.data_bytes, dtype).reshape(-1, hidden)
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    for k in range(num_topk):
        r = slot_row[:, k]
        picked = data.index_select(0, r.clamp_min(0)).float() if data.shape[0] else acc
        acc += torch.where((r >= 0).unsqueeze(1), picked, 0.0)
    if layout.weights == layout.data:
        return acc.to(dtype), None
    w = section(rows, layout.weights, 4 * num_topk, torch.float32)
    # Each slot's weight comes from the row of the rank that holds its expert.
    owner = torch.full((num_tokens, max(num_topk, 1)), -1, dtype=torch.int64, device=device)
    if single:
        owner = slot_row
    else:
        sent = used[send_dest]
        r, k = slots[sent].nonzero(as_tuple=True)
        owner[send_token[sent][r], k] = sent.nonzero().squeeze(1)[r]
    got = w[owner.clamp_min(0), torch.arange(num_topk, device=device)] if w.shape[0] else None
    combined = torch.zeros(num_tokens, num_topk, dtype=torch.float32, device=device)
    if got is not None:
        combined = torch.where(owner[:, :num_topk] >= 0, got, 0.0)
    return acc.to(dtype), combined
