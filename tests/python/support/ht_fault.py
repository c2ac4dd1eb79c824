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


def error_of(call) -> tuple[str, str]:
    """``(type name, message)`` of what ``call()`` raised, or ``("ok", "")``."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - reported
        return type(e).__name__, str(e)[:400]
    return "ok", ""


def start(rank, world_size, port, plan, make: dict):
    """Starts a process of a fault launch with its ElasticBuffer (``make``: its
    arguments): a member, or (``plan["role"] == "joiner"``) the replacement, which joins
    the running group. Returns ``(group, store, buffer)``."""
    from ft_ranks import start_rank
    from mooncake import pg
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    joiner = plan["role"] == "joiner"
    _, store = start_rank(rank, world_size, port, barrier=not joiner, timeout_s=plan["timeout_s"],
                          max_world_size=world_size, is_extension=joiner)  # fmt: skip
    W = dist.group.WORLD
    if joiner:
        pg.join_group(W)
    return W, store, ElasticBuffer(W, **make)


def keep(out: dict, chk, buf, r, tag: str, **extra) -> None:
    """Adds round ``r``'s record (its failed expectations, and ``buf``'s active_ranks
    after it) to ``out["rounds"]``."""
    out["rounds"].append(_record(chk, r, tag, active=buf.active_ranks.tolist(), **extra))


def rejoined(round_cls, chk, buf, spec: HSpec, out: dict) -> None:
    """Rounds at full strength after the rejoin (``spec``'s, then expanded without CPU
    sync), kept in ``out``."""
    expand = replace(spec, expand=True, align=8, sync=False, cached=0)
    for s, tag in ((spec, "rejoined"), (expand, "rejoined_expand")):
        keep(out, chk, buf, round_cls(chk, buf, s, tag).run(), tag)


def rejoin_problems(key: str, res: dict, victim: int, world: int) -> list[str]:
    """What process ``key`` of a fault launch (:func:`ht_fault_rank` or
    ``ht_device.fault_rank``) recorded wrong up to the rejoin: a round's failed
    expectations; a member's active_ranks after the death, and its stale handles
    (refused, naming the generation), or the replacement's calls that met them (refused,
    naming the rejection: :func:`meet_stale_calls`); the generation and active_ranks
    after the rejoin."""
    problems = [
        f"process {key}, round {rec['tag']}: {f}" for rec in res["rounds"] for f in rec["failures"]
    ]
    masks = {rec["tag"]: rec["active"] for rec in res["rounds"]}
    member = res["role"] == "member"
    if member:
        after_death = [0 if r == victim else 1 for r in range(world)]
        for tag in ("after_death", "cached_old"):
            if masks.get(tag) != after_death:
                problems.append(f"process {key}: active_ranks in {tag}: {masks.get(tag)}")
    word, who = ("generation", "") if member else ("rejected", " (replacement)")
    for what in ("stale_dispatch", "stale_combine"):
        kind, text = res[what]
        if kind != "ValueError" or word not in text:
            problems.append(f"process {key}{who}: {what} gave {kind}: {text!r}")
    if res["generation"] != 2:
        problems.append(f"process {key}: generation {res['generation']} after the rejoin")
    for tag in ("rejoined", "rejoined_expand"):
        if masks.get(tag) != [1] * world:
            problems.append(f"process {key}: active_ranks in {tag}: {masks.get(tag)}")
    return problems


def ht_fault_rank(rank, world_size, port, plan):
    """Returns ``{"rounds": [...], ...}``; each round record lists its failed
    expectations (empty: correct). See the module docstring for the sequence."""
    from ft_ranks import kill_self_after
    from mooncake import pg

    victim = plan["victim"]
    chk = Checks(rank, world_size, "ht-fault")
    out = {"rounds": [], "role": plan["role"]}
    make = {"num_cpu_timeout_secs": TIMEOUT_SECS, "num_gpu_timeout_secs": TIMEOUT_SECS}
    W, store, buf = start(rank, world_size, port, plan, make)
    if plan["role"] == "joiner":
        out["generation"] = buf.generation
        meet_stale_calls(chk, world_size, buf, out)
    else:
        first = HRound(chk, buf, SPEC, "before").run()
        keep(out, chk, buf, first, "before")

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
            keep(out, chk, buf, r, f"during{i}", masked_in=r.masked_in)
            i += 1
            if i > 2000:
                raise RuntimeError("the victim was never masked")
        r = HRound(chk, buf, replace(SPEC, expand=True, align=4, cached=0), "after_death").run()
        keep(out, chk, buf, r, "after_death")
        # A cached dispatch along the handle from before the death.
        first.may_drop = {victim}
        ins = first.cached("old")
        keep(out, chk, buf, first, "cached_old")

        # Part 3: a replacement joins.
        admit(W, [victim])
        buf.update_ep_member()
        out["generation"] = buf.generation
        out["stale_dispatch"] = error_of(
            lambda: buf.dispatch(ins[rank].x_in, topk_weights=ins[rank].w, handle=first.handle)
        )
        y, _ = first.expert_outputs()
        out["stale_combine"] = error_of(lambda: buf.combine(y, first.handle))
    out["pg_after_rejoin"] = [int(v) for v in pg.get_active_ranks(W)[:world_size].tolist()]
    rejoined(HRound, chk, buf, SPEC, out)

    # Part 4: the parent stops rank 3; the others mask it within the exchange timeout.
    store.set(f"p4ready/{rank}", "1")
    if rank == world_size - 1:
        _wait_store(store, "p4done")
        t0 = time.monotonic()
        status, detail = error_of(lambda: HRound(chk, buf, SPEC, "stopped_self").run())
        out["stopped"] = (status, detail, time.monotonic() - t0)
        return out
    _wait_store(store, "stopped")
    r = HRound(chk, buf, SPEC, "stopped_peer", may_drop=(world_size - 1,))
    r.dispatch()
    r.check_dispatch()
    r.combine()
    r.check_combine()
    keep(out, chk, buf, r, "stopped_peer")
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


def meet_stale_calls(chk, world_size: int, buf, out: dict) -> None:
    """A replacement's first two calls: the survivors' stale dispatch and combine are
    refused in exchanges these meet (each raises, naming the rejection). Fresh
    dispatches of CPU tensors (on the device path's launch too: its setup is left to the
    rounds after)."""
    args = _fresh_args(chk, world_size)
    out["stale_dispatch"] = error_of(lambda: buf.dispatch(**args))
    out["stale_combine"] = error_of(lambda: buf.dispatch(**args))


def _fresh_args(chk, world_size: int) -> dict:
    ins = make_inputs(11, chk.rank, SPEC, world_size, "joiner")
    return dict(x=ins.x_in, topk_idx=ins.idx, topk_weights=ins.w,
                num_experts=SPEC.epr * world_size, num_max_tokens_per_rank=SPEC.T)  # fmt: skip
