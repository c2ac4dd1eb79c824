"""A local launcher: hosts the rendezvous store in this process (as torchrun
does, so no rank is special) and runs ``fn(rank, world_size, store_port,
*args)`` in new processes, one per rank.

Ranks are forked from a server process that has imported torch once
(multiprocessing's ``forkserver``), so a rank starts in ~15 ms instead of
the ~1.2 s a fresh interpreter spends importing torch (8 ranks on 2 cores:
0.1 s instead of 8 s; the server's own import, once, is 1.2 s).
Each rank still gets this process's environment as it is when the rank starts
(plus ``env``), and its ``OMP_NUM_THREADS`` as torch's thread count. Pass
``start_method="spawn"`` for fresh interpreters.

Used by ``python -m mooncake demo``, the tests and the benchmarks; handy for
experiments::

    from mooncake.launch import run_local
    results = run_local(my_fn, world_size=4)

:class:`LocalGroup` also kills ranks and starts replacements, to try out
fault tolerance::

    with LocalGroup(world_size=4) as group:
        group.start(member_fn)
        group.kill(2)
        group.start(joiner_fn, ranks=[2])
        results = group.results()
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

#: Where the ranks of this process's launch reach its store (set in each rank by
#: :class:`LocalGroup`: a rank placed in another network namespace reaches it over
#: the namespaces' bridge).
_store_host = "127.0.0.1"


def store_host() -> str:
    """The address of the launch's store, as this rank reaches it."""
    return _store_host


def enter_netns(path: str) -> None:
    """Moves this process (its calling thread, and every thread it starts after) into
    the network namespace at ``path`` (``/proc/<pid>/ns/net``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def init_rank(
    rank: int,
    world_size: int,
    port: int,
    backend: str = "mooncake-cpu",
    *,
    max_world_size: int | None = None,
    is_extension: bool = False,
    timeout_s: float | None = None,
    **kwargs,
):
    """Joins the group hosted by :func:`run_local` or :class:`LocalGroup` (call inside a rank).

    For mooncake backends, returns the ``active_ranks`` tensor the backend
    keeps up to date (``[max_world_size or world_size]`` int32, on the rank's
    GPU for ``mooncake`` when there is one); a process
    started with ``is_extension=True`` then calls ``pg.join_group()``.
    """
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(
        store_host(), port, world_size, is_master=False, timeout=timedelta(seconds=60)
    )
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    active = None
    if backend.startswith("mooncake"):
        from mooncake import pg

        device = "cpu"
        if backend == "mooncake" and torch.cuda.is_available():
            # One GPU per rank where there are enough; several ranks share one otherwise.
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = "cuda"
        active = torch.ones(max_world_size or world_size, dtype=torch.int32, device=device)
        kwargs.setdefault(
            "pg_options", pg.MooncakeBackendOptions(active, is_extension, max_world_size)
        )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
    return active


def _entry(fn, key, rank, world_size, port, args, env, log_dir, queue, place):
    global _store_host
    if place is not None:  # another "host": its own network namespace
        netns, host_ip, _store_host = place
        enter_netns(netns)
        env = {**env, "MOONCAKE_HOST_IP": host_ip}
    # The whole environment (the launcher's, with the group's changes): a forked rank
    # starts with the fork server's.
    os.environ.clear()
    os.environ.update({name: value for name, value in env.items() if value is not None})
    _apply_thread_count()
    if log_dir is not None:
        # At the descriptor level, so that what the C++ core prints goes there too.
        fd = os.open(os.path.join(log_dir, f"{key}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        # Pickled here, by value: a tensor in the result would otherwise travel as a
        # shared-memory handle that dies with this process.
        queue.put((key, True, pickle.dumps(fn(rank, world_size, port, *args))))
    except SystemExit as e:  # fn chose its exit code: keep it
        queue.put((key, False, f"exited with code {e.code}"))
        raise
    except BaseException:  # noqa: BLE001  (reported to the parent)
        text = traceback.format_exc()
        queue.put((key, False, text))
        try:  # in the rank's output too: the parent may give up on a peer first
            print(f"[rank process {key}] {text}", file=sys.stderr, flush=True)
        except OSError:
            pass  # no output to write to


def _apply_thread_count() -> None:
    """OpenMP reads ``OMP_NUM_THREADS`` when torch is imported, which in a rank forked
    from the fork server was before this rank's environment was set: apply it now."""
    import sys

    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


