"""Fault tolerance of the mooncake-cpu process group.

Ranks are killed with kill -9 (by the parent at a random time, right after an op, or from a
timer inside a small op, a large chunked op, an all_gather, an all_to_all or a p2p ring),
stopped with SIGSTOP, or late; two fail at once, or one during the recovery from another.
The survivors must agree op by op on the set of ranks each result covers (rank ``r``
contributes ``1 << r``, see ft_ranks.py), notice the failure fast, and keep working.

Every launch goes through ``mooncake.launch.LocalGroup`` (the store lives in the test
process, so rank 0 may die too). Starting ranks costs seconds on the 2-core test
machines, so each launch runs many ops through several failures. Randomized long runs are
marked ``stress`` (``make stress``); a fixed-seed sample runs by default.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from ft_parent import (
    CHUNKED,
    chaos_plan,
    check_chaos,
    conduct_chaos,
    env,
    error_of,
    launch,
    mark_dead,
    names_rank,
    wait_key,
)
from ft_ranks import (
    CHAOS_KINDS,
    bits,
    chaos_rank,
    destroyed_peer_rank,
    late_rank,
    no_recover_rank,
    p2p_dead_peer_rank,
    ranks_of,
    stopped_peer_recv_rank,
)
from launcher import needs_cuda, ucx_built

STRESS_ROUNDS = int(os.environ.get("MOONCAKE_STRESS_ROUNDS", "12"))


def _dev_shm() -> set[str]:
    # Python's own multiprocessing semaphores come and go; they are not ours.
    return {n for n in os.listdir("/dev/shm") if not n.startswith(("sem.", "mp-"))}


@pytest.fixture(autouse=True, scope="module")
def nothing_left_in_dev_shm():
    """Segments are anonymous (memfd): after every kill -9 of this module, no rank may
    have left a file in /dev/shm."""
    before = _dev_shm()
    yield
    left = sorted(_dev_shm() - before)
    assert not left, f"new /dev/shm entries after the fault-tolerance tests: {left}"


def run_chaos(world, plan, env_vars, timeout_s=120):
    out = launch(world, chaos_rank, plan, env_vars, conduct_chaos(plan), timeout_s=timeout_s)
    results = out.get()
    problems = check_chaos(results, world, plan)
    assert not problems, (
        f"seed {plan['seed']}, events {[(e['victims'], e['label']) for e in plan['events']]}, "
        f"{out.seconds:.1f} s:\n" + "\n".join(problems[:40])
    )
    return out


# --- kill -9 at random points --------------------------------------------------------------


@pytest.mark.timeout(150)
def test_kill_world3_rank0_in_big_op_then_in_all_to_all():
    """World 3: rank 0 dies inside a chunked all_reduce, then rank 2 inside an
    all_to_all; rank 1 goes on alone (every op over a group of one)."""
    plan = chaos_plan(3, [([0], "in_big"), ([2], "in_a2a")])
    run_chaos(3, plan, env(CHUNKED))


@pytest.mark.timeout(150)
def test_kill_world4_over_tcp():
    """World 4 over the tcp transport (a failure shows as a closed socket): rank 2 killed
    by the parent at a random time, then rank 0 right after an op, then rank 3 inside a
    p2p ring."""
    plan = chaos_plan(4, [([2], "random"), ([0], "between"), ([3], "in_p2p")])
    run_chaos(4, plan, env(CHUNKED, MOONCAKE_TRANSPORT="tcp"))


@pytest.mark.timeout(200)
def test_kill_world8_six_ways():
    """World 8 on shared memory: rank 0 inside a chunked all_reduce, rank 5 inside a p2p
    ring, rank 3 at a random time, rank 7 right after an op, rank 1 inside a small
    op, rank 6 inside an all_to_all; ranks 2 and 4 remain."""
    plan = chaos_plan(
        8,
        [
            ([0], "in_big"),
            ([5], "in_p2p"),
            ([3], "random"),
            ([7], "between"),
            ([1], "in_small"),
            ([6], "in_a2a"),
        ],
    )
    run_chaos(8, plan, env(CHUNKED))


@pytest.mark.timeout(200)
def test_two_at_once_then_one_during_recovery():
    """World 6: ranks 1 and 4 killed at the same moment; then rank 0, and rank 2 a few ms
    later, while the survivors notice and recover from rank 0's death."""
    plan = chaos_plan(6, [([1, 4], "random"), ([0, 2], "random", (0.005, 0.08))])
    run_chaos(6, plan, env(CHUNKED))


