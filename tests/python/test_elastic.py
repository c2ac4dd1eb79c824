"""Elastic membership of the mooncake-cpu process group: replacements for killed ranks and
extensions into reserved slots (``recover_ranks`` / ``join_group``), joiners that die while
joining, many kill-and-replace cycles without leaking fds, threads or memory, subgroups,
and misuse of the elastic API.

After every join all processes, the joiner included, run a battery of collectives that
must cover exactly the full group (rank ``r`` contributes ``1 << r``, see ft_ranks.py).
"""

from __future__ import annotations

import os
import random

import pytest

from ft_parent import (
    check_churn,
    check_elastic,
    conduct_steps,
    elastic_plans,
    env,
    launch,
    mark_dead,
    resource_growth,
    wait_key,
)
from ft_ranks import (
    ALL_KINDS,
    CHAOS_KINDS,
    ELASTIC_KINDS,
    KINDS,
    MASK_KINDS,
    SUBGROUPS,
    bits,
    elastic_rank,
    mismatched_capacity_rank,
    ranks_of,
    subgroup_rank,
    uneven_extension_rank,
    wrong_capacity_join_rank,
)

DOOMS = ("before_init", "waiting", "in_join", "after_join")


# --- kill-and-replace cycles -----------------------------------------------------------------


def cycle_steps(seed, world, cycles, survivor, joiner, doomed_cycles):
    """Kill a rank (rank 0 included, never ``survivor``) at a random moment after the group
    is full, start its replacement; in ``doomed_cycles`` a first replacement dies while
    joining (a random way)."""
    rng = random.Random(seed)
    victims = [r for r in range(world) if r != survivor]
    steps = [("wait_full", 180)]
    for c in range(cycles):
        v = victims[c % len(victims)]
        steps += [("sleep", rng.uniform(0, 0.3)), ("kill", v)]
        if c in doomed_cycles:
            doom = (
                DOOMS[rng.randrange(len(DOOMS))] if doomed_cycles[c] is None else doomed_cycles[c]
            )
            steps.append(("doomed", v, dict(joiner, doom=doom, doom_delay_s=rng.uniform(0, 0.03))))
        steps += [("start", v, joiner), ("wait_full", 180)]
    return steps + [("stop",)]


def run_cycles(seed, cycles, doomed_cycles, timeout_s):
    world, survivor = 4, 3
    member, joiner = elastic_plans(world, world, range(world), CHAOS_KINDS, survivor)
    steps = cycle_steps(seed, world, cycles, survivor, joiner, doomed_cycles)
    out = launch(world, elastic_rank, member, env(), conduct_steps(steps), timeout_s=timeout_s)
    out.extra["cycles"] = cycles
    return out


@pytest.fixture(scope="module")
def cycles5():
    """World 4: 5 kill-and-replace cycles over ranks 0, 1, 2 (rank 3 lives throughout); in
    three of them a first replacement dies while joining (while it waits to be admitted,
    inside join_group, right after join_group returned)."""
    return run_cycles(11, 5, {1: "waiting", 2: "in_join", 3: "after_join"}, timeout_s=240)


@pytest.mark.timeout(300)
def test_replacements_rejoin_at_full_strength(cycles5):
    """Every replacement is admitted with recover_ranks/join_group; afterwards every
    process, the joiner included, gets every collective (all_reduce small and chunked,
    all_gather, all_to_all, reduce_scatter, broadcast/reduce/gather/scatter from every
    root, a p2p ring, an EP Buffer dispatch + combine, the joiner with a new Buffer) over
    all 4 ranks; all processes agree on every membership change."""
    results = cycles5.get()
    problems = check_elastic(results, range(4), CHAOS_KINDS)
    assert not problems, "\n".join(problems[:40])
    # The latest process of each rank (the killed ones report nothing).
    assert sorted(k.split(".")[0] for k in results) == ["0", "1", "2", "3"], sorted(results)
    assert len(results["3"]["batteries"]) == 1 + 5, results["3"]["batteries"]


