"""The EP device path (CUDA kernels over mapped workspaces) against the portable path.

Needs a CUDA GPU and a CUDA build of the extension (``make gpu-check`` runs
it on the GPU machine); skipped elsewhere. Every world size shares the one
GPU: its ranks map each other's workspaces through CUDA IPC, and their
kernels run side by side under MPS (or time-slice without it: correct, only
slower, hence the generous deadlines).

* ``test_device_path_matches_portable``: every case of ``ep_device_ranks.CASES``
  (BF16, FP16, FP8; hook, async, an async call left unwaited before a plain one,
  zero-copy, graph capture and replay; odd shapes, ``-1`` selections, duplicates,
  int32 ids, top-16, a rank with no tokens; 1024 experts, and a kernel block with
  more rows than it gathers at once) at 1, 2 and 4 ranks: the same rows in the same order, payloads and
  combine bit for bit; and outputs reused by a later call only once nothing
  refers to them.
* ``test_a_missing_async_order_is_caught``: the negative control of the async case: with
  the Buffer's order of a plain call after an unwaited async_finish one taken out, it fails.
* ``test_a_rank_that_exits``: a rank exits before dispatch, or between
  dispatch and combine; the others finish with exactly that rank masked and
  every other row exact, told by the group's transport (masked as lost, far
  inside a 60 s ``timeout_us``: the kernels did not wait for the deadline).
* ``test_a_rejected_call_keeps_the_ranks_in_step``: one rank's dispatch is rejected while
  the other's runs; the next rounds are exact at full strength with one call number.
* ``test_a_replaced_rank``: a rank exits, a replacement joins, full rounds.
* ``test_a_stopped_rank_is_fenced`` (the canary of device fencing): a rank stopped with
  SIGSTOP is masked past MOONCAKE_HANG_MS, left out and replaced; resumed, its next
  dispatch raises LeftOutError, and a late launch of its kernel (straight through the
  extension, past that check) stores into nobody; the survivors' and the replacement's
  rounds after it are exact.
"""

from __future__ import annotations

import signal
import time

import pytest

import ep_device_ranks as edr

pytestmark = pytest.mark.skipif(
    not edr.has_device_path(), reason="needs a CUDA GPU and a CUDA build of mooncake"
)

ENV = {"MOONCAKE_EP_WAIT_CAP_MS": "60000"}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_device_path_matches_portable(world):
    from mooncake.launch import run_local

    names = [c.name for c in edr.CASES]
    results = run_local(edr.rank_cases, world, args=(names,), env=ENV, timeout_s=560)
    failures = [
        f"rank {r}, {name}:\n{tb}"
        for r, res in enumerate(results)
        for name, tb in res.items()
        if tb is not None
    ]
    assert not failures, "\n".join(failures)
    assert all(set(res) == set(names) for res in results)


@pytest.mark.parametrize("world", [1, 2])
def test_a_missing_async_order_is_caught(world):
    """The negative control of ``fp8/async_unwaited``: with the Buffer's order of a plain
    call after an unwaited async_finish one taken out (in the ranks), the case fails,
    saying the plain calls ran first. (If it could not fail, this would.) The waits
    that the calls left unordered may meet are cut to 5 s."""
    from mooncake.launch import run_local

    name = "fp8/async_unwaited"
    env = {**ENV, "MOONCAKE_EP_WAIT_CAP_MS": "5000"}
    results = run_local(edr.rank_cases, world, args=([name], True), env=env, timeout_s=300)
    for r, res in enumerate(results):
        why = res.get(name)
        assert why is not None and "ran before the async_finish one had ended" in why, (r, why)


@pytest.mark.parametrize("when", ["dispatch", "combine"])
def test_a_rank_that_exits(when):
    from mooncake.launch import LocalGroup

    world, victim, timeout_s = 3, 2, 60
    with LocalGroup(world, ENV) as group:
        group.start(edr.rank_exit, args=(when, victim, timeout_s * 1_000_000))
        group.expect_exit(victim)
        results = group.results(timeout_s=240)
    for r in range(world):
        if r == victim:
            continue
        res = results[str(r)]
        assert res["active"] == [1 if s != victim else 0 for s in range(world)], res
        assert res["events"] and f"rank {victim} masked: lost" in res["events"][0], res
        # Not the deadline: half of it is far more than a launch and the host's notice take.
        masked_in = res["dispatch_s"] if when == "dispatch" else res["combine_s"]
        assert masked_in < timeout_s / 2, res