@pytest.mark.timeout(200)
def test_kill_during_p2p():
    """World 6, ops alternating a small all_reduce and a p2p ring of 24 KiB messages (6
    chunks of 4 KiB): ranks 0, 3 and 5 die inside the ring, rank 2 at a random time. p2p
    with the dead rank raises naming it within the timeout; p2p among the living and the
    collectives go on; no wait hangs (a kill in the middle of a multi-chunk message used to
    leave the irecv waiting forever)."""
    plan = chaos_plan(
        6,
        [([0], "in_p2p"), ([3], "in_p2p"), ([2], "random"), ([5], "in_p2p")],
        kinds=("ar", "p2p", "ar_big", "p2p"),
    )
    run_chaos(6, plan, env(CHUNKED), timeout_s=90)


@pytest.mark.timeout(200)
def test_kill_during_ep_dispatch_and_combine():
    """World 4, every kind of op and an EP Buffer dispatch + combine (portable path):
    rank 1 dies inside the EP op, then rank 3 at a random time. The survivors' EP
    results leave out exactly the dead ranks' experts, all survivors alike, as the
    collectives leave out the dead ranks."""
    plan = chaos_plan(5, [([1], "in_ep"), ([3], "random")], kinds=CHAOS_KINDS)
    run_chaos(4, plan, env(CHUNKED))


@pytest.mark.timeout(200)
def test_slow_ranks_are_never_left_out():
    """World 4: rank 1, then rank 0, is stopped for 0.3-0.8 s (a slow rank: under the
    2 s hang limit) inside the ops; nobody is left out and every op covers all four.
    Then rank 2 is killed and rank 3 slowed: the three survivors go on, and the slow
    one stays among them."""
    plan = chaos_plan(11, [([1], "slow"), ([0], "slow"), ([2], "random"), ([3], "slow")])
    out = run_chaos(4, plan, env(CHUNKED))
    assert len(out.extra["slows"]) == 3, out.extra


def random_chaos_plan(seed: int, world: int):
    """Up to world-1 failures of random ranks (rank 0 often among them), random modes,
    and now and then a rank that is only slow (stopped under the hang limit)."""
    rng = random.Random(seed)
    order = list(range(world))
    rng.shuffle(order)
    n_events = rng.randint(1, min(4, world - 1))
    events, k = [], 0
    while len(events) < n_events and k < world - 1:
        if rng.random() < 0.2:
            events.append(([rng.choice(order[k:])], "slow"))  # removes nobody
        elif k + 2 <= world - 1 and rng.random() < 0.25:
            events.append((order[k : k + 2], "random", rng.choice([(0, 0.001), (0.005, 0.1)])))
            k += 2
        else:
            modes = ["random", "between", "in_small", "in_big", "in_p2p", "in_ag", "in_a2a"]
            mode = rng.choice([*modes, "in_ep"])
            events.append(([order[k]], mode))
            k += 1
    return chaos_plan(seed, events, kinds=CHAOS_KINDS)


@pytest.mark.stress
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("world", [3, 4, 8])
def test_kill_random_stress(world, transport):
    """Random victims (one or two at a time), modes and timings over every kind of op,
    ``MOONCAKE_STRESS_ROUNDS`` launches (default 12) per case."""
    for r in range(STRESS_ROUNDS):
        seed = 1000 * world + r + (500 if transport == "tcp" else 0)
        plan = random_chaos_plan(seed, world)
        run_chaos(world, plan, env(CHUNKED, MOONCAKE_TRANSPORT=transport))


@needs_cuda
@pytest.mark.timeout(200)
def test_kill_world4_cuda():
    """World 4 on CUDA tensors (backend ``mooncake``, ``active_ranks`` on the GPU; all_reduce,
    all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single without split sizes
    on the device-driven kernels up to 8 MiB, every other op that fits on the device plane):
    rank 2 killed inside a big all_reduce, rank 0 right after an op, rank 3 inside a p2p
    ring; the survivors agree op by op, as on the CPU."""
    plan = chaos_plan(4, [([2], "in_big"), ([0], "between"), ([3], "in_p2p")])
    plan["device"] = "cuda"
    # Every op the kernels do not take runs on the device plane when it fits (the others are
    # staged through host memory).
    run_chaos(4, plan, env(CHUNKED, MOONCAKE_CUDA_PLANE_MIN_BYTES="0"))


