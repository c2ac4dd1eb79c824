"""``python -m mooncake doctor`` says what this installation can do here.

On this machine (Linux, a CPU build) the extension loads, memfd segments map through
/proc, the process's life page is held by a live thread (the page a peer's GPU kernels
read to see it die), loopback tcp works, and every registered variable is listed. A
check that fails prints ``[--]`` with the reason, and the command still lists the rest.

CPU only, a few seconds (one subprocess importing torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mooncake import pg

REPO = Path(__file__).resolve().parents[2]


def run_python(*args: str) -> subprocess.CompletedProcess:
    """This Python on ``args``, with this checkout's package."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_doctor_reports_the_checks_and_every_variable():
    res = run_python("-m", "mooncake", "doctor")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for check in ("extension loads", "shm transport", "life page", "tcp transport"):
        assert f"[ok]   {check}" in out, f"{check!r} not ok:\n{out}"
    for name, _default, _doc in pg._ext.env_registry():
        assert f"    {name} = " in out, f"{name} not listed"


def test_the_life_page_is_held_by_a_live_thread():
    # In a process of its own: the page's thread lives as long as the process.
    code = (
        "import os, json; from mooncake import pg; a = pg._ext.life_page(); "
        "b = pg._ext.life_page(); "
        'print(json.dumps([a, b, os.getpid(), os.path.exists(f\'/proc/{a["pid"]}/fd/{a["fd"]}\'), '
        "sorted(open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task'))]))"
    )
    res = run_python("-c", code)
    assert res.returncode == 0, res.stderr
    a, b, pid, exists, threads = json.loads(res.stdout.strip().splitlines()[-1])
    assert a["pid"] == pid and a["held"] is True and exists
    assert b == a, "a second call made another page"
    assert threads.count("mc-life") == 1, threads
