"""ElasticBuffer device-path rounds, short, for compute-sanitizer.

    ht_device_round.py [world [deadline_s]] [--wrap]

``world`` processes (default 2) on this GPU run a few verified rounds of the device path
(``ht_device.DeviceRound``: checked against ``ht_model`` bit for bit): BF16 tokens with a
cached dispatch, pre-quantised FP8 expanded with an alignment and no CPU sync, and a
single-reduction combine; so every kernel of ``src/kernels/ep_ht`` (layout, dispatch with
its rings, combine's replies and sums) runs; ``--wrap`` adds 4,096 tokens on small rings,
which wrap. ``deadline_s`` (600) bounds the kernels' and the group's waits. Exits non-zero
on any failed expectation.
scripts/gpu_check.sh runs it under memcheck and racecheck (compute-sanitizer follows the
ranks, its children).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from ht_device import sanitizer_rank
    from mooncake.launch import run_local

    wrap = "--wrap" in sys.argv
    args = [int(a) for a in sys.argv[1:] if a != "--wrap"]
    world = args[0] if args else 2
    deadline_s = args[1] if len(args) > 1 else 600
    # Room for the rounds' checks on the host besides the kernels' deadlines (120 s for
    # the smoke's 20, inside its 150 s bound, with room to start and end).
    timeout_s = 2 * deadline_s + 80
    results = run_local(sanitizer_rank, world, args=(deadline_s, wrap), timeout_s=timeout_s)
    problems = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    print("ht_device_round:", "ok" if not problems else "\n".join(problems[:20]))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