@needs_cuda
@pytest.mark.timeout(200)
def test_kill_world4_cuda_mapped():
    """The same with ``MOONCAKE_CUDA_MAPPED=1`` and a 64 KiB device-driven bound, so that the
    big all_reduce (512 KiB) reads the ranks' tensors in place, one launch on the caller's
    stream that no host waits for: rank 2 killed inside it, rank 0 right after an op, rank 3
    inside a p2p ring; each launch serves its op among the survivors by itself (through the
    segments where a rank was lost before its share was summed), and the survivors agree op
    by op, as on the CPU."""
    plan = chaos_plan(4, [([2], "in_big"), ([0], "between"), ([3], "in_p2p")])
    plan["device"] = "cuda"
    run_chaos(
        4,
        plan,
        env(
            CHUNKED,
            MOONCAKE_CUDA_PLANE_MIN_BYTES="0",
            MOONCAKE_CUDA_MAPPED="1",
            MOONCAKE_CUDA_DIRECT_BYTES=str(64 << 10),
        ),
    )


# --- p2p with a dead peer --------------------------------------------------------------------


def _conduct_p2p_dead(group, extra):
    wait_key(group, "dying", 120, extra)
    mark_dead(group, "2")
    time.sleep(0.5)  # the peer has been dead a while: a closed socket was noticed, too
    group.store.set("dead", "1")


@pytest.fixture(scope="module", params=["auto", "tcp"])
def p2p_dead(request):
    return launch(
        4,
        p2p_dead_peer_rank,
        {"timeout_s": 10.0},
        env(CHUNKED, MOONCAKE_TRANSPORT=request.param),
        _conduct_p2p_dead,
        timeout_s=150,
    )


def _expect_fails_naming(outcome, peer, bound_s, what):
    """A PeerFailedError with ``.ranks == [peer]`` (or a TimeoutError) naming ``peer``."""
    msg, seconds = outcome
    assert msg != "ok", f"{what}: succeeded, but rank {peer} is dead"
    assert error_of(msg) in (("PeerFailedError", [peer]), ("TimeoutError", None)), f"{what}: {msg}"
    assert names_rank(msg, peer), f"{what}: the error does not name rank {peer}: {msg}"
    assert seconds < bound_s, f"{what}: took {seconds:.2f} s"


@pytest.mark.timeout(200)
def test_p2p_recv_from_dead_peer_raises_and_live_peers_keep_working(p2p_dead):
    """recv/irecv from a dead rank raise naming it, long before the 10 s timeout, both
    before and after a collective noticed the death; a big send (many chunks) to it
    raises too; p2p between live ranks keeps working; the collective in between runs
    over the survivors."""
    res = p2p_dead.get()
    for stage in ("before", "after"):
        for name in ("recv", "irecv"):
            _expect_fails_naming(res["0"][f"{stage}/{name}"], 2, 3.0, f"rank 0 {stage}/{name}")
        _expect_fails_naming(res["1"][f"{stage}/send_big"], 2, 3.0, f"rank 1 {stage}/send_big")
        for r in ("0", "3"):
            assert res[r][f"{stage}/live"][0] == "ok", (r, stage, res[r][f"{stage}/live"])
    for r in ("0", "1", "3"):
        assert res[r]["pre"][3] == bits([0, 1, 2, 3]), res[r]["pre"]
        for key in ("collective", "final"):
            assert res[r][key][:2] == ("ar", "ok") and res[r][key][3] == bits([0, 1, 3]), (
                r,
                key,
                res[r][key],
            )
        assert res[r]["active"] == [1, 1, 0, 1], res[r]["active"]


