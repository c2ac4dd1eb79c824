"""bench_elastic_buffer: its checks catch wrong results, its rows merge the slowest
process per call, it reads upstream's JSON, what it does without a GPU, and one small
run on the CPU (the program end to end: launch, checks, tables, JSON)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from nogpu import main_without_gpu  # noqa: E402

import bench_elastic_buffer as bench  # noqa: E402

CFG = {"seed": 5, "H": 256, "K": 3, "E": 8}
CPU = torch.device("cpu")


def received(rt, T, k=0, fp8=False):
    """What rank ``me`` should receive, put together from the sources' inputs in the
    model's order (rows, weights); and the source function the checks take."""

    def source(s):
        x, _, w = bench.inputs(CFG, k, s, T, CPU)
        return bench.as_sent(x, fp8), w

    parts = [(source(s), rt.from_source(s)) for s in range(len(rt.per_source))]
    if fp8:
        rows = tuple(torch.cat([x[i][ts] for (x, _), ts in parts]) for i in (0, 1))
    else:
        rows = torch.cat([x[ts] for (x, _), ts in parts])
    weights = torch.cat([w[ts] for (_, w), ts in parts])
    return rows, weights, source


def routing(T, R, me):
    idx = [bench.routing_of(CFG, 0, s, T)[0].tolist() for s in range(R)]
    return bench.Routing(idx, R, CFG["E"], me), idx


def test_routing_counts_what_each_rank_sends_and_receives():
    T, R = 12, 4
    for me in range(R):
        rt, idx = routing(T, R, me)
        epr = CFG["E"] // R
        ranks = [{e // epr for e in row} for row in idx[me]]
        assert rt.fanout == [len(r) for r in ranks]
        assert rt.sent == [sum(d in r for r in ranks) for d in range(R)]
        assert sum(rt.per_source) == len(rt.tokens) == rt.psum[-1]
        assert sum(rt.counts) == sum(j >= 0 for row in rt.local for j in row)


@pytest.mark.parametrize("fp8", [False, True])
def test_checks_pass_the_right_rows_and_catch_wrong_ones(fp8):
    T, R = 10, 2
    rt, _ = routing(T, R, 1)
    rows, weights, source = received(rt, T, fp8=fp8)
    assert bench.check_rows(rows, rt, source, weights) == []

    def swapped(t):  # two rows from different sources exchanged
        t = t.clone()
        n = rt.per_source[0]
        t[[0, n]] = t[[n, 0]]
        return t

    bad = (swapped(rows[0]), rows[1]) if fp8 else swapped(rows)
    assert bench.check_rows(bad, rt, source, weights)
    assert bench.check_rows(rows, rt, source, swapped(weights))
    short = (rows[0][1:], rows[1][1:]) if fp8 else rows[1:]
    assert bench.check_rows(short, rt, source, weights[1:])
    other, _, _ = received(rt, T, k=1, fp8=fp8)  # another input set's rows
    assert bench.check_rows(other, rt, source)


def test_combine_check_wants_each_row_times_its_ranks():
    T, R = 10, 4
    rt, _ = routing(T, R, 2)
    x, _, _ = bench.inputs(CFG, 0, 2, T, CPU)
    n = torch.tensor(rt.fanout, dtype=torch.float32).unsqueeze(1)
    right = (x.float() * n).to(torch.bfloat16)
    assert bench.check_combine(right, x, rt) == []
    assert bench.check_combine(x, x, rt)  # each token once: wrong where it reaches 2+ ranks
    q = bench.as_sent(x, True)
    assert bench.check_combine((bench.as_bf16(q).float() * n).to(torch.bfloat16), q, rt) == []


def test_merge_takes_the_slowest_process_per_call_and_the_largest_sizes():
    r0 = {"cases": [{"T": 8, "fp8": False, "dispatch_us": [10.0, 50.0, 30.0], "memory_bytes": 5,
                     "path": "portable"}], "problems": []}  # fmt: skip
    r1 = {"cases": [{"T": 8, "fp8": False, "dispatch_us": [20.0, 40.0, 10.0], "memory_bytes": 7,
                     "path": "portable"}], "problems": ["T=8 BF16 combine: wrong"]}  # fmt: skip
    rows, problems = bench.merge([r0, r1])
    assert rows[0]["dispatch_us"]["calls"] == [20.0, 50.0, 30.0]
    assert rows[0]["dispatch_us"]["median"] == 30.0
    assert rows[0]["memory_bytes"] == 7 and rows[0]["fp8"] is False
    assert problems == ["rank 1: T=8 BF16 combine: wrong"]


def test_upstream_json_fills_world_1_only(tmp_path):
    path = tmp_path / "up.json"
    case = {"T": 8, "fp8": True, "dispatch_us": {"median": 123.4}, "combine_us": {"median": 56.7},
            "check_dispatch": "ok", "check_combine": "ok"}  # fmt: skip
    path.write_text(json.dumps({"cases": [case]}))
    up = bench.upstream_cases(str(path))
    row = {"T": 8, "fp8": True, "path": "portable", "dispatch_bytes": 1, "combine_bytes": 1,
           "memory_bytes": 1}  # fmt: skip
    cfg = {"H": 256, "K": 3, "E": 8, "device": "cuda"}
    table = "\n".join(bench.tables(1, cfg, [row], up))
    assert "| 123 |" in table and "| 56.7 |" in table
    assert "123" not in "\n".join(bench.tables(2, cfg, [row], up))
    path.write_text(json.dumps({"cases": [], "error": "import upstream mooncake: boom"}))
    assert "boom" in "\n".join(bench.tables(1, cfg, [row], bench.upstream_cases(str(path))))


def test_cuda_without_a_gpu_fails_unless_if_gpu(tmp_path):
    args = ["--device", "cuda", "--out-dir", str(tmp_path)]
    assert main_without_gpu(bench, args) == 1
    assert main_without_gpu(bench, [*args, "--if-gpu"]) == 0


def test_upstream_script_leaves_its_reason_in_the_json(tmp_path):
    """Without upstream's wheel first on the path (or without a GPU) the upstream column's
    program exits 1 and its JSON says why nothing was measured."""
    out = tmp_path / "up.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_ep_upstream_elastic.py"), "--out", str(out),
         "--deadline-s", "120"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["cases"] == [] and data["error"], data
    assert "error" in bench.upstream_cases(str(out))


def test_quick_cpu_run_checks_every_case(tmp_path):
    """Worlds 1 and 2, two T, BF16 and FP8: every case checked against the model, the
    Buffer beside it, the cached row, and the JSON."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_elastic_buffer.py"), "--device", "cpu", "--quick",
         "--worlds", "1,2", "--iters", "2", "--warmup", "1", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("checks: every result matched the routing model (4 cases)") == 2, out
    data = json.loads((tmp_path / "elastic_buffer.json").read_text())
    for world in ("1", "2"):
        rows = data["worlds"][world]["cases"]
        assert [(r["T"], r["fp8"]) for r in rows] == [(64, False), (64, True), (128, False),
                                                      (128, True)]  # fmt: skip
        for r in rows:
            for key in ("dispatch_us", "combine_us", "dispatch_floor_us", "buffer_dispatch_us"):
                assert r[key]["n"] == 2 and r[key]["median"] > 0, (world, key, r[key])
        assert "cached_dispatch_us" in rows[0] and "cached_dispatch_us" not in rows[2]
    assert (tmp_path / "elastic_buffer_table.md").read_text().startswith("world 1, cpu")
