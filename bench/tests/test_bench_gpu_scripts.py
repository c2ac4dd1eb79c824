"""The GPU benchmarks' host-side logic, which CPU machines otherwise never run: what
fails a run of bench_pg_cuda, its bus-bandwidth factors, how bench_ep_device merges
processes whose cases differ, and what each says without a GPU."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from nogpu import main_without_gpu  # noqa: E402

import bench_ep_device  # noqa: E402
import bench_pg_cuda  # noqa: E402


def test_bus_factors_are_nccl_tests():
    f = bench_pg_cuda.bus_factor
    assert f("all_reduce", 4) == 1.5 and f("all_reduce_graph", 2) == 1.0
    assert f("broadcast", 4) == 1.0 and f("reduce", 4) == 1.0 and f("gather", 4) == 0.75
    assert f("scatter", 2) == 0.5 and f("reduce_scatter_tensor", 4) == 0.75
    assert f("all_gather_into_tensor", 4) == 0.75 and f("reduce_scatter", 2) == 0.5
    assert f("all_to_all_single", 1) == 1.0


def test_pg_cuda_problems():
    ok = {"op": "all_reduce", "bytes": 8, "us": 10.0, "error": []}
    refused = {"op": "all_reduce_graph", "bytes": 8, "us": None, "error": ["ValueError: x"]}
    results = {
        "mooncake/w1": {"rows": [ok]},
        "staged/w1": {"rows": [ok, refused]},  # the staged column may refuse capture
        "gloo/w1": {"rows": [ok]},
    }
    assert bench_pg_cuda.problems_of(results) == []
    results["mooncake/w2"] = {"rows": [ok, refused]}
    results["nccl/w1"] = {"rows": [], "failed": "RuntimeError: ...\nprocesses ['0'] hung"}
    results["gloo/w2"] = {"rows": []}
    got = bench_pg_cuda.problems_of(results)
    assert len(got) == 3, got
    assert "mooncake/w2: all_reduce_graph 8 B: ValueError: x" in got
    assert any(p.startswith("nccl/w1: the launch failed: processes") for p in got)
    assert "gloo/w2: nothing measured" in got


def test_ep_device_summary_takes_the_slowest_and_survives_missing_keys():
    r0 = [{"E": 256, "fp8": True, "dispatch_us": [1.0, 3.0, 2.0], "dispatch_kernel_us": [1.0]}]
    r1 = [{"E": 256, "fp8": True, "dispatch_us": [4.0, 4.0, 4.0], "graph_error": "no"}]
    (row,) = bench_ep_device.summarize([r0, r1])
    assert row["E"] == 256 and row["fp8"] is True
    assert row["dispatch_us"] == 4.0
    # One process lacks the key (its capture failed): no time (None: JSON has no NaN).
    assert row["dispatch_kernel_us"] is None


@pytest.mark.parametrize("bench", [bench_pg_cuda, bench_ep_device])
def test_without_a_gpu_they_fail_unless_if_gpu(bench, tmp_path):
    assert main_without_gpu(bench, ["--worlds", "1", "--out-dir", str(tmp_path)]) == 1
    assert main_without_gpu(bench, ["--worlds", "1", "--if-gpu", "--out-dir", str(tmp_path)]) == 0


def test_elastic_buffer_profile_without_a_gpu(tmp_path):
    import profile_elastic_buffer

    out = tmp_path / "p.json"
    assert main_without_gpu(profile_elastic_buffer, ["--out", str(out)]) == 1
    assert main_without_gpu(profile_elastic_buffer, ["--if-gpu", "--out", str(out)]) == 0
    assert not out.exists()  # nothing measured, nothing written
    with pytest.raises(SystemExit):  # argparse's usage error, before any GPU is looked for
        profile_elastic_buffer.main(["--num-sms", "-1", "--if-gpu"])


def test_elastic_buffer_stamps_summary():
    import profile_elastic_buffer

    # Two processes, 4 blocks each (2 senders, 2 receivers), one call: rank 1 started
    # 5 us after rank 0; rank 0's receivers waited until 30 us.
    r0 = [[1000, 11000, 1000, 12000, 1000, 30000, 1000, 29000]]
    r1 = [[6000, 16000, 6000, 17000, 6000, 20000, 6000, 21000]]
    ranks = [{"T=8": {"stamps: combine": r0}}, {"T=8": {"stamps: combine": r1}}]
    (row,) = profile_elastic_buffer.stamps_summary(ranks)["T=8 combine"]
    assert row["start skew us"] == 5.0
    assert row["senders done us"] == [11.0, 16.0]
    assert row["receivers done us"] == [29.0, 20.0]
    assert row["block us (median)"] == [19.5, 12.5]


def test_elastic_bench_on_cuda_without_a_gpu(tmp_path):
    import bench_elastic

    args = ["--device", "cuda", "--quick", "--out-dir", str(tmp_path)]
    assert main_without_gpu(bench_elastic, args) == 1
    assert main_without_gpu(bench_elastic, [*args, "--if-gpu"]) == 0
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written
