"""When each survivor's host heard of each death, and how, from a failover run's logs.

A run of ``bench_ep_failover.py`` (or any group) with ``MOONCAKE_LOG_LEVEL=debug`` and
``--log-dir DIR`` leaves one log per process. Each process's heartbeat thread writes a
line when it finds a peer gone: when (the steady clock, µs), and how its last wait
ended (woken by the dead peer's life word, timed out after its round, a word that
changed before it slept). This groups those lines by death (one victim, within
200 ms) and prints, for each death whose last notice came more than ``--late-ms`` after
the first, every survivor's lag and its wait: a survivor ``woken`` late was not run in
time (its CPU); one that ``timed out`` missed the wake.

    python bench/death_notices.py DIR/*.log            # the late deaths, and a count
    python bench/death_notices.py --late-ms 0 DIR/*.log  # every death
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

_LINE = re.compile(
    r"(?:pid (\d+) [^\]]*\] )?rank (\d+) heartbeat: rank (\d+) seen gone at (\d+) us; the last "
    r"wait \(([^)]*)\) began at (\d+) and ended at (\d+)(?:, (.*))?$"
)
#: notices of one victim this close together are one death
GROUP_US = 200_000


@dataclass(frozen=True)
class Notice:
    seen_us: int  # when this process's heartbeat found the victim gone
    rank: int  # this process's rank
    victim: int
    began_us: int  # its last wait before that
    ended_us: int
    how: str  # how that wait ended ("" on the pidfd path)
    pid: int = 0  # the process (0: not in the line)


def parse(lines) -> list[Notice]:
    out = []
    for line in lines:
        m = _LINE.search(line.rstrip("\n"))
        if m:
            pid, rank, victim, seen, _on, began, ended, how = m.groups()
            out.append(
                Notice(
                    int(seen),
                    int(rank),
                    int(victim),
                    int(began),
                    int(ended),
                    how or "",
                    int(pid or 0),
                )
            )
    return out


def deaths(notices: list[Notice]) -> list[list[Notice]]:
    """The notices grouped by death, each group in the order they came, a process's
    first notice only (a process with several groups has a heartbeat thread for each,
    and each tells)."""
    groups: list[list[Notice]] = []
    for n in sorted(notices, key=lambda n: n.seen_us):
        for g in reversed(groups):
            if g[0].victim == n.victim and n.seen_us - g[0].seen_us <= GROUP_US:
                if all((m.pid, m.rank) != (n.pid, n.rank) for m in g):
                    g.append(n)
                break
        else:
            groups.append([n])
    return groups


def describe(group: list[Notice]) -> str:
    t0 = group[0].seen_us
    parts = [
        f"rank {n.rank} +{(n.seen_us - t0) / 1e3:.1f} ms ({n.how or 'pidfd'}, its wait "
        f"{(n.ended_us - n.began_us) / 1e3:.1f} ms from {(n.began_us - t0) / 1e3:+.1f})"
        for n in group
    ]
    return f"rank {group[0].victim} gone: " + "; ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--late-ms", type=float, default=3.0)
    a = p.parse_args(argv)
    notices = []
    for path in a.logs:
        with open(path, errors="replace") as f:
            notices += parse(f)
    groups = deaths(notices)
    late = [g for g in groups if (g[-1].seen_us - g[0].seen_us) / 1e3 > a.late_ms]
    for g in late:
        print(describe(g))
    print(
        f"{len(groups)} deaths, {len(late)} with a notice more than {a.late_ms} ms after the first"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
