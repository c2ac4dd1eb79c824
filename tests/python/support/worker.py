"""The rank side of a launch (see launcher.py): :func:`rank_main`, which
``mooncake.launch.LocalGroup`` runs in each rank's process.

Connects to the launcher's TCPStore, creates the default ``mooncake-cpu``
group (unless the launch says the cases do it), runs the selected cases in
order and appends one JSON line per event to its result file:

* ``{"event": "start", "case": ...}`` before a case;
* ``{"event": "end", "case": ..., "status": "ok" | "fail" | "error", ...}``
  after it (``fail``: an expectation did not hold; ``error``: it raised);
* ``{"event": "abort", "reason": ...}`` when the group stopped working;
* ``{"event": "done"}`` after the last case, ``{"event": "exit"}`` after
  ``destroy_process_group`` returned.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mooncake.launch import store_host
from reference import make_tensor, mismatch, seed_of  # this folder is on sys.path


class RankContext:
    """What a case sees on one rank: its rank, deterministic inputs, and expectations.

    Expectations (``expect*``) record failures and let the case go on, so that
    every rank makes the same sequence of calls even when a result is wrong.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: dist.Store,
        op_timeout_s: float,
        backend: str = "mooncake-cpu",
    ):
        self.rank = rank
        self.backend = backend
        self.world_size = world_size
        self.op_timeout_s = op_timeout_s
        self._root_store = store
        self._pg_count = 0
        self.case = ""
        self.failures: list[str] = []

    def begin(self, case: str) -> None:
        self.case = case
        self.failures = []

    @property
    def store(self) -> dist.Store:
        """A store namespace private to the current case (out-of-band coordination)."""
        return dist.PrefixStore(f"case/{self.case}", self._root_store)

    # --- inputs -------------------------------------------------------------

    def input(self, shape, dtype: torch.dtype, rank: int | None = None, tag: str = ""):
        """Rank ``rank``'s (default: this rank's) deterministic input for this case."""
        rank = self.rank if rank is None else rank
        return make_tensor(shape, dtype, seed_of(self.case, rank, tag))

    def inputs(self, shape, dtype: torch.dtype, tag: str = "") -> list[torch.Tensor]:
        """Every rank's input, in rank order."""
        return [self.input(shape, dtype, r, tag) for r in range(self.world_size)]

    # --- expectations -------------------------------------------------------

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.fail(message)

    def expect_equal(self, actual: torch.Tensor, expected: torch.Tensor, what: str = "result"):
        """Records a failure unless ``actual`` equals ``expected`` bit for bit."""
        problem = mismatch(actual, expected)
        if problem:
            self.fail(f"{what}: {problem}")

    @contextlib.contextmanager
    def expect_raises(
        self,
        exc_type: type[BaseException],
        *words: str | tuple[str, ...],
        ranks: list[int] | None = None,
        what: str = "",
    ):
        """Records a failure unless the block raises ``exc_type`` whose message contains
        every one of ``words`` (case-insensitive; a tuple means any one of its strings)
        and, with ``ranks``, whose ``.ranks`` (a PeerFailedError's) equals it. ``what``
        names the call in the failure (where the words do not)."""
        prefix = f"{what}: " if what else ""
        try:
            yield
        except exc_type as e:
            text = str(e).lower()
            missing = [
                w
                for w in words
                if not any(a.lower() in text for a in (w if isinstance(w, tuple) else (w,)))
            ]
            if missing:
                self.fail(f"{prefix}{exc_type.__name__} does not mention {missing}: {e}")
            if ranks is not None and getattr(e, "ranks", None) != ranks:
                self.fail(
                    f"{prefix}{type(e).__name__}.ranks is {getattr(e, 'ranks', None)}, want {ranks}: {e}"
                )
        except Exception as e:  # reported as the wrong kind of error
            # raised while another was handled (a context manager's exit): that one too
            was = e.__context__
            during = f" (raised while handling {type(was).__name__}: {was})" if was else ""
            # where it was raised: the wrong error's own frames say which call it was
            frames = traceback.extract_tb(e.__traceback__)[-3:]
            where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.line}" for f in frames)
            self.fail(
                f"{prefix}expected {exc_type.__name__}, got {type(e).__name__}: {e}{during} [at {where}]"
            )
        else:
            self.fail(f"{prefix}expected {exc_type.__name__} ({words}), nothing was raised")

    # --- groups and out-of-band sync ---------------------------------------

    def init_pg(self, store_prefix: str | None = None, **kwargs) -> None:
        """``init_process_group`` of the launch's backend over a fresh store namespace, or
        over ``store_prefix`` (the same one each time, as a re-initialising job would)."""
        import mooncake.pg  # noqa: F401 - registers the backend

        self._pg_count += 1
        kwargs.setdefault("timeout", timedelta(seconds=self.op_timeout_s))
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(store_prefix or f"pg{self._pg_count}", self._root_store),
            rank=self.rank,
            world_size=self.world_size,
            **kwargs,
        )

    def store_barrier(self, tag: str, timeout_s: float = 60.0) -> None:
        """A barrier through the launcher's store, independent of the backend."""
        store = self.store
        store.set(f"barrier/{tag}/{self.rank}", "1")
        store.wait(
            [f"barrier/{tag}/{r}" for r in range(self.world_size)], timedelta(seconds=timeout_s)
        )


