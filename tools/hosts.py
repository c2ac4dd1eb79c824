"""Other hosts on this machine: network namespaces joined by a bridge, for the tests
(tests/python/test_hosts.py) and the benchmark across hosts (bench/bench_hosts.py).

Not part of the mooncake package: users do not need it. Both put this folder on
``sys.path`` (tests/python/conftest.py, bench/bench_hosts.py).

A test that needs several hosts runs inside a namespace of its own (``unshare -rn``: a
user namespace in which it may manage networks, and a network namespace that starts
empty), made by :func:`run_inside`. There :class:`Fabric` plays a switch: a bridge with
the address ``SUBNET.1`` (where the launcher hosts its store), and per host a network
namespace, held by a ``sleep`` process, with a veth pair whose far end is the host's
``eth0`` at ``SUBNET.<host + 2>``. A rank placed on a host (``mooncake.launch.LocalGroup``'s
``placement``) shares nothing with the other hosts but the wire: its host key differs
(another network namespace), so peers reach it over tcp; ranks on the same host use
shared memory. :meth:`Fabric.cut` takes a host's link down (a partition: the host loses
its peers and the store alike) and :meth:`Fabric.heal` brings it back.

Nothing leaves these namespaces: they disappear with the process that made them, links,
addresses and all.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import time

#: The project's test subnet, private to the namespaces.
SUBNET = "10.77.0"
#: Set in the process that :func:`run_inside` starts.
INSIDE_ENV = "MOONCAKE_TEST_HOSTS"


def inside() -> bool:
    """Whether this process runs inside the namespace of :func:`run_inside`."""
    return os.environ.get(INSIDE_ENV) == "1"


@functools.cache
def reason() -> str:
    """Why hosts cannot be made here ("" when they can)."""
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux, iproute2)"
    try:
        r = subprocess.run(
            ["unshare", "-rn", "ip", "link", "add", "mc-probe", "type", "bridge"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare -rn failed: {e}"
    if r.returncode != 0:
        return f"cannot make a user and network namespace here: {r.stderr.strip()[:200]}"
    return ""


def run_inside(args: list[str], timeout_s: float, env: dict[str, str] | None = None):
    """Runs ``python args...`` inside a new user and network namespace (with
    :data:`INSIDE_ENV` set); returns the ``subprocess.CompletedProcess``."""
    full_env = {**os.environ, **(env or {}), INSIDE_ENV: "1"}
    return subprocess.run(
        ["unshare", "-rn", "--fork", "--kill-child", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=full_env,
    )


def _ip(*args: str, netns_pid: int | None = None) -> None:
    cmd = (
        ["ip", *args] if netns_pid is None else ["nsenter", "-t", str(netns_pid), "-n", "ip", *args]
    )
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Fabric:
    """``hosts`` hosts behind one bridge (see the module docstring). Only inside the
    namespace of :func:`run_inside`."""

    def __init__(self, hosts: int):
        if not inside():
            raise RuntimeError("Fabric: only inside hosts.run_inside (it changes the network)")
        self.gateway = f"{SUBNET}.1"
        self._holders: list[subprocess.Popen] = []
        _ip("link", "set", "lo", "up")
        _ip("link", "add", "mc-br", "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", "mc-br")
        _ip("link", "set", "mc-br", "up")
        mine = os.readlink("/proc/self/ns/net")
        for h in range(hosts):
            holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
            self._holders.append(holder)
            deadline = time.monotonic() + 10
            while os.readlink(f"/proc/{holder.pid}/ns/net") == mine:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"host {h}: its namespace did not appear")
                time.sleep(0.01)
            pid = holder.pid
            _ip(
                "link",
                "add",
                self._link(h),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                str(pid),
            )
            _ip("link", "set", self._link(h), "master", "mc-br", "up")
            _ip("link", "set", "lo", "up", netns_pid=pid)
            _ip("addr", "add", f"{self.address(h)}/24", "dev", "eth0", netns_pid=pid)
            _ip("link", "set", "eth0", "up", netns_pid=pid)
        atexit.register(self.close)

    @staticmethod
    def _link(h: int) -> str:
        return f"mc-h{h}"

    @staticmethod
    def address(h: int) -> str:
        return f"{SUBNET}.{h + 2}"

    def netns(self, h: int) -> str:
        return f"/proc/{self._holders[h].pid}/ns/net"

    def placement(self, hosts_of_ranks) -> list[tuple[str, str]]:
        """``LocalGroup``'s ``placement`` for ranks on the given hosts."""
        return [(self.netns(h), self.address(h)) for h in hosts_of_ranks]

    def cut(self, h: int) -> None:
        """Takes host ``h``'s link down at the switch: it reaches nobody, nor the store."""
        _ip("link", "set", self._link(h), "down")

    def heal(self, h: int) -> None:
        _ip("link", "set", self._link(h), "up")

    def close(self) -> None:
        for holder in self._holders:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
        self._holders = []


_fabric: Fabric | None = None


def fabric(hosts: int = 4) -> Fabric:
    """This process's fabric of ``hosts`` hosts (made on first use)."""
    global _fabric
    if _fabric is None:
        _fabric = Fabric(hosts)
    return _fabric
