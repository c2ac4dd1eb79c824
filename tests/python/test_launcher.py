"""The harness itself: failures are reported against the right case and rank, and a
launch whose ranks crash or hang is bounded and says so.

A harness that cannot fail hides bugs, so these launches fail on purpose
and the tests check the verdicts.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from launcher import Case, Launch, run


def _ok(ctx):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.expect(t.item() == ctx.world_size * (ctx.world_size + 1) / 2, f"sum is {t.item()}")


def _wrong_on_rank1(ctx):
    t = torch.arange(4.0)
    ctx.expect_equal(t, t + (1 if ctx.rank == 1 else 0), "deliberate")


def _raises_everywhere(ctx):
    raise RuntimeError(f"deliberate error on rank {ctx.rank}")


def _crash_rank1(ctx):
    if ctx.rank == 1:
        os._exit(7)


def _sleep(ctx):
    time.sleep(120)


def failing(world: int) -> list[Case]:
    return [
        Case("ok", _ok),
        Case("wrong", _wrong_on_rank1),
        Case("raises", _raises_everywhere),
        Case("ok_after_raise", _ok),
        Case("crash", _crash_rank1),
        Case("never_run", _ok),
    ]


def hanging(world: int) -> list[Case]:
    return [Case("ok", _ok), Case("sleep", _sleep), Case("never_run", _ok)]


def test_verdicts_name_case_rank_and_cause():
    """A wrong result fails only its case and names the rank; an exception on every rank is
    reported and the launch goes on (the group still works); a crashed rank fails its case
    with the exit code, later cases report that they did not run, and the teardown fails."""
    result = run(Launch(failing, 2, "selftest-failing", grace_s=3, timeout_s=120))
    verdict = {
        c: result.verdict(c)
        for c in ("ok", "wrong", "raises", "ok_after_raise", "crash", "never_run", "<teardown>")
    }
    assert verdict["ok"] == (True, ""), verdict["ok"][1]
    passed, why = verdict["wrong"]
    assert not passed and "rank 1 fail" in why and "deliberate" in why and "rank 0" not in why
    passed, why = verdict["raises"]
    assert (
        not passed and "deliberate error on rank 0" in why and "deliberate error on rank 1" in why
    )
    assert verdict["ok_after_raise"] == (True, "")
    passed, why = verdict["crash"]
    assert not passed and "exited with code 7" in why, why
    passed, why = verdict["never_run"]
    assert not passed and "did not run" in why, why
    assert not verdict["<teardown>"][0]
    assert result.seconds < 60


def test_hanging_rank_is_killed_at_the_deadline():
    """A case that never returns is killed at the launch deadline and named."""
    start = time.monotonic()
    result = run(Launch(hanging, 2, "selftest-hanging", timeout_s=12))
    assert time.monotonic() - start < 30
    assert result.verdict("ok") == (True, "")
    passed, why = result.verdict("sleep")
    assert not passed and "did not finish" in why and "deadline" in why, why
    passed, why = result.verdict("never_run")
    assert not passed and "did not run" in why, why
    assert not result.verdict("<teardown>")[0]


def _sleep_then_return(rank, world_size, port, seconds):
    time.sleep(seconds)
    return rank * 10


def _raise(rank, world_size, port):
    raise ValueError(f"deliberate on rank {rank}")


def _raise_on_rank1_else_sleep(rank, world_size, port):
    if rank == 1:
        raise ValueError("deliberate on rank 1")
    time.sleep(120)  # a peer blocked on rank 1


def test_run_local_gives_up_on_blocked_peers_after_a_failure():
    """One rank raises while the others stay blocked: run_local raises after ``grace_s``,
    not at ``timeout_s``, and its message has the failed rank's traceback as well as
    the names of those still running."""
    import pytest

    from mooncake.launch import run_local

    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run_local(_raise_on_rank1_else_sleep, 3, timeout_s=100, grace_s=1)
    text = str(err.value)
    assert "['0', '2'] still ran 1 s after a failure" in text, text
    assert "ValueError: deliberate on rank 1" in text, text
    assert time.monotonic() - t0 < 60


def test_local_group_result_waits_for_one_process():
    """``LocalGroup.result(key)`` returns one process's result while the others run on;
    ``results()`` then has every one; a process that raised is reported with its
    traceback, and a wait past its bound says which process is late."""
    import pytest

    from mooncake.launch import LocalGroup

    with LocalGroup(2) as group:
        group.start(_sleep_then_return, ranks=[0], args=(0.0,))
        group.start(_sleep_then_return, ranks=[1], args=(3.0,))
        assert group.result("0", timeout_s=60) == 0
        assert not group.exited("1")
        with pytest.raises(RuntimeError, match=r"\['1'\] did not finish"):
            group.result("1", timeout_s=0.2)
        assert group.results(timeout_s=60) == {"0": 0, "1": 10}
        (key,) = group.start(_raise, ranks=[0])
        with pytest.raises(RuntimeError, match="deliberate on rank 0"):
            group.result(key, timeout_s=60)


def _environment(rank, world_size, port):
    return (
        os.environ.get("MC_LAUNCH_PROBE"),
        "MC_LAUNCH_GONE" in os.environ,
        torch.get_num_threads(),
    )


def test_ranks_get_the_environment_as_it_is_when_they_start(monkeypatch):
    """A rank forked from the fork server (which imported torch before this test set
    anything) sees the launcher's environment as it is at ``start``, with the group's
    changes, and takes ``OMP_NUM_THREADS`` as torch's thread count; so does a spawned one."""
    import pytest

    from mooncake.launch import LocalGroup

    env = {"OMP_NUM_THREADS": "1", "MC_LAUNCH_GONE": None}
    for method in ("forkserver", "spawn"):
        with LocalGroup(1, env=env, start_method=method) as group:
            monkeypatch.setenv("MC_LAUNCH_PROBE", "first")
            monkeypatch.setenv("MC_LAUNCH_GONE", "1")
            group.start(_environment)
            assert group.result("0", timeout_s=60) == ("first", False, 1), method
            monkeypatch.setenv("MC_LAUNCH_PROBE", "second")
            (key,) = group.start(_environment, ranks=[0])
            assert group.result(key, timeout_s=60) == ("second", False, 1), method
    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn'"):
        LocalGroup(1, start_method="fork")


def test_kill_leaves_an_exited_process_alone():
    """The fork server reaps a rank as soon as it exits, so its pid is gone (and may be
    reused): ``kill`` of an exited process does nothing and raises nothing, whatever
    the signal, and a live one still dies."""
    import signal

    from mooncake.launch import LocalGroup

    with LocalGroup(2) as group:
        group.start(_sleep_then_return, ranks=[0], args=(0.0,))
        group.start(_sleep_then_return, ranks=[1], args=(60.0,))
        assert group.result("0", timeout_s=60) == 0
        group.wait("0")
        for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT):
            group.kill("0", sig)
        group.kill(1)
        assert group.wait("1") == -signal.SIGKILL
