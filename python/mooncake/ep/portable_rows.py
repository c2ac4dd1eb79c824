"""The portable EP path's messages and tensor work: routing, packing, placing, summing.

Torch ops on the caller's device, whatever it is. ``portable`` runs a call
with them over the Buffer's members, whose exchange moves the rows (a process
group's ``alltoall_base``, or an elastic Buffer's slots), each exchange with its
own timeout. It is the reference the device path is tested against and what
runs on CPU.

Dispatch is two exchanges, each with the call's ``timeout_us`` as its own budget (a
peer that answered the counts is never masked in the tokens exchange because another
peer used up the first budget), so a dispatch may wait up to twice ``timeout_us``:

1. **counts**: every rank sends every rank one int64 row ``[T, H, E, fp8,
   status, accept, n_0 .. n_{E/R-1}]``: its call's shape, whether it rejected
   its own arguments, whether it takes tokens from that rank (its
   ``active_ranks`` entry), and how many tokens it sends to each of that
   rank's local experts. A pair of ranks exchanges tokens only when each
   counts the other active.
2. **tokens**: one message per (token, selected expert), sorted by
   (destination, local expert, token): a 16-byte header (int32 source token
   index, int32 local expert, 8 reserved bytes) and the payload (the token's
   values, or its FP8 data and fp32 scales).

Combine is one exchange (one budget): every rank sends each row it received back to its
source, in the order it came, so the source knows which (token, top-k slot)
each row answers without a header; the source sums ``weight * row`` in fp32.

A rank that dies during an exchange is left out by the process group, which
completes the exchange among the others with that rank's slices zero-filled;
its rows are dropped and its ``active_ranks`` entry is set to 0.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from .. import fp8, pg

HEADER_BYTES = pg._ext.EP_HEADER_BYTES  # src/ep/layout.h's EpMsgHeader
META_COLS = 6  # T, H, E, fp8, status, accept; then E/R counts
STATUS_OK, STATUS_REJECTED = 1, 2


def timeout_of(timeout_us: int) -> datetime.timedelta:
    """The per-op timeout of one exchange whose budget is ``timeout_us`` (-1: the group's
    own timeout), in whole milliseconds, rounded up: a budget runs from the exchange's
    start, never from the call's, so no exchange inherits what an earlier one spent."""
    if timeout_us == -1:
        return datetime.timedelta(milliseconds=-1)  # c10d's "unset": the group's timeout
    return datetime.timedelta(milliseconds=-(-timeout_us // 1000))


def all_to_all(backend, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, timeout_us):
    """Starts an uneven all_to_all_single (splits in rows of dim 0) with a budget of
    ``timeout_us`` from now (-1: the group's timeout); returns the Work."""
    return backend.alltoall_base(
        out, inp, [int(s) for s in out_splits], [int(s) for s in in_splits], timeout_of(timeout_us)
    )


@dataclass
class Route:
    """Where this rank's (token, top-k slot) selections go, sorted by (rank, expert, token)."""

    token: torch.Tensor  # int64 [S]
    slot: torch.Tensor  # int64 [S], the top-k column
    dest: torch.Tensor  # int64 [S]
    local_expert: torch.Tensor  # int64 [S]
    counts: torch.Tensor  # int64 [R, E/R]


def route(topk_idx: torch.Tensor, num_ranks: int, local_experts: int) -> Route:
    n, k = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    picked = (flat >= 0).nonzero().squeeze(1)
    expert = flat[picked]
    token = picked // max(k, 1)
    key = expert * max(n, 1) + token  # expert-major: (rank, local expert) then token
    order = torch.argsort(key, stable=True)
    expert, token, picked = expert[order], token[order], picked[order]
    counts = torch.bincount(expert, minlength=num_ranks * local_experts)
    return Route(
        token=token,
        slot=picked % max(k, 1),
        dest=expert // local_experts,
        local_expert=expert % local_experts,
        counts=counts.reshape(num_ranks, local_experts),
    )


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D uint8, rows of bytes) viewed with the widest integer type its row
    length, row stride and offset allow, so that row copies move words, not bytes."""
    if t.stride(-1) != 1 or t.shape[1] == 0:
        return t
    for wide in (torch.int64, torch.int32, torch.int16):
        size = wide.itemsize
        if t.shape[1] % size == 0 and t.stride(0) % size == 0 and t.storage_offset() % size == 0:
            return t.view(wide)
    return t


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the standard strides (copied when it has others, as some views do)."""
    if t.is_contiguous() and (t.dim() == 0 or t.stride(-1) == 1):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def gather_rows(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """``dst[i] = src[index[i]]`` for uint8 rows, as word copies (``dst`` may be a strided
    column block; ``src`` is made dense, so it takes ``dst``'s word type, and copied to a
    storage of its own when its place in its storage is not aligned to that type, as for
    a view that starts a few elements into a buffer)."""
    dst = _words(dst)
    src = dense(src)
    if src.storage_offset() % dst.element_size():
        src = src.clone()
    dst.copy_(src.view(dst.dtype).index_select(0, index))


def pack_tokens(
    x: torch.Tensor, r: Route, keep: torch.Tensor, use_fp8: bool
) -> tuple[torch.Tensor, int]:
    """The token messages of the selections in ``keep`` (bool [S]), as uint8 rows."""
    token, le = r.token[keep], r.local_expert[keep]
    hidden = x.shape[1]
    payload_bytes = hidden + 4 * (hidden // fp8.BLOCK) if use_fp8 else hidden * x.element_size()
    rows = torch.empty(
        token.numel(), HEADER_BYTES + payload_bytes, dtype=torch.uint8, device=x.device
    )
    if token.numel() == 0:
        return rows, rows.shape[1]
    header = torch.zeros(token.numel(), HEADER_BYTES // 4, dtype=torch.int32, device=x.device)
    header[:, 0] = token
    header[:, 1] = le
    dst = _words(rows[:, :HEADER_BYTES])
    dst.copy_(header.view(torch.uint8).view(dst.dtype))
    if use_fp8:
        data, scales = fp8.quantize(x)
        gather_rows(rows[:, HEADER_BYTES : HEADER_BYTES + hidden], data.view(torch.uint8), token)
        gather_rows(rows[:, HEADER_BYTES + hidden :], scales.view(torch.uint8), token)
    else:
        gather_rows(rows[:, HEADER_BYTES:], dense(x).view(torch.uint8), token)
    return rows, rows.shape[1]


@dataclass
class Arrival:
    """Where each received message goes in the ``[E/R, R*T]`` layout."""

    row: torch.Tensor  # int64: rows of the receive buffer that are kept
    local_expert: torch.Tensor  # int64, per kept row
    column: torch.Tensor  # int64, per kept row
    token: torch.Tensor  # int64, the source's token index, per kept row
    counts: torch.Tensor  # int64 [R, E/R], tokens kept per (source, local expert)


def place(
    recv: torch.Tensor, buffer_counts: torch.Tensor, kept_sources: torch.Tensor, max_tokens: int
) -> Arrival:
    """Maps received rows (sorted by (source, local expert, token)) to their places.

    ``buffer_counts`` [R, E/R]: rows per (source, local expert) in the buffer;
    ``kept_sources`` bool [R]: sources whose rows count (a source that died
    during the exchange left zero-filled rows).

    Raises:
        RuntimeError: a message header disagrees with the counts its source sent.
    """
    num_ranks, local_experts = buffer_counts.shape
    device = recv.device
    flat = buffer_counts.reshape(-1)
    group = torch.repeat_interleave(torch.arange(flat.numel(), device=device), flat)
    source, le = group // local_experts, group % local_experts
    first_row = torch.cumsum(flat, 0) - flat
    within = torch.arange(group.numel(), device=device) - first_row[group]
    counts = buffer_counts * kept_sources.unsqueeze(1).long()
    # Columns: per local expert, sources in rank order.
    per_expert = counts.t()  # [E/R, R]
    start = torch.cumsum(per_expert, 1) - per_expert
    row = kept_sources[source].nonzero().squeeze(1)
    le, source, within = le[row], source[row], within[row]
    header = recv[row, :HEADER_BYTES].contiguous().view(torch.int32)
    token = header[:, 0].long()
    bad = (header[:, 1].long() != le) | (token < 0) | (token >= max_tokens)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise RuntimeError(
            f"dispatch: a message from rank {int(source[i])} has header (token "
            f"{int(token[i])}, local expert {int(header[i, 1])}) but its counts place it at "
            f"local expert {int(le[i])} with at most {max_tokens} tokens: the data is corrupt"
        )
    return Arrival(
        row=row, local_expert=le, column=start[le, source] + within, token=token, counts=counts
    )


def _scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index[i]] = src[i]`` for uint8 rows, as word copies (``dst`` is contiguous,
    so it takes ``src``'s word type)."""
    src = _words(src)
    dst.view(src.dtype).index_copy_(0, index, src)


def unpack_tokens(
    recv: torch.Tensor, a: Arrival, out, dtype: torch.dtype, hidden: int, use_fp8: bool
) -> None:
    """Writes the kept rows' payloads into ``out`` (a tensor, or (data, scales) with FP8)."""
    if a.row.numel() == 0:
        return
    rows = recv if a.row.numel() == recv.shape[0] else recv.index_select(0, a.row)
    first = out[0] if use_fp8 else out
    flat = a.local_expert * first.shape[1] + a.column
    if use_fp8:
        data, scales = out
        _scatter_rows(
            data.view(torch.uint8).view(-1, hidden),
            flat,
            rows[:, HEADER_BYTES : HEADER_BYTES + hidden],
        )
        # scales is a transposed view ([E/R, R*T, H/128], token stride 1): index it.
        nscale = scales.shape[2]
        raw = rows[:, HEADER_BYTES + hidden : HEADER_BYTES + hidden + 4 * nscale]
        scales[a.local_expert, a.column] = raw.contiguous().view(torch.float32)
    else:
        _scatter_rows(out.view(-1, hidden).view(torch.uint8), flat, rows[:, HEADER_BYTES:])


def gather_outputs(x: torch.Tensor, a: Arrival, num_rows: int) -> torch.Tensor:
    """Combine's send buffer: row ``i`` is the expert output for received row ``i`` (zero
    for rows of sources that were dropped)."""
    hidden = x.shape[2]
    flat = dense(x).view(-1, hidden)
    picked = flat.index_select(0, a.local_expert * x.shape[1] + a.column)
    if a.row.numel() == num_rows:
        return picked
    back = torch.zeros(num_rows, hidden, dtype=x.dtype, device=x.device)
    back.index_copy_(0, a.row, picked)
    return back


def weighted_sum(
    rows: torch.Tensor,
    r: Route,
    sent: torch.Tensor,
    used: torch.Tensor,
    weights: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """Per token, the fp32 sum of ``weight * row`` over the rows in ``used``.

    ``rows`` are the returned rows of the sent selections ``sent`` (bool [S]), in
    send order; ``used`` (bool, one per returned row) drops rows of inactive ranks.
    """
    token, slot = r.token[sent], r.slot[sent]
    if not bool(used.all()):
        token, slot, rows = token[used], slot[used], rows[used]
    scaled = rows.float().mul_(weights[token, slot].float().unsqueeze(1))
    acc = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    acc.index_add_(0, token, scaled)
    return acc
