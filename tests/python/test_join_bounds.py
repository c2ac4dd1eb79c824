"""A process that asks to join a group none of whose processes runs any more is told so
within seconds, instead of waiting out the group's timeout (30 minutes by default)."""

from __future__ import annotations

import time

from mooncake.launch import LocalGroup


def _member(rank: int, world: int, port: int) -> int:
    from mooncake.launch import init_rank

    init_rank(rank, world, port)
    return rank  # returns from main: the process exits with the group never destroyed


def _joiner(rank: int, world: int, port: int) -> tuple[str, str, float]:
    from mooncake import pg
    from mooncake.launch import init_rank

    # The group's timeout is torch's default, 30 minutes: what join_group would wait.
    init_rank(rank, world, port, is_extension=True)
    start = time.monotonic()
    try:
        pg.join_group()
    except RuntimeError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "joined", "", time.monotonic() - start


def test_joining_a_group_with_no_process_left_fails_promptly():
    with LocalGroup(2) as group:
        members = group.start(_member)
        done = group.results(timeout_s=120)
        assert sorted(done) == members
        limit = time.monotonic() + 60
        while not all(group.exited(k) for k in members) and time.monotonic() < limit:
            time.sleep(0.05)  # (and reaps them: a zombie still answers kill(pid, 0))
        (key,) = group.start(_joiner, ranks=[1])  # a replacement for slot 1
        kind, message, took = group.results(timeout_s=120)[key]
    assert kind == "PeerFailedError", (kind, message)
    assert "no process of this group runs any more" in message, message
    assert took < 10, f"the joiner was told after {took:.1f} s"