def _probe(world_size: int, timeout_s: float) -> str:
    """'' if a small all_reduce still works on this rank, else why not."""
    try:
        t = torch.tensor([dist.get_rank() + 1.0], dtype=torch.float64)
        dist.all_reduce(t, async_op=True).wait(timeout=timedelta(seconds=timeout_s))
        want = world_size * (world_size + 1) / 2
        return "" if t.item() == want else f"probe all_reduce gave {t.item()}, expected {want}"
    except Exception as e:
        return f"probe all_reduce raised {type(e).__name__}: {e}"


def _agree(store: dist.Store, key: str, rank: int, world: int, value: str, timeout_s: float):
    """Publishes this rank's value under ``key`` and returns every rank's, in rank order."""
    store.set(f"{key}/{rank}", value)
    keys = [f"{key}/{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=timeout_s))
    return [v.decode() for v in store.multi_get(keys)]


def rank_main(rank: int, world: int, port: int, config_path: str) -> None:
    """Runs the launch's cases on this rank (``config_path``: the launcher's pickled config)."""
    config = pickle.loads(Path(config_path).read_bytes())
    launch = config["launch"]
    out = open(config["out"].format(rank=rank), "a", buffering=1)

    def record(**fields) -> None:
        out.write(json.dumps(fields) + "\n")
        out.flush()

    torch.set_num_threads(1)
    cases = launch.cases()
    if config["selected"] is not None:
        wanted = set(config["selected"])
        cases = [c for c in cases if c.name in wanted]

    op_timeout_s = launch.op_timeout_s
    sync_timeout_s = op_timeout_s * 2 + 60
    store = dist.TCPStore(
        store_host(), port, world, is_master=False, timeout=timedelta(seconds=120)
    )
    harness = dist.PrefixStore("harness", store)
    ctx = RankContext(rank, world, store, op_timeout_s, launch.backend)
    if launch.spread_gpus:  # before any group: a CUDA group serves the current device
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if launch.init_pg:
        ctx.init_pg()

    for i, case in enumerate(cases):
        record(event="start", case=case.name)
        ctx.begin(case.name)
        started = time.perf_counter()
        try:
            case.fn(ctx)
            status = "fail" if ctx.failures else "ok"
        except Exception:  # reported with the case
            status = "error"
            ctx.failures.append(traceback.format_exc())
        record(
            event="end",
            case=case.name,
            status=status,
            messages=ctx.failures,
            seconds=round(time.perf_counter() - started, 4),
        )
        verdicts = _agree(harness, f"case{i}", rank, world, status, sync_timeout_s)
        if "error" not in verdicts:
            continue
        # A case raised somewhere: go on only if the group still works everywhere.
        problem = _probe(world, op_timeout_s) if dist.is_initialized() else "no process group"
        health = _agree(harness, f"probe{i}", rank, world, problem or "ok", sync_timeout_s)
        bad = [f"rank {r}: {h}" for r, h in enumerate(health) if h != "ok"]
        if bad:
            who = [r for r, v in enumerate(verdicts) if v == "error"]
            record(
                event="abort",
                reason=f"case {case.name!r} raised on ranks {who} and the group no longer "
                f"works ({'; '.join(bad)})",
            )
            out.close()
            os._exit(3)
    record(event="done")
    if dist.is_initialized():
        dist.destroy_process_group()
    record(event="exit")
    out.close()
