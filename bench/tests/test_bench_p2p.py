"""bench_p2p runs end to end on a small setting and records a point for every pattern,
size and backend (its figures are the benchmark's, not checked here)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_p2p  # noqa: E402


def test_a_small_run_records_every_point(tmp_path, capsys):
    out = tmp_path / "p2p.json"
    args = ["--sizes", "8,4K", "--repeats", "1", "--point-s", "0.01", "--out", str(out)]
    assert bench_p2p.main(args) == 0
    got = json.loads(out.read_text())
    assert got["world"] == 2
    for backend in bench_p2p.BACKENDS:
        points = {(p["bytes"], p["pattern"]) for p in got["points"][backend]}
        assert points == {(n, q) for n in (8, 4096) for q in bench_p2p.PATTERNS}, backend
        assert all(p["us"] > 0 for p in got["points"][backend])
    table = capsys.readouterr().out
    assert "| 4 KiB | ring |" in table and "mooncake-cpu / gloo" in table