@pytest.mark.timeout(300)
def test_cycles_do_not_leak_fds_threads_or_memory(cycles5):
    """On the rank that lives throughout: fds and threads after the last cycle are no more
    than after cycle 2; RSS grew less than 24 MiB."""
    samples = cycles5.get()["3"]["samples"]
    assert len(samples) == 6, samples
    problems = resource_growth(samples, 2)
    assert not problems, f"{problems}; samples {samples}"


@pytest.mark.stress
@pytest.mark.timeout(1800)
def test_twenty_cycles_stress():
    """20 kill-and-replace cycles, 6 of them with a first replacement that dies while
    joining (random ways); no fd, thread or memory growth from cycle 3 to the end."""
    doomed = {c: None for c in (1, 4, 7, 10, 13, 16)}
    out = run_cycles(23, 20, doomed, timeout_s=1500)
    results = out.get()
    problems = check_elastic(results, range(4), CHAOS_KINDS)
    samples = results["3"]["samples"]
    problems += resource_growth(samples, 3)
    assert not problems, "\n".join(problems[:40]) + f"\nsamples {samples}"


# --- churn: random kills, stops and slow ranks, replacements -------------------------------

CHURN_MODES = ("kill", "kill", "stop", "slow")


def churn_steps(seed, world, cycles, survivor, joiner, modes=None):
    """Per cycle, once the group is full, a random rank (rank 0 included, never
    ``survivor``) at a random moment: killed (kill -9), stopped past the hang limit and
    resumed once the group went on (it must learn it was left out), or slowed (stopped
    0.3-0.8 s, under the 2 s hang limit: nobody may leave). A killed or stopped rank is
    replaced; one time in five a first replacement dies while joining. ``modes``: the
    cycles' modes (default: random)."""
    rng = random.Random(seed)
    steps = [("wait_full", 180)]
    for c in range(cycles):
        v = rng.choice([r for r in range(world) if r != survivor])
        mode = modes[c] if modes else rng.choice(CHURN_MODES)
        steps.append(("sleep", rng.uniform(0, 0.3)))
        if mode == "slow":
            steps += [("slow", v, rng.uniform(0.3, 0.8)), ("sleep", 0.3)]
            continue
        if mode == "kill":
            steps.append(("kill", v))
        else:
            steps += [("sigstop", v), ("wait_dropped", v), ("sigcont", v)]
        if rng.random() < 0.2:
            doom = DOOMS[rng.randrange(len(DOOMS))]
            steps.append(("doomed", v, dict(joiner, doom=doom, doom_delay_s=rng.uniform(0, 0.03))))
        steps += [("start", v, joiner), ("wait_full", 180)]
    return steps + [("stop",)]


def run_churn(seed, world, cycles, modes=None, timeout_s=600):
    """A churn launch at ``world``, checked: every battery (every kind of collective, p2p,
    the EP Buffer and the elastic EP buffer) after every join covers the full group, the
    processes agree on every change, the changes match the faults. Returns the resume
    times (see :func:`ft_parent.check_churn`) and the survivor's resource samples."""
    survivor = world - 1
    member, joiner = elastic_plans(world, world, range(world), ELASTIC_KINDS, survivor)
    steps = churn_steps(seed, world, cycles, survivor, joiner, modes)
    out = launch(world, elastic_rank, member, env(), conduct_steps(steps), timeout_s=timeout_s)
    results = out.get()
    problems = check_elastic(results, range(world), ELASTIC_KINDS, tolerated=out.extra["resumed"])
    more, resume = check_churn(results, out.extra, range(world), survivor)
    samples = results[str(survivor)]["samples"]
    if len(samples) > 5:
        problems += resource_growth(samples, 2, settle=3)
        if problems:
            problems.append(f"samples: third {samples[2]}, last three {samples[-3:]}")
    faults = [(what, v) for _, what, v in out.extra["faults"]]
    assert not problems + more, f"seed {seed}, faults {faults}\n" + "\n".join(
        (problems + more)[:40]
    )
    return resume, samples


