"""The parent side of a round script run under compute-sanitizer (cuda_backend_round.py,
mapped_round.py): it hosts the group's store and starts each rank as a child process of
the script itself (compute-sanitizer follows children), with ``--world``, ``--rank`` and
``--port``; a rank still running at the deadline is killed with the others."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable

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


def round_main(script: str, doc: str, name: str, rank_main: Callable[[int, int, int], int],
               timeout_s: float) -> int:  # fmt: skip
    """A round script's main: ``--world N`` runs the round (the parent), and the children it
    starts (``--rank``, ``--port``) run ``rank_main(rank, world, port)``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank is not None:
        return rank_main(a.rank, a.world, a.port)
    return run_round(script, name, a.world, timeout_s)
