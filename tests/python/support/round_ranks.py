"""The parent side of a round script run under compute-sanitizer (cuda_backend_round.py,
mapped_round.py): it hosts the group's store and starts each rank as a child process of
the script itself (compute-sanitizer follows children), with ``--world``, ``--rank`` and
``--port``; a rank still running at the deadline is killed with the others."""

from __future__ import annotations

import subprocess
import sys

import torch.distributed as dist


def run_round(script: str, name: str, world: int, timeout_s: float) -> int:
    """Runs ``script``'s ranks; prints ``name: ok`` or the ranks' exits; 0 when all passed."""
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                script,
                "--world",
                str(world),
                "--rank",
                str(r),
                "--port",
                str(store.port),
            ]
        )  # fmt: skip
        for r in range(world)
    ]
    codes = []
    for proc in ranks:
        try:
            codes.append(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            codes.append("timeout")
    ok = all(c == 0 for c in codes)
    print(f"{name}:", "ok" if ok else f"rank exits {codes}")
    return 0 if ok else 1
