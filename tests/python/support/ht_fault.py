"""Rank side of the ElasticBuffer's failure test (``test_elastic_buffer.py``): the processes
of a ``mooncake.launch.LocalGroup`` of 4 ranks (``max_world_size`` 4), each round checked
against ``ht_model`` by ``ht_round.HRound``.

1. A round on all four (fresh, cached, combine); its handle is kept as ``old``.
2. Rank ``victim`` goes on calling rounds and dies in one: between the two exchanges of
   a fresh dispatch (``mode="between"``: the others counted on its tokens), or at a
   random moment (``mode="timer"``). The survivors call rounds until their buffer masks
   it (every survivor reads the same mask after an exchange), each round correct with
   it maybe dropped; then a round with it masked, and a cached dispatch along ``old``
   (its rows read as zero rows of no expert) with its combine.
3. A replacement starts; the survivors poll ``get_peer_state``, call ``recover_ranks``,
   then ``update_ep_member`` while the replacement constructs its buffer. The survivors
   then pass ``old`` (a cached dispatch, then a combine) while the replacement makes
   fresh dispatches: ValueError on all four, alike (the survivors' naming the membership
   generation). Then full-strength rounds on all four.
4. The parent stops rank 3 (SIGSTOP; ``MOONCAKE_HANG_MS`` is 20 s, so only the exchange
   timeout of 3 s notices): the others' round returns with it masked; resumed, its own
   next dispatch raises LeftOutError.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import torch.distributed as dist

from ep_cases import Checks, _wait_store
from ep_cases import _round_record as _record
from ft_ranks import admit
from ht_round import HRound, HSpec, make_inputs

SPEC = HSpec(T=6, H=128, K=3, epr=2, ns=(6, 4, 5, 3), cached=1, fp8="odd")
TIMEOUT_SECS = 3


def _error_of(call) -> tuple[str, str]:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - reported
        return type(e).__name__, str(e)[:400]
    return "ok", ""


def ht_fault_rank(rank, world_size, port, plan):
    """Returns ``{"rounds": [...], ...}``; each round record lists its failed
    expectations (empty: correct). See the module docstring for the sequence."""
    from ft_ranks import kill_self_after, start_rank
    from mooncake import pg
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    victim = plan["victim"]
    joiner = plan["role"] == "joiner"
    chk = Checks(rank, world_size, "ht-fault")
    out = {"rounds": [], "role": plan["role"]}
    make = {"num_cpu_timeout_secs": TIMEOUT_SECS, "num_gpu_timeout_secs": TIMEOUT_SECS}
    W = None
    if joiner:
        _, store = start_rank(rank, world_size, port, barrier=False, timeout_s=plan["timeout_s"],
                              max_world_size=world_size, is_extension=True)  # fmt: skip
        W = dist.group.WORLD
        pg.join_group(W)
        buf = ElasticBuffer(W, **make)
        out["generation"] = buf.generation
        args = _fresh_args(chk, world_size)
        out["stale_dispatch"] = _error_of(lambda: buf.dispatch(**args))
        out["stale_combine"] = _error_of(lambda: buf.dispatch(**args))
    else:
        _, store = start_rank(rank, world_size, port, timeout_s=plan["timeout_s"],
                              max_world_size=world_size)  # fmt: skip
        W = dist.group.WORLD
        buf = ElasticBuffer(W, **make)
        first = HRound(chk, buf, SPEC, "before").run()
        out["rounds"].append(_record(chk, first, "before", active=buf.active_ranks.tolist()))

        # Part 2: the victim dies between the exchanges of a dispatch, or at a random
        # moment of its rounds.
        if rank == victim:
            store.set("armed", "1")
            if plan["mode"] == "between":
                _die_at_pack(plan["at_pack"])
            else:
                kill_self_after(plan["delay_s"])
            for i in range(10_000):
                HRound(chk, buf, SPEC, f"during{i}", may_drop=range(world_size)).run()
            raise RuntimeError("the victim was not killed")
        i = 0
        while buf.active_ranks[victim]:
            r = HRound(chk, buf, SPEC, f"during{i}", may_drop=(victim,)).run()
            out["rounds"].append(_record(chk, r, f"during{i}", active=buf.active_ranks.tolist(),
                                         masked_in=r.masked_in))  # fmt: skip
            i += 1
            if i > 2000:
                raise RuntimeError("the victim was never masked")
        r = HRound(chk, buf, replace(SPEC, expand=True, align=4, cached=0), "after_death").run()
        out["rounds"].append(_record(chk, r, "after_death", active=buf.active_ranks.tolist()))
        # A cached dispatch along the handle from before the death.
        first.may_drop = {victim}
        ins = [make_inputs(first.seed, q, first.spec, world_size, "old") for q in range(world_size)]
        for new, old in zip(ins, first.ins, strict=True):
            new.idx, new.idx_list = old.idx, old.idx_list
        first.dispatch(handle=first.handle, ins=ins)
        first.check_dispatch(ins, cached=True)
        first.combine()
        first.check_combine(ins)
        out["rounds"].append(_record(chk, first, "cached_old", active=buf.active_ranks.tolist()))

        # Part 3: a replacement joins.
        admit(W, [victim])
        buf.update_ep_member()
        out["generation"] = buf.generation
        out["stale_dispatch"] = _error_of(
            lambda: buf.dispatch(ins[rank].x_in, topk_weights=ins[rank].w, handle=first.handle)
        )
        y, _ = first.expert_outputs()
        out["stale_combine"] = _error_of(lambda: buf.combine(y, first.handle))
    out["pg_after_rejoin"] = [int(v) for v in pg.get_active_ranks(W)[:world_size].tolist()]
    for spec, tag in ((SPEC, "rejoined"), (replace(SPEC, expand=True, align=8, sync=False, cached=0),
                                             "rejoined_expand")):  # fmt: skip
        r = HRound(chk, buf, spec, tag).run()
        out["rounds"].append(_record(chk, r, tag, active=buf.active_ranks.tolist()))

    # Part 4: the parent stops rank 3; the others mask it within the exchange timeout.
    store.set(f"p4ready/{rank}", "1")
    if rank == world_size - 1:
        _wait_store(store, "p4done")
        t0 = time.monotonic()
        status, detail = _error_of(lambda: HRound(chk, buf, SPEC, "stopped_self").run())
        out["stopped"] = (status, detail, time.monotonic() - t0)
        return out
    _wait_store(store, "stopped")
    r = HRound(chk, buf, SPEC, "stopped_peer", may_drop=(world_size - 1,))
    r.dispatch()
    r.check_dispatch()
    r.combine()
    r.check_combine()
    out["rounds"].append(_record(chk, r, "stopped_peer", active=buf.active_ranks.tolist()))
    store.set("p4done", "1")
    return out


def _die_at_pack(n: int) -> None:
    """Kills this process in its ``n``-th packing of token rows: in a fresh dispatch that
    is after the counts exchange and before the tokens exchange (the others count on its
    tokens, then it is gone)."""
    from mooncake.ep import throughput_rows

    pack, calls = throughput_rows.pack, [0]

    def dying_pack(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return pack(*args, **kwargs)

    throughput_rows.pack = dying_pack


def _fresh_args(chk, world_size: int) -> dict:
    ins = make_inputs(11, chk.rank, SPEC, world_size, "joiner")
    return dict(x=ins.x_in, topk_idx=ins.idx, topk_weights=ins.w,
                num_experts=SPEC.epr * world_size, num_max_tokens_per_rank=SPEC.T)  # fmt: skip
