"""The harness's statistics and tables: the numbers the programs print rest on them."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

TEN = [7.0, 3.0, 10.0, 1.0, 5.0, 9.0, 2.0, 8.0, 4.0, 6.0]  # 1 .. 10, shuffled


def test_percentile_methods():
    # nearest rank: at least q% at or below; above: more than q%; linear: interpolated
    assert harness.percentile(TEN, 90) == 9.0
    assert harness.percentile(TEN, 99) == 10.0  # fewer than 100 values: p99 is the maximum
    assert harness.percentile(TEN, 90, "above") == 10.0
    nine = sorted(TEN)[:9]  # 0.9 x 9 is no whole rank: the two agree
    assert harness.percentile(nine, 90, "above") == harness.percentile(nine, 90) == 9.0
    assert harness.percentile(TEN, 90, "linear") == pytest.approx(9.1)
    assert harness.percentile([1.0, 2.0, 3.0, 4.0], 50, "linear") == 2.5
    assert harness.percentile([5.0], 10, "linear") == 5.0
    assert harness.percentile([], 50) is None
    with pytest.raises(ValueError):
        harness.percentile(TEN, 50, "mean")


def test_summarize_keeps_the_callers_keys_and_order():
    out = harness.summarize(TEN, {"n": "n", "med_ms": "median", "p90_ms": "p90"}, scale=1e3)
    assert list(out) == ["n", "med_ms", "p90_ms"]
    assert out == {"n": 10, "med_ms": 5500.0, "p90_ms": 9000.0}  # n is a count: not scaled
    up = harness.summarize(TEN, {"median": "p50", "mean": "mean"}, method="linear", digits=0)
    assert up == {"median": 6.0, "mean": 6.0}  # 5.5 rounds to even
    assert harness.summarize([], {"n": "n", "max": "max"}) == {"n": 0, "max": None}


def test_slowest_rank_per_loop_and_median_of_known_values():
    assert harness.slowest([[1, 5, 3], [2, 4], [0, 9, 9]]) == [2, 9]
    assert harness.median([None, 3.0, 1.0]) == 2.0
    assert harness.median([None]) is None
    assert harness.median([], empty=float("inf")) == float("inf")


def test_formats_and_markdown_table():
    assert [harness.fmt_bytes(n) for n in (8, 4096, 3 << 20, 1 << 30, 1536)] == [
        "8 B",
        "4 KiB",
        "3 MiB",
        "1 GiB",
        "1536 B",
    ]
    assert [harness.fmt_fixed(v, 100) for v in (99.94, 100.0, None, float("nan"))] == [
        "99.9",
        "100",
        "-",
        "-",
    ]
    assert harness.markdown_table(["a", "b", "c"], [["1", "2", ""]], "lr") == [
        "| a | b | c |",
        "|---|---:|---|",
        "| 1 | 2 |  |",
    ]


def test_quick_sets_some_options_and_caps_others():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--reps", type=int, default=5)
    args = harness.parse_args(p, ["--quick", "--reps", "2"], {"worlds": "4"}, {"reps": 3})
    assert (args.worlds, args.reps) == ("4", 2)
    args = harness.parse_args(p, [], {"worlds": "4"}, {"reps": 3})
    assert (args.worlds, args.reps) == ("2,4,8", 5)


def test_store_wait_returns_on_the_key_raises_on_abort_and_deadline():
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    threading.Timer(0.3, lambda: store.set("ready", "1")).start()
    harness.store_wait(store, "ready", 10, "abort")  # set later: returns then
    store.set("abort", "rank 2: RuntimeError: injected")
    t0 = time.monotonic()
    with pytest.raises(harness.Aborted, match="rank 2: RuntimeError: injected"):
        harness.store_wait(store, "never", 30, "abort")
    assert time.monotonic() - t0 < 5  # at once, not at the 30 s deadline
    with pytest.raises(TimeoutError, match="not set within"):
        harness.store_wait(store, "never", 0.3, "no-abort")
    # A barrier with an abort key ends on the abort as well.
    with pytest.raises(harness.Aborted):
        harness.store_barrier(store, "two", 2, timeout_s=30, abort_key="abort")


def test_parse_bytes_takes_binary_suffixes():
    got = [harness.parse_bytes(s) for s in ("8", "4K", "4KiB", "1M", "2g")]
    assert got == [8, 4096, 4096, 1 << 20, 2 << 30]
