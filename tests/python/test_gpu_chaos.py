"""The chaos soak: random kills, stops and slow ranks, each replaced, with every EP buffer
and collective checked after every join, on CUDA tensors (the EP device path and the
``mooncake`` backend's device plane) and on CPU tensors (the portable path over
``mooncake-cpu``).

4 processes (8 in the stress variant) go through ``MOONCAKE_CHAOS_CYCLES`` cycles (40 by
default on the GPU, 6 on the CPU, where ``make test`` runs it): per cycle one rank, rank
0 included (never the last rank, which lives throughout so that its resources tell of
leaks), is killed (kill -9, between two steps or right after launching its dispatch),
stopped past ``MOONCAKE_HANG_MS`` (resumed once its replacement joined, it must get
``LeftOutError``) or slowed under it (stopped a while: nobody may be masked). The first
cycles take each of those in turn; the rest are drawn at random. Every killed or stopped
rank is replaced by a pre-started process. At full strength, after the fault among the
survivors, and after every join, each process runs the EP ``Buffer`` (process-group
mode) and the elastic buffer (``Buffer.create_elastic``), in BF16 and FP8, checked
against the routing model of ``ep_cases``, and the group's ``all_reduce`` (small and
chunked), ``all_gather_into_tensor`` and ``all_to_all_single``, checked exactly
(see chaos_ranks.py and chaos_steps.py).

It passes with no hang (every wait is bounded, and the launch by
``MOONCAKE_CHAOS_BUDGET_S`` seconds, by default from the cycle count), no wrong result,
no disagreement among the processes on the ranks any step covered, the fault's step
masking exactly its victim (nobody for a slow rank), every stopped rank told it was left
out, and no growth of the last rank's fds, threads, RSS and (CUDA) allocated bytes, nor
of the GPU's used memory, from the third cycle on. It prints the cycle mix and, per fault,
the time from the fault to the survivors' next step and to the first full-strength step
after the join (``pytest -s`` shows them).

The CUDA variant skips without a GPU and a CUDA build (``make gpu-check`` turns that
skip into a failure with ``MOONCAKE_NO_SKIP=1``). Its kills must run without MPS: under
MPS a process killed while one of its kernels runs makes the MPS server fail every
client on the GPU (docs/failures.md), so ``scripts/gpu_check.sh`` runs this step with
MPS stopped; its processes then time-slice the GPU (correct, slower).
"""

from __future__ import annotations

import os
import statistics

import pytest

import ep_device_ranks as edr
from chaos_parent import (
    env_for,
    fault_times,
    growth_problems,
    make_cycles,
    make_plan,
    problems_of,
    run,
)

#: What each process runs at full strength, after a fault and after a join.
BATTERY = ("ep", "eep", "ar", "ar_big", "ag", "a2a")
#: The hang limit of the soak's processes (a stopped rank is masked past it; a slow one
#: is stopped for 0.2-0.5 s, under it).
HANG_MS = 1000
SEED = 3900

needs_device = pytest.mark.skipif(
    not edr.has_device_path(), reason="needs a CUDA GPU and a CUDA build of mooncake"
)


def cycle_count(device: str) -> int:
    default = "40" if device == "cuda" else "6"
    return int(os.environ.get("MOONCAKE_CHAOS_CYCLES", default))


def report(device: str, world: int, outcome, seconds: float) -> None:
    """Prints the cycle mix and the fault -> next step times."""
    rows = fault_times(outcome)
    mix: dict[str, int] = {}
    for cy in outcome.plan["cycles"]:
        name = cy["fault"] + (f" {cy['where']}" if cy["fault"] == "kill" else "")
        mix[name] = mix.get(name, 0) + 1
    victims = sorted({cy["victim"] for cy in outcome.plan["cycles"]})
    print(
        f"\nchaos {device} world {world}: {len(outcome.plan['cycles'])} cycles in "
        f"{seconds:.0f} s; mix {mix}; victims {victims}"
    )
    for name in sorted(mix):
        fault, _, where = name.partition(" ")
        sel = [r for r in rows if r["fault"] == fault and (not where or r["where"] == where)]
        for key, what in (("next_ms", "the survivors' next step"), ("full_ms", "full strength")):
            vals = sorted(r[key] for r in sel if r.get(key) is not None)
            if vals:
                print(
                    f"  {name:<14} -> {what:<24} n={len(vals):<3} median "
                    f"{statistics.median(vals):8.1f} ms  max {vals[-1]:8.1f} ms"
                )


def soak(device: str, world: int, seed: int) -> None:
    cycles = make_cycles(
        seed,
        world,
        cycle_count(device),
        never=(world - 1,),
        slow_s=(0.2, 0.5),
        cover=(("kill", "between"), ("stop", "between"), ("slow", "between"), ("kill", "inside")),
    )
    plan = make_plan(
        device,
        world,
        cycles,
        battery=BATTERY,
        seed=seed,
        hang_ms=HANG_MS,
        label=f"chaos-{device}-{world}",
    )
    budget = 40 + 25 * len(cycles) * (2 if device == "cuda" else 1) * world / 4
    budget = float(os.environ.get("MOONCAKE_CHAOS_BUDGET_S") or budget)
    outcome = run(plan, env_for(HANG_MS), timeout_s=budget)
    report(device, world, outcome, outcome.wall_s)
    problems = problems_of(outcome) + growth_problems(outcome)
    assert not problems, f"seed {seed}, cycles {cycles}\n" + "\n".join(problems[:40])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_device)])
