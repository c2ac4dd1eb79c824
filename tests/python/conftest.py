"""Session wiring for the multi-process tests.

* Items marked ``stress`` are deselected unless ``MOONCAKE_STRESS=1``
  (``make stress`` sets it), so ``make test`` stays short.
* After selection, the launcher learns which cases of each launch will run,
  so that ``-k`` on a few cases starts the ranks for just those.
* At the end, a summary lists each launch's wall time.
* With ``MOONCAKE_NO_SKIP=1`` (``make gpu-check`` sets it for its GPU steps) a test
  that skips fails instead: on the GPU machine a skip means the device was not tested.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The rank code and the helpers the tests share live in support/ (the test_*.py files
# here hold the tests alone); hosts.py (network namespaces as hosts) lives in tools/, as
# bench_hosts.py uses it too. Ranks started by multiprocessing inherit this path.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tools"))
sys.path.insert(0, str(HERE / "support"))

import pytest  # noqa: E402

import launcher  # noqa: E402


@pytest.fixture(scope="module")
def store():
    """A TCPStore served by the test process, for elastic buffers made in it (each test
    takes its own key prefix)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MOONCAKE_STRESS") == "1":
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("stress") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and os.environ.get("MOONCAKE_NO_SKIP") == "1"
        and not hasattr(report, "wasxfail")
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under MOONCAKE_NO_SKIP=1 (the GPU run must test it): {reason}"


def pytest_collection_finish(session):
    launcher.note_selected(session.items)


def pytest_terminal_summary(terminalreporter):
    runs = launcher.results()
    if not runs:
        return
    terminalreporter.section("mooncake launches")
    for launch, result in runs.items():
        records = result.ranks[0].records if result.ranks else []
        n_cases = sum(1 for r in records if r["event"] == "end")
        slowest = max(
            (r for r in records if r["event"] == "end"), key=lambda r: r["seconds"], default=None
        )
        line = (
            f"{launch.builder.__module__ + ':' + launch.label:<38} world {launch.world_size}  "
            f"{n_cases:>5} cases  "
            f"{result.seconds:6.1f} s"
        )
        if slowest:
            line += f"  (slowest on rank 0: {slowest['case']} {slowest['seconds']:.2f} s)"
        terminalreporter.write_line(line + ("  LAUNCH ERROR" if result.error else ""))
