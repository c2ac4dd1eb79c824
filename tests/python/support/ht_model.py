"""An independent model of the ElasticBuffer's routing (``mooncake.mooncake_elastic_buffer``),
for ``test_elastic_buffer.py``.

Plain Python loops over source ranks, tokens and top-k slots, written from the API's
documented semantics; it shares nothing with ``mooncake.ep.throughput_rows``. Inputs are
per rank: ``idx[s]`` (a list of top-k lists, -1 for none) and ``n[s]`` tokens. ``link(s,
d)`` says whether rank ``s``'s tokens reach rank ``d`` (both alive, both counting each
other in).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ceil_to(v: int, a: int) -> int:
    return -(-v // a) * a


@dataclass
class Received:
    """What rank ``d`` receives, as the documentation says."""

    tokens: list = field(default_factory=list)  # (source, token) per received row, in order
    local: list = field(default_factory=list)  # per row, its slots' local ids (-1 elsewhere)
    per_source: list = field(default_factory=list)  # tokens received from each rank
    counts: list = field(default_factory=list)  # per local expert, unpadded
    padded: list = field(default_factory=list)  # per local expert, padded to the alignment
    # with do_expand: per expanded row, (row index, slot) or None for padding
    expanded: list = field(default_factory=list)
    expanded_row: list = field(default_factory=list)  # per row, per slot: its expanded row or -1

    def psum_rank(self) -> list[int]:
        out, acc = [], 0
        for c in self.per_source:
            acc += c
            out.append(acc)
        return out

    def psum_expert(self, expand: bool) -> list[int]:
        out, acc = [], 0
        for c, p in zip(self.counts, self.padded, strict=True):
            out.append(acc + c if expand else acc + p)
            acc += p
        return out


def receive(idx, R: int, E: int, d: int, alignment: int, link) -> Received:
    """Rank ``d``'s view: sources in rank order, tokens in order, a token once however
    many of its experts are on ``d``; expanded rows per local expert, tokens in arrival
    order, each expert's block padded to ``alignment``."""
    epr = E // R
    out = Received(per_source=[0] * R)
    for s in range(R):
        if not link(s, d):
            continue
        for t, row in enumerate(idx[s]):
            local = [e - d * epr if e >= 0 and e // epr == d else -1 for e in row]
            if any(j >= 0 for j in local):
                out.tokens.append((s, t))
                out.local.append(local)
                out.per_source[s] += 1
    out.expanded_row = [[-1] * len(lo) for lo in out.local]
    for j in range(epr):
        rows = [(i, k) for i, lo in enumerate(out.local) for k, v in enumerate(lo) if v == j]
        out.counts.append(len(rows))
        out.padded.append(ceil_to(len(rows), alignment))
        for i, k in rows:
            out.expanded_row[i][k] = len(out.expanded)
            out.expanded.append((i, k))
        out.expanded += [None] * (out.padded[-1] - len(rows))
    return out


def metadata(rec: Received, T: int, K: int, expand: bool) -> list[list[int]]:
    """``recv_src_metadata``'s valid rows."""
    rows = []
    for (s, t), local, exp in zip(rec.tokens, rec.local, rec.expanded_row, strict=True):
        first = next(k for k, j in enumerate(local) if j >= 0)
        rows.append([s * T + t, s * K + first] + (exp if expand else [-1] * K))
    return rows


def dst_slots(idx_s, s: int, R: int, E: int, T: int, link) -> list[list[int]]:
    """``dst_buffer_slot_idx`` of source ``s``: for a token's first slot on each rank,
    ``s * T +`` its place among the tokens ``s`` sends that rank; -1 elsewhere."""
    epr = E // R
    sent = [0] * R
    out = []
    for row in idx_s:
        mine = [-1] * len(row)
        seen = set()
        for k, e in enumerate(row):
            d = e // epr if e >= 0 else -1
            if d >= 0 and d not in seen and link(s, d):
                seen.add(d)
                mine[k] = s * T + sent[d]
                sent[d] += 1
        out.append(mine)
    return out


def worst_expanded(R: int, T: int, K: int, epr: int, alignment: int) -> int:
    return ceil_to(R * T * min(K, epr) + (alignment - 1) * epr, alignment)


def combine_terms(idx_st, R: int, E: int, used, single: bool) -> list:
    """For one token (its top-k list), in slot order, what its combine adds: per slot,
    None (nothing), or ``(rank, slots)``: the rank whose contribution enters at this
    slot and the slots that contribution covers (its own slot only with ``single``;
    else every slot of the token on that rank, entering at the first of them)."""
    epr = E // R
    out = []
    for k, e in enumerate(idx_st):
        d = e // epr if e >= 0 else -1
        if d < 0 or not used(d):
            out.append(None)
            continue
        same = [q for q, f in enumerate(idx_st) if f >= 0 and f // epr == d]
        if single:
            out.append((d, [k]))
        else:
            out.append((d, same) if same[0] == k else None)
    return out