@pytest.mark.timeout(300)
def test_churn_stop_slow_kill_with_replacements():
    """World 4: a rank stopped past the hang limit (the group goes on without it; resumed,
    it learns it was left out) and replaced, a rank slowed under the hang limit (nobody
    leaves), a rank killed and replaced; every battery after a join covers all four,
    the elastic EP buffer taking each replacement into its old slot."""
    resume, _ = run_churn(5, 4, 3, modes=("stop", "slow", "kill"))
    assert len(resume["kill"]) == 1 and len(resume["stop"]) == 1, resume


@pytest.mark.stress
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world", [3, 4, 8])
def test_churn_random_stress(world):
    """``MOONCAKE_CHURN_CYCLES`` (default 12) random cycles; prints the resume times."""
    cycles = int(os.environ.get("MOONCAKE_CHURN_CYCLES", "12"))
    resume, samples = run_churn(9000 + world, world, cycles, timeout_s=3000)
    print(
        f"world {world}: rank {world - 1} after {len(samples)} batteries: {samples[0]} -> {samples[-1]}"
    )
    for what, times in resume.items():
        if times:
            times = sorted(times)
            print(
                f"world {world}: {what} -> survivors' next op over {len(times)}: median "
                f"{times[len(times) // 2] * 1e3:.1f} ms, max {times[-1] * 1e3:.1f} ms"
            )


# --- extension slots, replacing an extension, misuse --------------------------------------


@pytest.fixture(scope="module")
def extension():
    """World 3 with max_world_size 5. The members first misuse the elastic API (each call
    followed by an all_reduce), then extend to 5; ranks 3 and 4 join as extensions (and
    extend, too: extend_group_size_to is local). Rank 4 (an extension) is killed and
    replaced; then rank 0. Before each replacement starts, the members try recover_ranks
    on the dead rank (nobody waits)."""
    member, joiner = elastic_plans(
        3,
        5,
        range(5),
        ALL_KINDS,
        2,
        bad_input=True,
        extend_to=5,
        probe_ranks=[4, 0],
    )
    steps = [
        ("wait_looping", 2),
        ("start", 3, joiner),
        ("start", 4, joiner),
        ("wait_full",),
        ("sleep", 0.1),
        ("kill", 4),
        ("wait_probed", 4),
        ("start", 4, joiner),
        ("wait_full",),
        ("kill", 0),
        ("wait_probed", 0),
        ("start", 0, joiner),
        ("wait_full",),
        ("stop",),
    ]
    out = launch(3, elastic_rank, member, env(), conduct_steps(steps), timeout_s=240)
    return out


BAD_INPUT = {
    "recover_live": "is active",
    "recover_out_of_range": "max_world_size=5",
    "recover_negative": "max_world_size=5",
    "recover_not_extended": "extend_group_size_to",
    "recover_empty": "empty",
    "recover_not_a_list": "list of ints",
    "extend_beyond_max": "max_world_size",
    "extend_below_size": "extend_group_size_to",
    "peer_state_out_of_range": "max_world_size=5",
    "join_group_not_extension": "is_extension",
    "recover_nobody_waits": "no process waits",
    "recover_twice_named": "named twice",
}