#: What the forkserver imports before it forks ranks: what every rank imports first, so
#: that the server imports it once. A process has one server, started by its first
#: ``LocalGroup``: extend the list before that to preload more (e.g. ``"torch._dynamo"``,
#: which DDP and the functional collectives import, about 3 s a process).
FORKSERVER_PRELOAD = ["torch", "torch.distributed"]


def _context(start_method: str):
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(
            f"LocalGroup: start_method must be 'forkserver' or 'spawn', not {start_method!r}"
        )
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def process_resources() -> dict[str, int]:
    """This process's open fds, threads and resident memory (KiB), from /proc: what a
    long run of failures and replacements must not grow."""
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "rss_kib": rss,
    }


def _pidfd(pid: int) -> int | None:
    """A file descriptor that names process ``pid`` for signals (None where the
    kernel has no pidfd_open, or the process is gone already)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class LocalGroup:
    """Processes on this host that form one group, with the store hosted here.

    Each started process runs ``fn(rank, world_size, port, *args)`` and is
    known by a key: ``"3"`` for the first process of rank 3, ``"3.1"``,
    ``"3.2"`` for the ones started for it later (replacements).

    Args:
        world_size: the group's world size.
        env: environment variables set in every process before ``fn`` runs
            (a ``None`` value removes the variable).
        log_dir: when given, each process's stdout and stderr go to
            ``<log_dir>/<key>.log``.
        placement: per rank, ``(netns path, host address)`` to run it in another
            network namespace as another host (its tcp transport binds that
            address, and it reaches the store at ``store_host``), or None for
            this one. Every process of the rank, replacements included, goes
            there, unless :meth:`start` places it elsewhere.
        store_host: the address to host the store on (and ranks placed elsewhere
            reach it at); ``"127.0.0.1"`` by default.
        start_method: ``"forkserver"`` (the default: processes forked from a server
            that has imported torch) or ``"spawn"`` (a fresh interpreter each).
    """

    def __init__(
        self,
        world_size: int,
        env: dict[str, str | None] | None = None,
        log_dir: str | None = None,
        placement: list[tuple[str, str] | None] | None = None,
        store_host: str = "127.0.0.1",
        start_method: str = "forkserver",
    ):
        import torch.distributed as dist

        self._ctx = _context(start_method)

        self.world_size = world_size
        self.env = dict(env or {})
        self.log_dir = log_dir
        self.placement = list(placement or [])
        self.store_host = store_host
        self.store = dist.TCPStore(
            store_host, 0, world_size, is_master=True, wait_for_workers=False
        )
        self.port = self.store.port
        self._queue = self._ctx.Queue()
        self._procs: dict[str, Any] = {}
        self._pidfds: dict[str, int | None] = {}
        self._started: dict[int, int] = {}
        self._killed: set[str] = set()
        self._results: dict[str, Any] = {}
        self._errors: dict[str, str] = {}

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, exc_type, *_) -> None:
        # Leaving on an error (a rank failed, or a deadline): what still runs is stuck.
        self.close(0.0 if exc_type is not None else 5.0)

    def start(
        self,
        fn: Callable[..., Any],
        ranks: Iterable[int] | None = None,
        args: tuple = (),
        placement: list[tuple[str, str] | None] | None = None,
    ):
        """Starts one process per rank (all ranks by default); returns their keys.

        ``placement``: per started rank, where this process runs instead of the
        rank's own placement (as the constructor's; None: this host), such as a
        replacement on another host than the process it replaces.
        """
        keys = []
        env = {**os.environ, **self.env}
        ranks = list(range(self.world_size) if ranks is None else ranks)
        if placement is not None and len(placement) != len(ranks):
            raise ValueError(f"start: {len(placement)} placements for {len(ranks)} ranks")
        for i, rank in enumerate(ranks):
            n = self._started.get(rank, 0)
            self._started[rank] = n + 1
            key = str(rank) if n == 0 else f"{rank}.{n}"
            p = self._ctx.Process(
                target=_entry,
                args=(
                    fn,
                    key,
                    rank,
                    self.world_size,
                    self.port,
                    args,
                    env,
                    self.log_dir,
                    self._queue,
                    self._place(rank) if placement is None else self._where(placement[i]),
                ),
            )
            p.start()
            self._procs[key] = p
            self._pidfds[key] = _pidfd(p.pid)
            keys.append(key)
        return keys

    def _place(self, rank: int) -> tuple[str, str, str] | None:
        return self._where(self.placement[rank] if rank < len(self.placement) else None)

    def _where(self, where: tuple[str, str] | None) -> tuple[str, str, str] | None:
        return None if where is None else (where[0], where[1], self.store_host)

    def pid(self, key: str) -> int:
        return self._procs[key].pid

    def exited(self, key: str) -> bool:
        """Whether the process has ended (by itself or killed)."""
        return self._procs[key].exitcode is not None

    def wait_all(self, keys: Iterable[str], timeout_s: float, grace_s: float | None = None) -> str:
        """Waits until every process of ``keys`` has ended, and kills none.

        Returns ``""`` when they all ended, ``"deadline"`` when ``timeout_s``
        passed first, and ``"grace"`` when one of them failed (a non-zero exit)
        and others still ran ``grace_s`` later.
        """
        keys = list(keys)
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while True:
            codes = [self.exitcode(k) for k in keys]
            if all(c is not None for c in codes):
                return ""
            now = time.monotonic()
            if now > deadline:
                return "deadline"
            if grace_s is not None:
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = now
                if failed_at is not None and now - failed_at > grace_s:
                    return "grace"
            time.sleep(0.05)

    def wait(self, key: str) -> int | None:
        """Waits for the process to end; returns its exit code."""
        self._procs[key].join()
        return self._procs[key].exitcode

    def reap(self, keys: Iterable[str]) -> list[int | None]:
        """Kills those of ``keys`` that still run (kill -9), waits for every one and
        returns their exit codes, in order."""
        keys = list(keys)
        for key in keys:
            if not self.exited(key):
                self.kill(key)
        return [self.wait(key) for key in keys]

    def exitcode(self, key: str) -> int | None:
        """The process's exit code (negative: the signal that ended it); None while it runs."""
        return self._procs[key].exitcode

    def kill(self, key: str | int, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` (kill -9 by default) to a process (a rank: its latest process);
        one that has exited already is left as it is."""
        if isinstance(key, int):
            n = self._started[key] - 1
            key = str(key) if n == 0 else f"{key}.{n}"
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self._killed.add(key)
        # The fork server reaps its children at once, so an exited process's pid is
        # free for reuse: signal through a pidfd, which names this process only.
        fd = self._pidfds.get(key)
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(self._procs[key].pid, sig)
        except ProcessLookupError:
            pass  # it has exited

    def expect_exit(self, key: str | int) -> None:
        """Marks a process that will end by itself without a result (it plays a rank
        that dies): :meth:`results` does not wait for it."""
        self._killed.add(str(key))

    def results(self, timeout_s: float = 120.0, grace_s: float | None = None) -> dict[str, Any]:
        """Waits for every process not killed to finish; returns ``{key: fn's result}``.

        ``grace_s``: once a process has failed, wait at most this long for the others
        (they may be blocked on it); None waits the whole ``timeout_s``.

        Raises:
            RuntimeError: a process raised (its traceback is included), exited
                without a result, or the wait took longer than ``timeout_s`` (or
                ``grace_s`` past a failure); the message has every failure seen.
        """
        waiting = set(self._procs) - self._killed
        self._collect(waiting, timeout_s, grace_s)
        if self._errors:
            raise RuntimeError(
                "LocalGroup: " + "\n".join(f"process {k}:\n{v}" for k, v in self._errors.items())
            )
        return {k: v for k, v in self._results.items() if k in waiting}

    def result(self, key: str, timeout_s: float = 120.0) -> Any:
        """Waits for one process to finish (the others run on); returns its result.

        Raises:
            RuntimeError: it raised, exited without a result, or took longer than
                ``timeout_s``.
        """
        self._collect({key}, timeout_s)
        if key in self._errors:
            raise RuntimeError(f"LocalGroup: process {key}:\n{self._errors[key]}")
        return self._results[key]

    def _collect(self, keys: set[str], timeout_s: float, grace_s: float | None = None) -> None:
        """Takes results off the queue (any process's) until each of ``keys`` has a
        result or an error; a process that exits without one gets an error. Past
        ``timeout_s``, or ``grace_s`` after the first error among ``keys``, raises."""
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while keys - set(self._results) - set(self._errors):
            now = time.monotonic()
            if failed_at is None and keys & set(self._errors):
                failed_at = now
            why = None
            if now >= deadline:
                why = f"did not finish in {timeout_s} s"
            elif failed_at is not None and grace_s is not None and now - failed_at > grace_s:
                why = f"still ran {grace_s} s after a failure"
            if why:
                self._drain()  # what arrived meanwhile is not late
                late = sorted(keys - set(self._results) - set(self._errors))
                if late:
                    raise RuntimeError(self._late(late, why))
                continue
            left = deadline - now
            try:
                key, ok, value = self._queue.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                dead = [
                    k
                    for k in keys
                    if self._procs[k].exitcode not in (None,)
                    and k not in self._results
                    and k not in self._errors
                ]
                if dead:
                    time.sleep(0.5)  # its result may still be in the queue
                    self._drain()
                    for k in dead:
                        if k not in self._results and k not in self._errors:
                            self._errors[k] = (
                                f"exited with code {self._procs[k].exitcode} without a result"
                            )
                continue
            self._keep(key, ok, value)

    def _late(self, late: list[str], what: str) -> str:
        """The message for processes ``late`` that ``what``, with every failure seen."""
        text = f"LocalGroup: processes {late} {what}"
        for k, v in self._errors.items():
            text += f"\nprocess {k}:\n{v}"
        return text

    def _drain(self) -> None:
        """Keeps what is on the queue now."""
        while not self._queue.empty():
            self._keep(*self._queue.get())

    def _keep(self, key: str, ok: bool, value) -> None:
        if ok:
            self._results[key] = pickle.loads(value)
        else:
            self._errors[key] = value

    def close(self, wait_s: float = 5.0) -> None:
        """Kills what still runs (after ``wait_s`` in all for those finishing) and
        releases the store."""
        end = time.monotonic() + wait_s
        for p in self._procs.values():
            p.join(timeout=max(0.0, end - time.monotonic()) if p.exitcode is None else 0)
        for p in self._procs.values():
            if p.is_alive():
                try:
                    p.kill()
                except ProcessLookupError:
                    pass  # it exited meanwhile
        for p in self._procs.values():
            p.join()
        for fd in self._pidfds.values():
            if fd is not None:
                os.close(fd)
        self._pidfds.clear()


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    grace_s: float | None = 60.0,
) -> list[Any]:
    """Runs ``fn`` on ``world_size`` local ranks and returns their results by rank.

    Args:
        fn: a picklable function ``fn(rank, world_size, port, *args)``; call
            ``init_rank(rank, world_size, port)`` in it to join the group.
        world_size: number of processes.
        args: extra arguments for ``fn``.
        env: environment variables set in every rank before ``fn`` runs.
        timeout_s: a bound on the whole run; ranks still running then are killed.
        grace_s: once a rank has failed, how long the others may still run (they
            may be waiting on it); None: the whole ``timeout_s``.

    Raises:
        RuntimeError: a rank raised (every failed rank's traceback is included),
            or exited without a result, or the run took longer than ``timeout_s``
            (or ``grace_s`` past a failure).
    """
    with LocalGroup(world_size, env) as group:
        group.start(fn, args=args)
        results = group.results(timeout_s, grace_s)
    return [results[str(r)] for r in range(world_size)]
