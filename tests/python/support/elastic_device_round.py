"""Elastic EP rounds on the device path with masked slots, for compute-sanitizer.

    elastic_device_round.py

The ``contract`` scenario of test_ep_elastic_device.py, short: three processes in a
capacity-4 buffer (slot 3 never connects), a slot staged beside live traffic, a live peer
masked and published again, and a peer that skips a round, masked by the kernels'
deadline; every round checked against the routing model. Exits non-zero on any failed
expectation. scripts/gpu_check.sh runs it under memcheck and racecheck (compute-sanitizer
follows the slots' processes, its children).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from elastic_parent import SEED, Timeline, device_problems, report  # noqa: E402

#: The deadlines are generous: kernels run many times slower under the sanitizer.
CONTRACT = {"capacity": 4, "rounds": 1, "timeout_ms": 15000, "seed": SEED, "device": "cuda"}


def main() -> int:
    tl = Timeline("contract", CONTRACT, [0, 1], timeout_s=600).run()
    problems = device_problems(tl)
    print("elastic_device_round:", "ok" if not problems else report(problems, tl))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