@pytest.mark.timeout(200)
def test_rooted_ops_with_a_dead_root_raise_peer_failed_error_naming_it(p2p_dead):
    """broadcast from the dead rank 2, first as the op that notices its death, then once
    the group knows; scatter from it, reduce and gather to it: every survivor raises
    PeerFailedError, a RuntimeError (caught as one), with ``.ranks == [2]``, naming it;
    the group goes on (the collectives after them cover {0, 1, 3})."""
    res = p2p_dead.get()
    for r in ("0", "1", "3"):
        for key in ("dead_root/bcast_first", "dead_root/bcast"):
            name, ranks, msg = res[r][key]
            assert (name, ranks) == ("PeerFailedError", [2]), (r, key, res[r][key])
            assert names_rank(msg, 2) and "root" in msg, (r, key, msg)
        for kind in ("scatter", "reduce", "gather"):
            rec = res[r][f"dead_root/{kind}"]
            assert rec[1] == "err" and error_of(rec[4]) == ("PeerFailedError", [2]), (r, rec)
            assert names_rank(rec[4], 2), (r, rec)


@pytest.mark.timeout(200)
def test_p2p_small_send_to_dead_peer_raises(p2p_dead):
    """isend/send of a message that fits in one slot to a dead rank raise naming it (its
    death is known: its pidfd, or its closed socket), before and after a collective
    noticed the death."""
    res = p2p_dead.get()
    for stage in ("before", "after"):
        for name in ("isend_small", "send_small"):
            _expect_fails_naming(res["1"][f"{stage}/{name}"], 2, 3.0, f"rank 1 {stage}/{name}")


# --- SIGSTOP, late ranks --------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_sigstop_is_detected_by_heartbeat():
    """World 4, MOONCAKE_HANG_MS=500, op timeout 15 s: rank 1 is stopped between two of
    its ops, later rank 3 at a random moment (mostly inside an op). The survivors go on
    within the 8 s bound (well under the op timeout: the stopped heartbeat gave it away);
    once they have, SIGCONT: the stopped rank's next op raises LeftOutError (a
    RuntimeError; ``.ranks`` == [the stopped rank]; "left out"), and anything it
    completed agrees with the survivors. (With this seed rank 1 stops right before a
    p2p ring, whose recv from it must give up after MOONCAKE_HANG_MS too.)"""
    plan = chaos_plan(1, [([1], "stop_between"), ([3], "stop")])
    run_chaos(4, plan, env(CHUNKED, MOONCAKE_HANG_MS="500"))


@pytest.mark.stress
@pytest.mark.timeout(3600)
def test_sigstop_random_stress():
    """Worlds 3, 4, 6; random ranks stopped one after the other, between ops or at random
    moments; ``MOONCAKE_STRESS_ROUNDS`` launches."""
    for r in range(STRESS_ROUNDS):
        rng = random.Random(7000 + r)
        world = rng.choice([3, 4, 6])
        victims = rng.sample(range(world), rng.randint(1, world - 1))
        events = [([v], rng.choice(["stop", "stop_between"])) for v in victims]
        plan = chaos_plan(7000 + r, events)
        run_chaos(world, plan, env(CHUNKED, MOONCAKE_HANG_MS="500"))


def _conduct_stopped_peer(group, extra):
    wait_key(group, "stop_me", 120, extra)
    group.kill(1, signal.SIGSTOP)
    group.store.set("stopped", "1")
    wait_key(group, "finished", 60, extra)
    group.kill(1)


@pytest.mark.timeout(120)
def test_p2p_recv_from_stopped_peer_fails_within_hang_ms():
    """World 2, MOONCAKE_HANG_MS=500, op timeout 8 s: rank 1 is stopped; rank 0's recv
    from it raises naming it within 3 s (as a collective would), and the next all_reduce
    covers rank 0 alone."""
    out = launch(
        2,
        stopped_peer_recv_rank,
        {"timeout_s": 8.0},
        env(MOONCAKE_HANG_MS="500"),
        _conduct_stopped_peer,
        timeout_s=90,
    )
    recv, (rec, _) = out.get()["0"]
    assert rec[1] == "ok" and rec[3] == bits([0]), rec
    _expect_fails_naming(recv, 1, 3.0, "recv from the stopped rank 1")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "tcp", *(["ucx"] if ucx_built() else [])])
