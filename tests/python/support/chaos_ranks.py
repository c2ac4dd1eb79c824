"""Rank side of the chaos soak (test_gpu_chaos.py) and the failover benchmark
(bench/bench_ep_failover.py): one process of a group that lives through a plan of faults.

Every process gets the same plan (``chaos_parent.make_plan``) and goes through its
cycles in lockstep with the others; what each cycle does is decided by the plan alone,
so no process needs another's word for it. A cycle ``c`` (``plan["cycles"][c]``: a
victim rank, a fault and where it strikes):

1. when the fault kills or stops its victim, every process first waits (bounded) until
   the replacement for it is pre-started: a process, torch and mooncake imported, that
   waits for its cue (``standby/<c>``);
2. ``settle`` steps at full strength (the measured op: an EP dispatch + combine, or a
   64 MiB all_reduce), then the battery (``plan["battery"]``: EP in BF16 and FP8, the
   elastic buffer in both, the collectives), each checked; the process samples its
   resources;
3. a barrier, so that the fault lands between two steps; then the victim fails: kill -9
   (``between`` steps, or ``inside`` the next step: right after launching its
   dispatch, or inside its all_reduce), SIGSTOP past the hang limit (``stop``), or
   SIGSTOP under it (``slow``, the parent resumes it), after stamping the time in the
   store (``fault/<c>``);
4. the others run the next step (``c<c>/fault``, timed: the fault's cost to them),
   then the battery among them;
5. for a kill or a stop, the replacement joins: the others poll ``pg.get_peer_state``
   and call ``pg.recover_ranks`` and ``Buffer.update_ep_member`` and reconnect the
   elastic slot, while the replacement makes its group (``is_extension=True``),
   ``pg.join_group()``, its Buffer and its elastic buffer; then every process runs the
   first full-strength step (``c<c>/rejoin``, timed). A stopped victim is resumed by the
   parent after the join, and must be told it was left out (``LeftOutError``).

Before the cycles, ``plan["healthy"]`` (if any) runs that many EP steps with one rank
busy for ``busy_ms`` between steps: nobody may be masked.

Each process publishes its records in the store (``rec/<pkey>``: a JSON object of
``records`` and ``info``) after each cycle and before it fails on purpose, so that the
parent reads what a killed process did. ``pkey`` is ``"<rank>"`` for an original
process and ``"<rank>@<c>"`` for the replacement of cycle ``c``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import statistics
import time
import traceback
import warnings

import torch
import torch.distributed as dist

from chaos_steps import (
    COLLECTIVES,
    Steps,
    busy,
    die,
    left_out_check,
    now,
    resources,
    stop_self,
)
from ft_ranks import client_store, start_rank
from mooncake import pg
from mooncake.launch import init_rank


class Aborted(Exception):
    """The parent stopped the run (another process failed)."""


def pkey_of(rank: int, cycle: int | None) -> str:
    return str(rank) if cycle is None else f"{rank}@{cycle}"


def member(rank: int, world: int, port: int, plan: dict, cycle: int | None = None) -> bool:
    """One process: an original one (``cycle`` None) or the replacement pre-started for
    cycle ``cycle``. Its records, and its error if any, are in the store (``rec/<pkey>``,
    ``error/<pkey>``); it returns only whether it ran to its end (the parent never reads
    the launcher's result pipe, so nothing large may wait in it)."""
    proc = Process(rank, world, port, plan, cycle)
    return proc.main()


class Process:
    def __init__(self, rank: int, world: int, port: int, plan: dict, cycle: int | None):
        self.rank, self.world, self.port, self.plan, self.start = rank, world, port, plan, cycle
        self.pkey = pkey_of(rank, cycle)
        self.records: list[dict] = []
        self.info: dict = {"pkey": self.pkey, "rank": rank, "pid": os.getpid(), "samples": []}
        self.store = None
        self.loss = None  # pg.watch_loss_times(), once in the group
        self.steps: Steps | None = None
        self.device = torch.device(plan["device"])

    # --- plumbing ------------------------------------------------------------------------

    def main(self) -> bool:
        stacks = open(os.path.join(self.plan["stamp_dir"], f"{self.pkey}.stacks"), "w")
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            self.run()
            self.info["ok"] = True
        except BaseException as e:  # noqa: BLE001  (reported to the parent through the store)
            self.info["error"] = f"{type(e).__name__}: {e}"
            self.info["traceback"] = traceback.format_exc()
        self.info["t_end"] = now()
        if self.store is not None:
            self.publish()
            if "error" in self.info:
                self.store.set(f"error/{self.pkey}", self.info["error"][:2000])
                self.store.add("errors", 1)
        return "error" not in self.info

    def publish(self) -> None:
        doc = {"records": self.records, "info": self.info}
        self.store.set(f"rec/{self.pkey}", json.dumps(doc))

    def add(self, rec: dict, **meta) -> dict:
        rec.update(meta)
        self.records.append(rec)
        return rec

    def wait_key(self, key: str, timeout_s: float | None = None) -> None:
        deadline = now() + (timeout_s or self.plan["wait_s"])
        while not self.store.check([key]):
            if self.store.check(["abort"]):
                raise Aborted(self.store.get("abort").decode())
            if now() > deadline:
                raise TimeoutError(f"{self.pkey}: store key {key!r} not set in {timeout_s} s")
            time.sleep(0.002)

    def wait_count(self, key: str, n: int) -> None:
        deadline = now() + self.plan["wait_s"]
        while self.store.add(key, 0) < n:
            if self.store.check(["abort"]):
                raise Aborted(self.store.get("abort").decode())
            if now() > deadline:
                raise TimeoutError(f"{self.pkey}: {key} below {n} after {self.plan['wait_s']} s")
            time.sleep(0.002)

    # --- the run -------------------------------------------------------------------------

    def run(self) -> None:
        plan, rank, world = self.plan, self.rank, self.world
        init = {"backend": plan["backend"], "max_world_size": world, "timeout_s": plan["pg_s"]}
        if self.start is None:
            self.use_gpu()
            active, self.store = start_rank(rank, world, self.port, **init)
            self.loss = pg.watch_loss_times()
            self.steps = Steps(rank, world, plan, self.store, active)
            if plan["ep_buffer"]:
                self.steps.make_buffer()
            if plan["eep"]:
                self.steps.make_eep()
            first = 0
            if plan.get("healthy"):
                self.healthy(plan["healthy"])
        else:
            c = self.start
            torch.set_num_threads(1)
            warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor renames
            self.store = client_store(self.port, world)
            self.store.set(f"standby/{c}", str(os.getpid()))
            # The survivors' timed step comes first: nothing of the join competes with it.
            self.wait_count(f"measured/{c}", world - 1)
            info = self.info
            info["t_init"] = now()
            self.use_gpu()  # not before: a waiting standby holds no GPU context
            active = init_rank(rank, world, self.port, is_extension=True, **init)
            info["t_join_call"] = now()
            pg.join_group()
            info["t_joined"] = now()
            self.loss = pg.watch_loss_times()
            self.steps = Steps(rank, world, plan, self.store, active)
            if plan["ep_buffer"]:
                self.steps.make_buffer()  # meets the others' update_ep_member
            if plan["eep"]:
                self.steps.make_eep(lambda: self.store.set(f"eep_made/{c}", "1"))
            info["t_ready"] = now()
            self.rejoin_step(c)
            first = c + 1
        for c in range(first, len(plan["cycles"])):
            if not self.cycle(c):
                return  # a stopped victim, resumed and told it was left out
        self.publish()
        dist.barrier()
        dist.destroy_process_group()

    def use_gpu(self) -> None:
        if self.device.type == "cuda":  # one GPU per process where there are enough
            torch.cuda.set_device(self.rank % torch.cuda.device_count())

    def measured(self, tag: str, alive, must_drop=None, may_drop=(), old=None, fp8=None,
                 warm=True) -> dict:  # fmt: skip
        """The plan's measured op: an EP dispatch + combine (``fp8``: its dtype, default
        the plan's), a 64 MiB all_reduce, or a replay of a captured all_reduce (``warm``:
        after an eager one), timed and checked."""
        plan = self.plan
        if plan["measure"] == "ar":
            return self.steps.big_all_reduce(tag, plan["ar_bytes"], alive, old=old)
        if plan["measure"] == "graph":
            return self.steps.graph_all_reduce(tag, plan["ar_bytes"], alive, warm=warm)
        fp8 = plan["fp8"] if fp8 is None else fp8
        return self.steps.ep(tag, fp8, may_drop=may_drop, must_drop=must_drop)

    def battery(self, c: int, phase: str, alive, fault_victim: int | None = None) -> None:
        """The plan's battery among ``alive``; ``fault_victim``: the rank that just failed
        (the elastic buffer's first call must mask it)."""
        kinds = self.plan["battery"]
        steps, tag = self.steps, f"c{c}/{phase}"
        if "ep" in kinds:
            for fp8 in (False, True):
                self.add(steps.ep(f"{tag}/ep{int(fp8)}", fp8), c=c, phase=phase)
        if "eep" in kinds:
            everyone = list(range(self.world))
            for fp8 in (False, True):
                first = fault_victim is not None and not fp8
                slots = everyone if first else sorted(alive)
                drop = (fault_victim,) if first else None
                i = 4 * c + 2 * (phase == "after") + fp8  # the same on every process
                self.add(steps.eep_call(tag, i, fp8, slots, must_drop=drop), c=c, phase=phase)
        for kind in COLLECTIVES:
            if kind in kinds:
                self.add(steps.collective(tag, kind, alive), c=c, phase=phase)

    def healthy(self, h: dict) -> None:
        """EP steps with one rank busy between them: nobody may be masked (the Round
        checks fail on any masking)."""
        for i in range(h["steps"]):
            rec = self.measured(f"h{i}", range(self.world), fp8=bool(i % 2))
            self.add(rec, c=-1, phase="healthy", i=i)
            if self.rank == h["busy_rank"]:
                busy(h["busy_ms"], self.device)
        self.info["healthy_events"] = self.steps.events()
        self.publish()

    def cycle(self, c: int) -> bool:
        """Cycle ``c`` (see the module docstring); False when this process ends with it."""
        plan, rank, world = self.plan, self.rank, self.world
        cy = plan["cycles"][c]
        v, fault, where = cy["victim"], cy["fault"], cy["where"]
        everyone = list(range(world))
        replaced = fault in ("kill", "stop")
        if replaced:
            self.wait_key(f"standby/{c}")
        for i in range(plan["settle"]):
            self.add(self.measured(f"c{c}/full{i}", everyone), c=c, phase="full", i=i)
        self.battery(c, "full", everyone)
        self.info["samples"].append({"c": c, "t": now(), **resources(self.device)})
        self.publish()
        if plan["measure"] == "ep" and rank != v:
            # The survivors' inputs of the step after the fault, made before it: the time
            # from the fault is the library's, as for an engine whose inputs are ready.
            self.steps.prepare(f"c{c}/fault", plan["fp8"])
        dist.barrier()  # everyone is past its checks: the fault falls between two steps
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # nothing in flight (MPS fails every client otherwise)
        if rank == v:
            if not self.victim(c, cy):
                return False
        alive = [r for r in everyone if r != v] if replaced else everyone
        if fault == "slow" or fault == "none":
            rec = self.measured(f"c{c}/fault", alive)
        elif where == "inside":
            rec = self.measured(f"c{c}/fault", alive, may_drop=(v,), old=everyone)
        else:  # (a replay meets the lost rank itself: no eager call first)
            rec = self.measured(f"c{c}/fault", alive, must_drop=(v,), warm=False)
        if replaced:  # when this process's transport told of the victim (None: not yet)
            rec["t_told"] = (self.loss.gone_at if fault == "kill" else self.loss.silent_at)(v)
        self.add(rec, c=c, phase="fault")
        if replaced and rec.get("ranks") is not None and plan["measure"] == "ep":
            # The combine, at the latest, masks the victim (an inside kill may let its
            # tokens through the dispatch); nobody else.
            want = [int(r != v) for r in everyone]
            if rec["ranks"] != want:
                rec["failures"].append(f"active_ranks {rec['ranks']} after the step, want {want}")
        self.store.add(f"measured/{c}", 1)
        if not plan["battery"]:  # the next op, among the survivors
            self.add(self.measured(f"c{c}/after", alive), c=c, phase="after")
        self.battery(c, "after", alive, v if replaced else None)
        if replaced:
            self.admit(c, v)
        self.publish()
        return True

    def victim(self, c: int, cy: dict) -> bool:
        """The victim's part of cycle ``c``: True when it goes on as a member (slow)."""
        fault, where, key = cy["fault"], cy["where"], f"fault/{c}"
        self.info.setdefault("faults", []).append({"c": c, "fault": fault, "where": where})
        self.publish()
        if fault == "kill":
            if where == "inside" and self.plan["measure"] == "ep":
                self.steps.launch_dispatch(f"c{c}/fault", self.plan["fp8"])
            elif where == "inside":
                full = [r["t1"] - r["t0"] for r in self.records if r.get("phase") == "full"]
                self.steps.big_all_reduce("", self.plan["ar_bytes"], [], victim=True)
                time.sleep(cy["frac"] * statistics.median(full))
            die(self.store, key, f"kill {where}")
        t_resumed = stop_self(self.store, key, fault)
        if fault == "slow":
            return True
        # Stopped past the hang limit: the parent resumes this process once its
        # replacement has joined. It must be told that it was left out.
        self.info["t_resumed"] = t_resumed
        self.info["left_out"] = left_out_check(
            self.rank, self.device, self.steps.buf, self.steps.eep
        )
        self.publish()
        return False

    def admit(self, c: int, v: int) -> None:
        """The survivors' side of the join: wait (bounded) until the replacement waits,
        admit it, take it into the Buffer and the elastic buffer; then the first
        full-strength step."""
        t_poll = now()
        deadline = t_poll + self.plan["wait_s"]
        polls = 0
        while not pg.get_peer_state(None, [v])[0]:  # the same answer on every survivor
            polls += 1
            if now() > deadline:
                raise TimeoutError(f"{self.pkey}: no replacement for rank {v} waits (cycle {c})")
            time.sleep(0.005)
        t_admit = now()
        pg.recover_ranks(None, [v])
        self.steps.after_join([v], lambda: self.wait_key(f"eep_made/{c}"))
        self.info.setdefault("admits", []).append(
            {"c": c, "t_poll": t_poll, "t_admit": t_admit, "t_done": now(), "polls": polls}
        )
        self.rejoin_step(c)

    def rejoin_step(self, c: int) -> None:
        """Everyone, the replacement included: the first step at full strength."""
        everyone = list(range(self.world))
        self.add(self.measured(f"c{c}/rejoin", everyone), c=c, phase="rejoin")
        if self.start == c:
            self.store.set(f"joined/{c}", "1")
        self.publish()