@pytest.mark.timeout(300)
def test_bad_elastic_calls_raise_value_error_and_group_stays_usable(extension):
    """recover_ranks on a live rank, out-of-range and negative ranks, a rank
    beyond the extended size, an empty list, a non-list; extend_group_size_to beyond
    max_world_size or below the size; get_peer_state out of range; join_group on a
    member; recover_ranks on a slot nobody waits for, or named twice: a ValueError with a
    clear message on every member, and the next all_reduce covers all three ranks."""
    results = extension.get()
    seen = {}
    for r in ("1", "2"):  # rank 0 was replaced; its first process is gone
        for name, (status, value), mask in results[r]["bad"]:
            seen.setdefault(name, set()).add((status, repr(value)))
            assert mask == bits([0, 1, 2]), (r, name, mask)
            if name in BAD_INPUT:
                assert status == "err" and value.startswith("ValueError"), (r, name, value)
                assert BAD_INPUT[name] in value, (r, name, value)
            elif name == "peer_state_nobody_waits":
                assert (status, value) == ("ok", [False, False]), (r, name, value)
            else:
                assert status == "ok", (r, name, value)
    assert set(seen) >= set(BAD_INPUT)
    for name, outcomes in seen.items():
        assert len(outcomes) == 1, f"{name}: members disagree: {outcomes}"


@pytest.mark.timeout(300)
def test_recover_dead_rank_with_nobody_waiting_raises(extension):
    """recover_ranks on a dead rank (an extension, then rank 0) before any replacement
    started: ValueError "no process waits" on every member; the group goes on."""
    results = extension.get()
    for r in ("1", "2"):
        probes = {rank: outcome for _, rank, outcome in results[r]["probes"]}
        assert set(probes) == {0, 4}, (r, results[r]["probes"])
        for rank, (status, value) in probes.items():
            assert status == "err" and value.startswith("ValueError"), (r, rank, value)
            assert "no process waits" in value, (r, rank, value)


@pytest.mark.timeout(300)
def test_extension_slots_join_and_are_replaced(extension):
    """Ranks 3 and 4 join as extensions of a world-3 group; every process, the joiners
    included, then gets every collective over all five ranks, the per-rank forms with
    lists of the extended size (all_gather, all_to_all_single with its split sizes,
    reduce_scatter, broadcast/reduce/gather/scatter from every root, the extensions
    included; a p2p ring; all_reduce small, chunked, MAX; barrier); a killed extension
    rank and a killed rank 0 are replaced the same way; all agree on every membership
    change."""
    results = extension.get()
    problems = check_elastic(results, range(5), ALL_KINDS)
    assert not problems, "\n".join(problems[:40])
    assert len(results["2"]["batteries"]) == 3, results["2"]["batteries"]  # 3+4, 4, 0


def _conduct_wrong_capacity(group, extra):
    wait_key(group, "arrived", 180, extra)
    group.start(wrong_capacity_join_rank, ranks=[2], args=({"role": "joiner", "timeout_s": 10.0},))


@pytest.mark.timeout(150)
def test_joiner_with_wrong_max_world_size_is_refused():
    """World 2, max_world_size 3; a joiner for slot 2 has max_world_size 4. Expected:
    recover_ranks raises a ValueError naming max_world_size on the members (or join_group
    on the joiner), and the members' next all_reduces run over ranks 0 and 1."""
    plan = {"role": "member", "timeout_s": 10.0}
    out = launch(2, wrong_capacity_join_rank, plan, env(), _conduct_wrong_capacity, timeout_s=90)
    results = out.get()
    for r in ("0", "1"):
        recs = results[r][1]
        assert all(rec[1] == "ok" and rec[3] == bits([0, 1]) for rec in recs), (r, recs)
    firsts = [results[k][0] for k in ("0", "1", "2")]
    assert any(f[0] == "err" and "max_world_size" in f[1] for f in firsts), firsts


# --- subgroups ----------------------------------------------------------------------------


def _conduct_subgroups(group, extra):
    wait_key(group, "dying", 180, extra)
    mark_dead(group, "2")
    group.store.set("dead", "1")
    group.start(subgroup_rank, ranks=[2], args=({"role": "joiner", "timeout_s": 10.0},))