def test_a_rank_that_destroyed_its_group_is_left_out_at_once(transport):
    """World 3, MOONCAKE_HANG_MS=5000, op timeout 15 s: rank 2 destroys its process group
    and lives on. The next all_reduce of ranks 0 and 1 covers just them within 1.5 s: the
    closed segment (shm) or the connection closed without a farewell (tcp, ucx) says rank 2 is
    gone, so neither the hang limit nor the op timeout is waited out (over shm it took
    the hang limit before the segment said so)."""
    out = launch(
        3,
        destroyed_peer_rank,
        {"timeout_s": 15.0},
        env(MOONCAKE_HANG_MS="5000", MOONCAKE_TRANSPORT=transport),
        timeout_s=90,
    )
    res = out.get()
    for r in ("0", "1"):
        rec, seconds = res[r]
        assert rec[1] == "ok" and rec[3] == bits([0, 1]), (r, rec)
        assert seconds < 1.5, f"rank {r}: the op took {seconds:.2f} s"


@pytest.fixture(scope="module")
def late():
    """World 4, op timeout 1 s. Step 0: rank 3 calls the op 3.5 s late (long after the
    timeout and its grace). Step 1: rank 2 calls it 1.25 s late (past the timeout, within
    the grace of up to 0.5 s: whether it is waited for is a race)."""
    plan = {"timeout_s": 1.0, "late": [(3, 3.5), (2, 1.25), (-1, 0)]}
    return launch(4, late_rank, plan, env(), timeout_s=120)


@pytest.mark.timeout(150)
def test_late_rank_is_left_out_after_the_timeout(late):
    """The others' op completes over ranks {0, 1, 2} after the timeout and its grace (1 to
    1.5 s, well before rank 3 shows up); rank 3 gets a LeftOutError (a RuntimeError) with
    ``.ranks == [3]`` saying it was left out, and no result."""
    res = late.get()
    for r in ("0", "1", "2"):
        step0 = [x for x in res[r]["log"] if x[0] == 0]
        (_, _, rec, seconds) = step0[0]
        assert rec[1] == "ok" and rec[3] == bits([0, 1, 2]), rec
        assert 1.0 <= seconds < 3.0, f"rank {r}: the late op took {seconds:.2f} s"
        assert all(x[2][3] == bits([0, 1, 2]) for x in step0[1:]), step0
    log3 = res["3"]["log"]
    assert res["3"]["left_out"] and len(log3) == 1, log3
    rec = log3[-1][2]
    assert rec[1] == "err" and "left out" in rec[4], rec
    assert error_of(rec[4]) == ("LeftOutError", [3]), rec


@pytest.mark.timeout(150)
def test_late_rank_never_returns_a_result_the_others_do_not_share(late):
    """Rank 2 calls the op 1.25 s late: whether or not the others wait for it, every rank
    that returns a result for that op returns it over the same set of ranks (if rank 2 is
    left out, its op raises)."""
    res = late.get()
    got = {}
    for r in ("0", "1", "2"):
        step1 = [x for x in res[r]["log"] if x[0] == 1]
        if step1:
            got[r] = step1[0][2]
    ok = {r: rec[3] for r, rec in got.items() if rec[1] == "ok"}
    assert len(set(ok.values())) == 1, {r: ranks_of(m) for r, m in ok.items()}
    for r, rec in got.items():
        if rec[1] != "ok":
            assert "left out" in rec[4], (r, rec)
            assert error_of(rec[4]) == ("LeftOutError", [int(r)]), (r, rec)


# --- recovery turned off ---------------------------------------------------------------------


def _conduct_no_recover(group, extra):
    wait_key(group, "dying", 120, extra)
    mark_dead(group, "1")
    group.store.set("dead", "1")


@pytest.mark.timeout(120)
def test_recover_off_ops_raise_naming_the_dead_rank():
    """MOONCAKE_RECOVER=0, world 3: after rank 1 dies, every op on the others raises a
    PeerFailedError with ``.ranks == [1]`` naming rank 1, fast (pidfd), again and again."""
    out = launch(
        3,
        no_recover_rank,
        {"timeout_s": 10.0},
        env(CHUNKED, MOONCAKE_RECOVER="0"),
        _conduct_no_recover,
        timeout_s=90,
    )
    res = out.get()
    for r in ("0", "2"):
        assert res[r]["log"][0][3] == bits([0, 1, 2]), res[r]["log"]
        for rec, seconds in res[r]["timed"]:
            assert rec[1] == "err" and error_of(rec[4]) == ("PeerFailedError", [1]), (r, rec)
            assert names_rank(rec[4], 1), (r, rec)
            assert seconds < 3.0, (r, rec, seconds)