def test_chaos(device):
    """4 processes, MOONCAKE_CHAOS_CYCLES cycles (see the module docstring)."""
    soak(device, 4, SEED)


@pytest.mark.stress
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_device)])
def test_chaos_world8_stress(device):
    """8 processes, the same soak."""
    soak(device, 8, SEED + 8)


def test_the_checks_catch_what_they_must():
    """problems_of on made-up records: a clean launch passes; a disagreement, a fault
    step that masked the wrong ranks, a stopped rank masked before the hang limit or not
    told it was left out, and a failed check each make a problem."""
    import copy

    from chaos_parent import Outcome

    cycles = [
        {"victim": 1, "fault": "kill", "where": "between", "frac": 0.5},
        {"victim": 2, "fault": "stop", "where": "between", "frac": 0.5},
    ]
    plan = make_plan("cpu", 3, cycles, hang_ms=1000, timeout_us=10_000_000)

    def rec(tag, ranks, t1):
        return {"tag": tag, "kind": "ep_bf16", "t0": t1 - 0.001, "t1": t1, "failures": [],
                "ranks": ranks}  # fmt: skip

    after_kill, after_stop, full = [1, 0, 1], [1, 1, 0], [1, 1, 1]
    common = [
        rec("c0/fault", after_kill, 100.01),
        rec("c0/after", after_kill, 100.02),
        rec("c0/rejoin", full, 100.5),
    ]
    survivor = common + [
        rec("c1/fault", after_stop, 201.05),
        rec("c1/after", after_stop, 201.06),
        rec("c1/rejoin", full, 201.5),
    ]
    good = Outcome(
        plan,
        processes={  # every process its own records
            "0": {"records": copy.deepcopy(survivor), "info": {}},
            "2": {
                "records": copy.deepcopy(common),
                "info": {"left_out": {"told": True, "op_ms": 2.0}},
            },
            "1@0": {"records": copy.deepcopy(survivor[2:]), "info": {}},
            "2@1": {"records": copy.deepcopy(survivor[-1:]), "info": {}},
        },
        stamps={0: {"t": 100.0}, 1: {"t": 200.0}},
    )
    assert problems_of(good) == []

    def broken(fn):
        o = copy.deepcopy(good)
        fn(o)
        return problems_of(o)

    def disagree(o):
        o.processes["1@0"]["records"][1]["ranks"] = [1, 0, 1]  # c1/fault

    def wrong_mask(o):
        for p in ("0", "2"):
            o.processes[p]["records"][0]["ranks"] = [0, 1, 1]

    def early(o):
        for p in ("0", "1@0"):
            o.processes[p]["records"][-3]["t1"] = 200.2

    def untold(o):
        o.processes["2"]["info"]["left_out"]["told"] = False

    def failed(o):
        o.processes["0"]["records"][0]["failures"].append("dispatch: recv_count [1], want [2]")

    for fn in (disagree, wrong_mask, early, untold, failed):
        assert broken(fn), fn.__name__


def test_thread_growth_names_what_grew():
    """thread_growth on made-up samples: a thread kind first started after the third
    sample passes; a kind that piles up, or three new threads at once, is growth."""
    from chaos_parent import thread_growth

    def samples(*counts):
        return [{"threads": sum(c.values()), "thread_names": dict(c)} for c in counts]

    base = {"python3": 2, "mc-tcp": 1, "mc-heartbeat": 1}
    lazy = {**base, "mc-ops": 1}
    assert thread_growth(samples(base, base, base, lazy, lazy, lazy)) == []
    piled = {**base, "mc-tcp": 2}
    assert thread_growth(samples(base, base, base, piled, piled, piled)) == [
        "threads named 'mc-tcp' grew from 1 to 2"
    ]
    # gone again in one of the last three samples: it comes and goes
    assert thread_growth(samples(base, base, base, piled, base, piled)) == []
    # a store's worker runs while its requests do: one per store, so one more is no leak
    stores = {**base, "mc-store": 1}
    busy, piled_up = {**stores, "mc-store": 2}, {**stores, "mc-store": 3}
    assert thread_growth(samples(stores, stores, stores, busy, busy, busy)) == []
    assert thread_growth(samples(stores, stores, stores, piled_up, piled_up, piled_up)) == [
        "threads named 'mc-store' grew from 1 to 3"
    ]
    many = {**base, "a": 1, "b": 1, "c": 1}
    assert thread_growth(samples(base, base, base, many, many, many)) == [
        "threads grew from 4 to 7"
    ]