def test_a_rejected_call_keeps_the_ranks_in_step():
    """One rank's dispatch is rejected while the other's runs (and masks it at a short
    deadline); the rounds after are exact at full strength on both, with one call number
    (``ep_device_ranks.rank_rejected``), each in one 60 s deadline."""
    from mooncake.launch import run_local

    results = run_local(edr.rank_rejected, 2, env=ENV, timeout_s=240)
    assert results[0]["seqs"] == results[1]["seqs"], results
    assert len(results[1]["events"]) == 0, results
    assert any("rank 1 masked" in e for e in results[0]["events"]), results


@pytest.mark.parametrize("backend", ["mooncake-cpu", "mooncake"])
def test_a_replaced_rank(backend):
    """A rank exits, the survivors mask it, a replacement joins the group and builds its
    Buffer while the survivors call update_ep_member; then the device path runs at full
    strength, the replacement's first call included (they agree on the call count)."""
    from mooncake.launch import LocalGroup

    world, victim = 3, 2
    with LocalGroup(world, ENV) as group:
        group.start(edr.rank_replace, args=(backend, victim, "member"))
        deadline = time.monotonic() + 180
        while not group.store.check(["dying"]):
            assert time.monotonic() < deadline, "the victim never got to its exit"
            time.sleep(0.05)
        group.expect_exit(victim)
        assert group.wait_all([str(victim)], timeout_s=60) == "", "the victim did not exit"
        group.store.set("dead", "1")
        group.start(edr.rank_replace, ranks=[victim], args=(backend, victim, "joiner"))
        results = group.results(timeout_s=240)
    assert sorted(results) == ["0", "1", f"{victim}.1"], sorted(results)
    for key, res in results.items():
        rounds = res["rounds"]
        full = rounds[-2:]
        assert all(r["active"] == [1] * world for r in full), (key, rounds)
        assert len({r["seq"] for r in full}) == 2, (key, rounds)
        if key != f"{victim}.1":
            assert rounds[1]["active"] == [1, 1, 0], (key, rounds)
            assert rounds[1]["dispatch_s"] < 1.5 + 2.0, (key, rounds)
    seqs = {tuple(r["seq"] for r in res["rounds"][-2:]) for res in results.values()}
    assert len(seqs) == 1, f"the ranks' call numbers differ: {seqs}"


def test_a_stopped_rank_is_fenced():
    """See the module docstring: SIGSTOP mid-use, masked by the kernels past the hang
    limit (not at timeout_us), left out by the group, replaced; SIGCONT: LeftOutError
    at its next dispatch, and its late kernel fenced; every other round exact."""
    from mooncake.launch import LocalGroup

    world, victim = 3, 2
    env = dict(ENV, MOONCAKE_HANG_MS="1000")
    with LocalGroup(world, env) as group:
        group.start(edr.rank_stop, args=(victim, "member"))

        def wait_keys(keys, what):
            deadline = time.monotonic() + 180
            while not group.store.check(keys):
                assert time.monotonic() < deadline, what
                time.sleep(0.05)

        wait_keys(["stopping"], "the victim never stopped")
        group.start(edr.rank_stop, ranks=[victim], args=(victim, "joiner"))
        wait_keys([f"joined/{r}" for r in range(world)], "the replacement never joined")
        group.kill(str(victim), signal.SIGCONT)
        results = group.results(timeout_s=240)
    assert sorted(results) == ["0", "1", str(victim), f"{victim}.1"], sorted(results)
    stopped = results[str(victim)]
    assert stopped["told"] == "LeftOutError", stopped
    assert stopped["late"]["fenced"] and stopped["late"]["next"] == "LeftOutError", stopped
    for key, res in results.items():
        if key == str(victim):
            continue
        rounds = res["rounds"]
        assert all(r["active"] == [1] * world for r in rounds[-4:]), (key, rounds)
        if key != f"{victim}.1":
            assert rounds[1]["active"] == [1, 1, 0], (key, rounds)
            # Masked for its heartbeat (1 s), far inside the 20 s timeout_us.
            assert rounds[1]["dispatch_s"] < 10.0, (key, rounds)
