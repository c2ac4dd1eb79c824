"""bench_pg's paired measurements: the verdicts on the world-8 row and on the large ops
take each ratio within a pair measured together, then the median over pairs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_pg  # noqa: E402
import floors  # noqa: E402
import report  # noqa: E402


def _round(small_loops, direct_loops, bare, hop=3.0):
    return {"small": small_loops, "direct": direct_loops, "bare": bare, "hop_us": hop}


def test_merge_pairs_takes_the_slowest_rank_then_the_fastest_loop_and_drops_failed_rounds():
    rank0 = [
        _round({"8": [10, 20], "4096": [30, 31]}, [5, 9], 4.0),
        _round({"8": [1, 1], "4096": [1, 1]}, [1, 1], None),
    ]
    rank1 = [
        _round({"8": [12, 11], "4096": [29, 40]}, [6, 3], 4.0),
        _round({"8": [1, 1], "4096": [1, 1]}, [1, 1], None),
    ]
    assert bench_pg.merge_pairs([rank0, rank1]) == [
        {
            "torch_us": 12,
            "backend_object_us": 6,
            "bare_us": 4.0,
            "hop_us": 3.0,
            "small_us": {8: 12, 4096: 30},
        }
    ]


def _model(torch_layer=None):
    copy = [floors.CopyBandwidth(1 << 20, 10.0, 20.0, 2)]
    return floors.FloorModel(cores=2, copy=copy, handoff={}, small_bytes=65536)


def test_paired_point_is_the_median_of_the_ratios_within_rounds():
    # The bare core drifts with the through-torch time: within a round the ratio is 2,
    # while the ratio of the medians (30 / 10) would say 3.
    rounds = [
        {"torch_us": 20.0, "backend_object_us": 12.0, "bare_us": 10.0},
        {"torch_us": 30.0, "backend_object_us": 18.0, "bare_us": 15.0},
        {"torch_us": 40.0, "backend_object_us": 24.0, "bare_us": 20.0},
        {"torch_us": 30.0, "backend_object_us": 30.0, "bare_us": 5.0},
        {"torch_us": 50.0, "backend_object_us": 30.0, "bare_us": 8.0},
    ]
    p = bench_pg.paired_point(8, rounds, sweep_layer=None)
    assert p["ratio"] == pytest.approx(2.0)
    assert p["backend_object_ratio"] == pytest.approx(1.2)
    assert p["torch_us"] == 30.0 and p["bare_us"] == 10.0
    assert p["torch_layer_us"] == pytest.approx(12.0)  # median of 8, 12, 16, 0, 20
    assert p["do_nothing_ratio"] is None  # no hand-off floor to bound it


def test_paired_point_do_nothing_backend_is_the_lower_of_the_floor_and_the_bare_core_plus_layer():
    # torch's layer 40; the round's floor (30) is under the bare core (50)
    rounds = [{"torch_us": 100.0, "backend_object_us": 60.0, "bare_us": 50.0, "floor_us": 30.0}]
    p = bench_pg.paired_point(8, rounds, sweep_layer=None)
    assert p["do_nothing_us"] == pytest.approx(70.0)
    assert p["do_nothing_ratio"] == pytest.approx(1.4)
    # without the backend object, the sweep's layer stands in; the bare core is lower
    alone = [{"torch_us": 100.0, "backend_object_us": None, "bare_us": 50.0, "floor_us": 80.0}]
    q = bench_pg.paired_point(8, alone, sweep_layer=10.0)
    assert q["do_nothing_us"] == pytest.approx(60.0)
    assert q["backend_object_ratio"] is None


def test_small_sizes_are_judged_against_the_ring_and_torch_layer_of_their_round():
    model = _model()
    model.handoff[4] = floors.HandOff(4, 10.0, 11.0, 1.0, [11.0])
    # world 4 on 2 cores: one round of messages, 2 ranks per core: hand-off = 2 x hop
    rounds = [
        {"torch_us": 40.0, "backend_object_us": 30.0, "hop_us": 10.0, "small_us": {8: 40.0}},
        {"torch_us": 90.0, "backend_object_us": 50.0, "hop_us": 30.0, "small_us": {8: 90.0}},
        {"torch_us": 60.0, "backend_object_us": 40.0, "hop_us": 15.0, "small_us": {8: 60.0}},
        {"torch_us": 1.0, "backend_object_us": 1.0, "hop_us": None, "small_us": {8: 1.0}},
    ]
    out = bench_pg.small_against_floors(model, 4, rounds)
    assert out[8]["vs_handoff"] == pytest.approx(2.0)  # 40/20, 90/60, 60/30
    assert out[8]["vs_torch_floor"] == pytest.approx(1.2)  # 40/30, 90/100, 60/50
    assert out[8]["do_nothing_vs_handoff"] == pytest.approx(5 / 3)  # 30/20, 100/60, 50/30
    assert bench_pg.small_against_floors(model, 4, rounds[3:]) == {}


def test_copy_beside_ratio_pairs_each_loop_with_the_copy_after_it():
    point = {"loops_us": [10.0, 30.0, 12.0], "copy_beside_us": [10.0, 10.0, 6.0]}
    assert report.over_copy_beside(point) == pytest.approx(2.0)  # median of 1, 3, 2
    assert report.over_copy_beside({"loops_us": [1.0]}) is None


def test_copy_shares_cover_the_large_target_points_with_half_their_traffic():
    model = _model()
    ops = ["all_reduce", "broadcast", "all_to_all_single"]
    shares = bench_pg.copy_shares(model, 4, ops, [4096, 16 << 20])
    assert sorted(shares) == ["all_reduce/16777216", "all_to_all_single/16777216"]
    s = (16 << 20) / 4
    # all_reduce: reduce 4 shards into one (5 s), copy in 3 reduced shards (6 s): 11 s / 2
    assert shares["all_reduce/16777216"] == [11 * s / 2] * 4
    assert shares["all_to_all_single/16777216"] == [float(16 << 20)] * 4


def _large_row(time_us, copy_us, beside=None):
    mc = {"time_us": time_us, "loops_us": [time_us]}
    if beside is not None:
        mc["copy_beside_us"] = [beside]
    return {
        "op": "all_reduce",
        "world": 4,
        "bytes": 16 << 20,
        report.MOONCAKE: mc,
        "floor": {"copy_us": copy_us},
        "ratios": {"mooncake_over_copy_beside": report.over_copy_beside(mc)},
    }


def _verdict(name, selected, value, limit, better):
    worst = max(value(r) for r in selected)
    return {"target": name, "met": worst <= limit, "worst": worst, "at_bytes": 16 << 20}


def test_large_verdict_judges_on_the_copy_beside_and_names_the_model_ratio():
    out = report.large_verdict(_verdict, [_large_row(110.0, 50.0, beside=100.0)], "all_reduce")
    assert out["met"] and out["worst"] == pytest.approx(1.1)
    assert "copied beside" in out["target"] and "2.20" in out["note"]
    plain = report.large_verdict(_verdict, [_large_row(110.0, 50.0)], "all_reduce")
    assert not plain["met"] and plain["worst"] == pytest.approx(2.2)