@pytest.mark.timeout(300)
def test_subgroups_survive_a_death_and_take_the_replacement():
    """World 4 with subgroups A = [1, 2, 3] and B = [0, 2]. Rank 2 (in both) dies: every
    op on A runs over its surviving members (group ranks 0 and 2) and on B over rank 0
    alone, get_active_ranks of each group shows the death; WORLD runs over 0, 1, 3. A
    replacement for rank 2 creates the subgroups in the same order and calls join_group on
    WORLD; the members call recover_ranks on WORLD (both reach the subgroups, too); then
    every op of every group covers all its members again."""
    plan = {"role": "member", "timeout_s": 10.0, "victim": 2}
    out = launch(4, subgroup_rank, plan, env(), _conduct_subgroups, timeout_s=200)
    results = out.get()
    sizes = {"W": 4, **{k: len(v) for k, v in SUBGROUPS.items()}}
    members = {"W": list(range(4)), **SUBGROUPS}
    problems = []
    for key, res in results.items():
        for tag, by_group in res.items():
            for name, (recs, active, synced) in by_group.items():
                if tag == "after_death":
                    alive = [g for g, r in enumerate(members[name]) if r != 2]
                else:
                    alive = list(range(sizes[name]))
                want_active = [1 if g in alive else 0 for g in range(sizes[name])]
                where = f"process {key}, {tag}, group {name}"
                if active != want_active or synced != len(alive):
                    problems.append(
                        f"{where}: active {active}, synced {synced}, want {want_active}"
                    )
                for rec in recs:
                    if rec[1] == "skip" and len(alive) < 2:
                        continue
                    if rec[1] != "ok":
                        problems.append(f"{where}: {rec[0]} root {rec[2]}: {rec[1]} {rec[4]}")
                    elif rec[3] is not None and rec[3] != bits(alive):
                        problems.append(
                            f"{where}: {rec[0]} covered group ranks {ranks_of(rec[3])}, want {alive}"
                        )
                kinds = {rec[0] for rec in recs}
                if not MASK_KINDS & set(KINDS) <= kinds:
                    problems.append(f"{where}: ran only {sorted(kinds)}")
    assert sorted(results) == ["0", "1", "2.1", "3"], sorted(results)
    assert set(results["0"]) == {"before", "after_death", "after_join"}
    assert not problems, "\n".join(problems[:40])


# --- mismatched max_world_size at init -------------------------------------------------------


@pytest.mark.timeout(120)
def test_mismatched_max_world_size_fails_init_on_every_rank():
    """Ranks that create the group with different max_world_size (4, 3, 3) all get a
    ValueError naming max_world_size from init_process_group, within seconds (no hang)."""
    plan = {"timeout_s": 10.0, "max_world_size": [4, 3, 3]}
    out = launch(3, mismatched_capacity_rank, plan, env(), timeout_s=90)
    results = out.get()
    for r in ("0", "1", "2"):
        status, value, seconds = results[r]
        assert status == "err" and value.startswith("ValueError"), (r, value)
        assert "max_world_size" in value, (r, value)
        assert seconds < 60, (r, seconds)


def _conduct_uneven(group, extra):
    wait_key(group, "ready/2", 180, extra)
    group.start(uneven_extension_rank, ranks=[3], args=({"role": "joiner", "timeout_s": 5.0},))


@pytest.mark.timeout(120)
def test_recover_with_uneven_extended_sizes_fails_alike_everywhere():
    """extend_group_size_to is local: if only rank 0 called it, recover_ranks([3]) must
    still raise ValueError on every member, and the group stay usable: the next
    all_reduces succeed on every member over ranks 0, 1, 2."""
    plan = {"role": "member", "timeout_s": 5.0}
    out = launch(3, uneven_extension_rank, plan, env(), _conduct_uneven, timeout_s=90)
    results = out.get()
    for r in ("0", "1", "2"):
        first, *ars = results[r]
        assert first[0] == "err" and first[1].startswith("ValueError"), (r, first)
        for rec in ars:
            assert rec[1] == "ok" and rec[3] == bits([0, 1, 2]), (r, ars)
