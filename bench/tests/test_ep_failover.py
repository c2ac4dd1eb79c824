"""bench_ep_failover: its plans of faults, its rows, what it does without a GPU, and one
small run on the CPU (the program end to end: launch, checks, table, JSON)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_ep_failover as bench  # noqa: E402


def test_ep_cycles_have_every_kind_and_rank0_first():
    cycles = bench.ep_cycles(7, 4, ["between", "inside"], kills=6, stops=3)
    kinds = [(c["fault"], c["where"]) for c in cycles]
    assert kinds.count(("kill", "between")) == 6
    assert kinds.count(("kill", "inside")) == 6
    assert kinds.count(("stop", "between")) == 3
    assert all(0 <= c["victim"] < 4 for c in cycles)
    for kind in set(kinds):  # the first fault of each kind strikes rank 0
        first = next(c for c in cycles if (c["fault"], c["where"]) == kind)
        assert first["victim"] == 0, (kind, cycles)
    assert bench.ep_cycles(7, 4, ["between", "inside"], 6, 3) == cycles  # seeded


def test_ar_cycles_kill_inside_at_a_share_of_the_op():
    cycles = bench.ar_cycles(3, 4, 5)
    assert len(cycles) == 5 and cycles[0]["victim"] == 0
    assert all(c["fault"] == "kill" and c["where"] == "inside" for c in cycles)
    assert all(0.05 <= c["frac"] <= 0.9 for c in cycles)


def test_graph_cycles_kill_between_replays_and_need_cuda():
    cycles = bench.graph_cycles(3, 4, 4)
    assert len(cycles) == 4 and cycles[0]["victim"] == 0
    assert all(c["fault"] == "kill" and c["where"] == "between" for c in cycles)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--graph"])


def test_graph_rows_name_the_replay_and_its_target():
    faults = [
        _fault(0, "kill", "between", 0, 4.0, full_ms=300.0, step_ms=0.02),
        _fault(1, "kill", "between", 3, 80.0, full_ms=320.0, step_ms=0.02),
    ]
    launch = {"scenario": "graph", "world": 4, "timeout_us": -1, "hang_ms": 2000,
              "ar_bytes": 4096, "faults": faults}  # fmt: skip
    rows = {r["measure"]: r for r in bench.rows_of(launch)}
    kill = rows["kill → survivors' replay of a captured 4 KiB all_reduce returned"]
    assert (kill["n"], kill["p99_ms"], kill["rank0"]) == (2, 80.0, 1)
    assert kill["target_ms"] == bench.TARGETS_MS["graph"] and kill["met"] is False
    assert rows["kill → replacement joined → first full replay"]["median_ms"] == 310.0


def test_a_launch_takes_only_the_faults_that_fit_the_time_left():
    plan = {"world": 8, "cycles": bench.ep_cycles(5, 8, ["between"], kills=50, stops=0)}
    assert bench.fit_to_time(plan, 26.0, None, "x") is plan  # no rate seen yet: all of them
    fit = bench.fit_to_time(plan, 26.0, 0.84, "x")  # 0.8 of 26 s at 0.84 s a fault
    assert len(fit["cycles"]) == 24 and fit["faults_planned"] == 50
    assert fit["cycles"] == plan["cycles"][:24] and len(plan["cycles"]) == 50
    assert bench.fit_to_time(plan, 600.0, 0.84, "x") is plan  # they all fit
    assert len(bench.fit_to_time(plan, 0.5, 0.84, "x")["cycles"]) == 1
    healthy = {**plan, "healthy": {"steps": 60}}  # timed apart: left as it is
    assert bench.fit_to_time(healthy, 26.0, 0.84, "x") is healthy


def _fault(c, fault, where, victim, next_ms, **kw):
    return {"c": c, "fault": fault, "where": where, "victim": victim, "next_ms": next_ms, **kw}


def test_rows_give_median_p99_targets_and_rank0():
    faults = [
        _fault(0, "kill", "between", 0, 5.0, full_ms=50.0, join_full_ms=20.0, step_ms=1.0),
        _fault(1, "kill", "between", 2, 30.0, full_ms=60.0, join_full_ms=25.0, step_ms=1.0),
        _fault(2, "kill", "inside", 1, 8.0, full_ms=40.0, step_ms=1.0),
        _fault(3, "stop", "between", 0, 2010.0, full_ms=2100.0, told_ms=3.0, step_ms=1.0),
    ]
    launch = {
        "scenario": "ep",
        "world": 4,
        "timeout_us": -1,
        "hang_ms": 2000,
        "faults": faults,
        "healthy": {"steps": 3, "step": bench.stats([51.0, 52.0, 90.0]), "masked_steps": 0,
                    "events": 0},
        "busy_rank": 0,
        "busy_ms": 50.0,
    }  # fmt: skip
    rows = {r["measure"]: r for r in bench.rows_of(launch)}
    kb = rows["kill between → survivors' next dispatch + combine"]
    assert (kb["n"], kb["median_ms"], kb["p99_ms"], kb["rank0"]) == (2, 17.5, 30.0, 1)
    assert kb["target_ms"] == bench.TARGETS_MS["kill"] and kb["met"] is False
    ki = rows["kill inside → survivors' next dispatch + combine"]
    assert ki["met"] is True and ki["n"] == 1
    assert "kill inside: join_group() → first full step" not in rows  # no value: no row
    stop = rows["SIGSTOP → survivors' next step (hang limit 2000 ms)"]
    assert stop["met"] is True and stop["rank0"] == 1
    assert rows["SIGCONT → the stopped rank's op raises LeftOutError"]["median_ms"] == 3.0
    healthy = next(r for r in rows.values() if r["scenario"] == "healthy")
    assert healthy["masked"] == 0 and healthy["max_ms"] == 90.0


def test_no_gpu_is_an_error_unless_if_gpu(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda"]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err
    assert bench.main(["--device", "cuda", "--if-gpu"]) == 0
    assert "nothing to measure" in capsys.readouterr().out


def test_a_small_cpu_run(tmp_path, monkeypatch):
    """One kill between steps at world 3 on the CPU: the run passes its checks, and its
    table and JSON hold the kill's row; with the debug level, each survivor's log says
    how its heartbeat heard of the death (death_notices reads it)."""
    import death_notices

    monkeypatch.setenv("MOONCAKE_LOG_LEVEL", "debug")
    logs = tmp_path / "logs"
    logs.mkdir()
    argv = ["--device", "cpu", "--worlds", "3", "--timeouts-us", "-1", "--kill"]
    argv += ["--modes", "between", "--kills", "1", "--out-dir", str(tmp_path)]
    argv += ["--log-dir", str(logs)]
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "ep_failover.json").read_text())
    assert doc["problems"] == []
    (row,) = [r for r in doc["rows"] if r["measure"].startswith("kill between → survivors")]
    assert row["n"] == 1 and row["world"] == 3 and row["median_ms"] > 0
    # Each survivor's host was told of the death after it happened (the victim stamps
    # the time just before it kills itself).
    told = {r["measure"]: r for r in doc["rows"] if "host told it gone" in r["measure"]}
    assert set(told) == {f"kill between → the {w} survivor's host told it gone"
                         for w in ("first", "last")}  # fmt: skip
    assert all(r["n"] == 1 and r["median_ms"] > 0 for r in told.values())
    assert "kill between" in (tmp_path / "ep_failover_table.md").read_text()
    (launch,) = doc["launches"]
    (fault,) = launch["faults"]
    victim = fault["victim"]
    assert sorted(fault["host_told_ms"]) == sorted(str(r) for r in range(3) if r != victim)
    notices = []
    for path in logs.iterdir():
        notices += death_notices.parse(path.read_text(errors="replace").splitlines())
    (death,) = death_notices.deaths([n for n in notices if n.victim == victim])
    assert sorted(n.rank for n in death) == sorted(r for r in range(3) if r != victim)
    assert all(n.how and n.began_us <= n.ended_us <= n.seen_us for n in death)


def test_death_notices_groups_by_victim_and_time():
    import death_notices

    line = "[mooncake D pid {} 0.0] rank {} heartbeat: rank {} seen gone at {} us; the last wait "
    lines = [
        (line + "(on the life words) began at {} and ended at {}, woken").format(7, 0, 2, 1000, 10, 990),
        (line + "(on the life words) began at {} and ended at {}, timed out").format(8, 1, 2, 21000, 990, 20990),
        # the same process's second group: not a second notice
        (line + "(on the life words) began at {} and ended at {}, woken").format(8, 1, 2, 22000, 990, 21990),
        (line + "(on the pidfds) began at {} and ended at {}").format(7, 0, 2, 900000, 5, 899000),
        "unrelated",
    ]  # fmt: skip
    notices = death_notices.parse(lines)
    assert [n.how for n in notices] == ["woken", "timed out", "woken", ""]
    assert [n.pid for n in notices] == [7, 8, 8, 7]
    groups = death_notices.deaths(notices)
    assert [[n.rank for n in g] for g in groups] == [[0, 1], [0]]  # 900 ms later: another death
    assert "rank 1 +20.0 ms (timed out" in death_notices.describe(groups[0])
