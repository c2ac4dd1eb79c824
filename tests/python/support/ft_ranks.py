"""Rank-side code of the fault-tolerance tests (test_fault_tolerance.py, test_elastic.py).

Everything here runs in processes started by :class:`mooncake.launch.LocalGroup`: each
entry point is a module-level ``fn(rank, world_size, port, *args)`` and returns plain
Python data (a tensor in a result would travel as a shared fd that dies with the rank).

The technique: rank ``r`` contributes ``1 << r``, so a SUM spells the set of ranks an op
covered (its *mask*); gathers and all-to-alls spell it through which slices hold data
(slices of ranks outside the op's set must be zero-filled). Ranks record one
:data:`Record` per op; the parent compares the records of all ranks op by op.

A record is a tuple ``(kind, status, root, mask, detail)``:

* ``kind``: the op (see :data:`KINDS`);
* ``status``: ``"ok"``; ``"err"`` (the op raised; ``detail`` is ``"Type: message"``, or
  ``"Type ranks=[...]: message"`` for a PeerFailedError, see :func:`describe`);
  ``"bad"`` (the op returned wrong data; ``detail`` says what); ``"skip"``;
* ``root``: the root of a rooted op, else None;
* ``mask``: the set of ranks the result covers, where this rank can tell (every rank for
  :data:`MASK_KINDS`, the root for reduce and gather), else None;
* ``detail``: for p2p ``(prev, next, errors, seconds)`` with errors a list of
  ``(direction, peer, "Type: message")``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from mooncake import PeerFailedError, pg
from mooncake.launch import init_rank, process_resources, store_host

BIG = 1 << 16  # int64 elements of the big all_reduce: 512 KiB, 128 slots of 4 KiB
MID = 1536  # int64 elements per rank slice of the other ops: 12 KiB, 3 slots of 4 KiB
P2P_N = 3000  # int64 elements of a ring message: 24 KiB

EP_TOKENS, EP_HIDDEN = 4, 128  # the EP Buffer op's shape (portable path, CPU)

KINDS = ("ar", "ar_big", "ag", "bcast", "a2a", "p2p", "rs", "reduce", "gather", "scatter")
MASK_KINDS = frozenset({"ar", "ar_big", "ag", "a2a", "rs", "ep", "eep"})
ROOTED_KINDS = frozenset({"bcast", "reduce", "gather", "scatter"})
# Every kind, and two that only an elastic battery runs.
ALL_KINDS = KINDS + ("reduce_all", "barrier")
# What the chaos driver runs: every kind and an EP Buffer dispatch + combine.
CHAOS_KINDS = KINDS + ("ep",)
#: The elastic batteries add the elastic EP buffer (connected anew after every join).
ELASTIC_KINDS = CHAOS_KINDS + ("eep",)
EEP_TIMEOUT_MS = 10_000  # the elastic buffer's per-phase wait budget


def bits(ranks) -> int:
    return sum(1 << r for r in ranks)


def ranks_of(mask: int) -> list[int]:
    return [r for r in range(mask.bit_length()) if mask >> r & 1]


def describe(e: BaseException) -> str:
    """``"Type: message"`` (its first line); a PeerFailedError (LeftOutError too) also
    shows its ranks: ``"PeerFailedError ranks=[2]: message"``. ``ft_parent.error_of``
    reads it back."""
    ranks = f" ranks={e.ranks}" if isinstance(e, PeerFailedError) else ""
    return f"{type(e).__name__}{ranks}: {e}".splitlines()[0][:400]


def client_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(
        store_host(), port, world_size, is_master=False, timeout=timedelta(seconds=120)
    )


def start_rank(rank, world_size, port, *, barrier=True, **init_kwargs):
    """Joins the group; returns ``(active_ranks tensor, store)``.

    With ``barrier``, first waits until every rank of the launch has arrived, so that a
    small op timeout does not expire while slower ranks are still importing torch.
    """
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor renames
    store = client_store(port, world_size)
    if barrier:
        store.add("arrived", 1)
        deadline = time.monotonic() + 120
        while store.add("arrived", 0) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError("not every rank arrived within 120 s")
            time.sleep(0.005)
    active = init_rank(rank, world_size, port, **init_kwargs)
    return active, store


def admit(group, ranks: list[int], timeout_s: float = 120.0) -> int:
    """Waits until a replacement waits for each of ``ranks`` (``pg.get_peer_state``), then
    admits them (``pg.recover_ranks``; collective among the members). Returns the polls."""
    deadline = time.monotonic() + timeout_s
    polls = 0
    while not all(pg.get_peer_state(group, ranks)):
        polls += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"no replacement waits for ranks {ranks}")
        time.sleep(0.01)
    pg.recover_ranks(group, ranks)
    return polls


def members_of(active: torch.Tensor) -> list[int]:
    return [r for r, a in enumerate(active.tolist()) if a]


def kill_self_after(seconds: float) -> threading.Timer:
    """kill -9 of this process from a timer thread (it fires while the main thread is
    inside an op: the backend releases the GIL while it waits)."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()
    return timer


class BadData(AssertionError):
    pass


def _uniform(t: torch.Tensor, what: str) -> int:
    lo, hi = int(t.min()), int(t.max())
    if lo != hi:
        raise BadData(f"{what}: not uniform (min {lo}, max {hi})")
    return lo


def _slices_mask(out: torch.Tensor, n: int, what: str) -> int:
    """Slice j of ``out`` must be all ``1 << j`` (rank j's data) or all zeros (rank j
    outside the op's set); returns the mask of the slices with data."""
    mask = 0
    for j in range(out.numel() // n):
        s = out[j * n : (j + 1) * n]
        lo, hi = int(s.min()), int(s.max())
        if lo == hi == 1 << j:
            mask |= 1 << j
        elif not (lo == hi == 0):
            raise BadData(f"{what}: slice {j} is neither rank {j}'s data nor zeros ({lo}..{hi})")
    return mask


class Ops:
    """Runs one op of a kind and returns its :data:`Record` (never raises for op errors).

    In a subgroup, ranks (contributions, masks, roots) are group ranks; ``global_ranks``
    maps them to the global ranks that torch's src/dst arguments take. ``width``: the
    per-rank lists' length, when the group was extended past its world size (all_to_all
    then gives its split sizes: equal splits are over the world size).
    """

    def __init__(
        self, rank, world_size, active, group=None, global_ranks=None, device="cpu", width=None
    ):
        self.rank = rank
        self.world = width or world_size
        self.splits = [MID] * width if width else None
        self.active = active
        self.group = group
        self.device = torch.device(device)
        self.g = list(global_ranks) if global_ranks is not None else list(range(self.world))
        self._buffer = None  # the EP Buffer, made by the first "ep" op (collective)
        self._elastic = None  # the elastic EP buffer, made by eep_rejoin

    def run(self, kind: str, i: int, root=None):
        members = members_of(self.active)
        if kind in ROOTED_KINDS and root is None:
            root = members[i % len(members)]
        try:
            if kind == "p2p":
                return self._p2p(members)
            mask = (
                getattr(self, "_" + kind)(root) if root is not None else getattr(self, "_" + kind)()
            )
            return (kind, "ok", root, mask, None)
        except BadData as e:
            return (kind, "bad", root, None, str(e))
        except Exception as e:  # noqa: BLE001  (recorded; the parent judges it)
            return (kind, "err", root, None, describe(e))

    def _full(self, n, value):
        return torch.full((n,), value, dtype=torch.int64, device=self.device)

    def _ar(self):
        x = torch.tensor([1 << self.rank], dtype=torch.int64, device=self.device)
        dist.all_reduce(x, group=self.group)
        return int(x.item())

    def _ar_big(self):
        x = self._full(BIG, 1 << self.rank)
        dist.all_reduce(x, group=self.group)
        return _uniform(x, "all_reduce (big)")

    def _reduce_all(self):  # an all_reduce with MAX then SUM on a mid-size tensor
        x = self._full(MID, 1 << self.rank)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        top = _uniform(x, "all_reduce MAX")
        x = self._full(MID, 1 << self.rank)
        dist.all_reduce(x, group=self.group)
        mask = _uniform(x, "all_reduce SUM")
        if top != 1 << (mask.bit_length() - 1):
            raise BadData(f"all_reduce MAX gave {top}, but SUM covered {ranks_of(mask)}")
        return mask

    def _barrier(self):
        dist.barrier(group=self.group)
        return None

    def _ag(self):
        out = self._full(self.world * MID, -1)
        dist.all_gather_into_tensor(out, self._full(MID, 1 << self.rank), group=self.group)
        return _slices_mask(out, MID, "all_gather")

    def _a2a(self):
        out = self._full(self.world * MID, -1)
        dist.all_to_all_single(
            out,
            self._full(self.world * MID, 1 << self.rank),
            output_split_sizes=self.splits,
            input_split_sizes=self.splits,
            group=self.group,
        )
        return _slices_mask(out, MID, "all_to_all_single")

    def _rs(self):
        out = self._full(MID, -1)
        dist.reduce_scatter_tensor(
            out, self._full(self.world * MID, 1 << self.rank), group=self.group
        )
        return _uniform(out, "reduce_scatter")

    def ep_rejoin(self):
        """Before a battery after a join (collective over the full group): a joiner
        makes its EP Buffer, meeting the members' ``update_ep_member``."""
        from mooncake.mooncake_ep_buffer import Buffer

        if self._buffer is None:
            self._buffer = Buffer(self.group or dist.group.WORLD, 0)
        else:
            self._buffer.update_ep_member()

    def _ep(self):
        """An EP Buffer dispatch + combine over the group (the portable path), see
        :meth:`_identity_round`. Dead ranks are left out by the group; their experts
        then count for nothing."""
        if self._buffer is None:
            self.ep_rejoin()  # the first call makes the Buffer
        return self._identity_round(self._buffer, -1, "EP combine")

    def eep_rejoin(self, store, replaced=()):
        """Before a battery after a join: the elastic EP buffer (a slot per rank, the
        world as its capacity) takes in the processes that joined. A process without
        one makes it and connects every other slot; the others release the slots in
        ``replaced`` (their old processes are gone) and connect the new ones. Both
        sides then publish (each waits, bounded, for the other's side)."""
        from mooncake.mooncake_ep_buffer import Buffer

        others = [r for r in range(self.world) if r != self.rank]
        if self._elastic is None:
            buf = Buffer.create_elastic(
                rank=self.rank,
                tcp_store_group=store,
                timeout_ms=EEP_TIMEOUT_MS,
                metadata_timeout_ms=60_000,
                store_prefix="eep/",
            )
            hint = Buffer.get_ep_buffer_size_hint(EP_TOKENS, EP_HIDDEN, self.world, 2 * self.world)
            buf.update_memory_buffers(
                num_ranks=self.world, num_experts_per_rank=2, num_rdma_bytes=hint
            )
            self._elastic, fresh = buf, others
        else:
            fresh = [r for r in replaced if r != self.rank]
            if fresh:
                self._elastic.disconnect_ranks(fresh)
        if fresh:
            self._elastic.connect_ranks(fresh, activate=False)
            for r in fresh:
                self._elastic.update_mask_buffer(r, mask=False)

    def _eep(self):
        """A dispatch + combine over the elastic EP buffer (see :meth:`eep_rejoin`)."""
        return self._identity_round(self._elastic, -1, "elastic EP combine")  # timeout_ms

    def _identity_round(self, buf, timeout_us, what):
        """A dispatch + combine with identity experts: every token selects one expert on
        each rank j with weight 2**j, so each combined value spells the set of ranks
        whose experts answered."""
        R, T = self.world, EP_TOKENS
        E = 2 * R
        x = torch.ones(T, EP_HIDDEN, dtype=torch.bfloat16, device=self.device)
        idx = torch.tensor(
            [[2 * j + t % 2 for j in range(R)] for t in range(T)], dtype=torch.int64
        ).to(self.device)
        w = torch.tensor([[float(1 << j) for j in range(R)]] * T, device=self.device)
        recv_x, _, handle, _, _ = buf.dispatch(x, idx, None, T, E, timeout_us, use_fp8=False)
        out, _, _ = buf.combine(recv_x, idx, w, None, timeout_us, handle)
        got = out.float()
        if not torch.equal(got, got.round()):
            raise BadData(f"{what}: a non-integral sum {got.flatten()[:4].tolist()}")
        return _uniform(got.to(torch.int64), what)

    def _bcast(self, root):
        t = self._full(MID, (1 << root) if self.rank == root else -1)
        dist.broadcast(t, src=self.g[root], group=self.group)
        if _uniform(t, "broadcast") != 1 << root:
            raise BadData(f"broadcast from {root}: got {int(t[0])}")
        return None

    def _reduce(self, root):
        x = self._full(MID, 1 << self.rank)
        dist.reduce(x, dst=self.g[root], group=self.group)
        return _uniform(x, "reduce") if self.rank == root else None

    def _gather(self, root):
        outs = [self._full(MID, -1) for _ in range(self.world)] if self.rank == root else None
        dist.gather(
            self._full(MID, 1 << self.rank), gather_list=outs, dst=self.g[root], group=self.group
        )
        return _slices_mask(torch.cat(outs), MID, "gather") if outs is not None else None

    def _scatter(self, root):
        ins = (
            [self._full(MID, (root << 8) + j) for j in range(self.world)]
            if self.rank == root
            else None
        )
        out = self._full(MID, -1)
        dist.scatter(out, scatter_list=ins, src=self.g[root], group=self.group)
        got = _uniform(out, "scatter")
        if got != (root << 8) + self.rank:
            raise BadData(f"scatter from {root}: got {got}, want {(root << 8) + self.rank}")
        return None

    def _p2p(self, members):
        """A ring over the current members: isend to the next, irecv from the previous."""
        if len(members) < 2 or self.rank not in members:
            return ("p2p", "skip", None, None, None)
        k = members.index(self.rank)
        nxt, prv = members[(k + 1) % len(members)], members[k - 1]
        errors = []
        t0 = time.monotonic()
        buf = self._full(P2P_N, -1)
        works = []
        for direction, peer, call in (
            ("recv", prv, lambda: dist.irecv(buf, src=self.g[prv], group=self.group)),
            (
                "send",
                nxt,
                lambda: dist.isend(
                    self._full(P2P_N, 1 << self.rank), dst=self.g[nxt], group=self.group
                ),
            ),
        ):
            try:
                works.append((direction, peer, call()))
            except Exception as e:  # noqa: BLE001
                errors.append((direction, peer, describe(e)))
        for direction, peer, work in works:
            try:
                work.wait()
                if direction == "recv" and _uniform(buf, "p2p") != 1 << prv:
                    raise BadData(f"p2p from {prv}: got {int(buf[0])}")
            except BadData as e:
                return ("p2p", "bad", None, None, str(e))
            except Exception as e:  # noqa: BLE001
                errors.append((direction, peer, describe(e)))
        detail = (prv, nxt, errors, time.monotonic() - t0)
        return ("p2p", "err" if errors else "ok", None, None, detail)


def is_left_out(record) -> bool:
    return record[1] == "err" and "left out" in record[4]


# --- chaos: ops in a loop while ranks die --------------------------------------------------


def chaos_rank(rank, world_size, port, plan):
    """Runs ops of ``plan["kinds"]`` round-robin through a series of failure events.

    ``plan``: ``kinds``, ``timeout_s`` (op timeout), ``phase_limit_s``, ``warmup_rounds``,
    ``events``, each ``{"victims": [...], "mode": ..., "arm_at": i, ...}``. In phase ``e``
    (one per event) a victim arms its failure at the phase's op ``arm_at``:

    * ``"parent"``: sets the store key ``arm/<e>``; the parent kills (or stops) it;
    * ``"timer"``: kill -9 from a timer thread ``delay_frac`` x (the op's measured
      duration) after the op of index ``arm_at`` starts;
    * ``"between"``: kill -9 right after op ``arm_at`` returns;
    * ``"pause"``: after op ``arm_at``, sets ``arm/<e>`` and sleeps ``pause_s`` (the
      parent sends SIGSTOP meanwhile, and SIGCONT once the others moved on);
    * ``"slow"``: the rank in ``slowed`` sets ``arm/<e>`` before op ``arm_at`` and goes
      on, but not past that op before the parent, which stops it for less than the
      hang limit meanwhile, has resumed it (``resumed/<e>``): the stop lands inside op
      ``arm_at`` or while the others wait in the next one. Nobody leaves.

    The others run ops until one covers exactly the survivors, then one more round of
    every kind (all of which must cover exactly the survivors), and go on to the next
    phase. Every decision depends on op results only, which all survivors share, so they
    stay in step. A rank that learns it was left out returns at once.
    """
    device = plan.get("device", "cpu")
    active, store = start_rank(
        rank,
        world_size,
        port,
        backend="mooncake" if device == "cuda" else "mooncake-cpu",
        timeout_s=plan["timeout_s"],
    )
    ops = Ops(rank, world_size, active, device=device)
    kinds = plan["kinds"]
    n = len(kinds)
    log = []
    durations = {}
    for i in range(plan["warmup_rounds"] * n):
        t0 = time.monotonic()
        rec = ops.run(kinds[i % n], i)
        durations[kinds[i % n]] = time.monotonic() - t0
        log.append((0, i, rec))
    warm_paths = pg.get_op_paths()
    members = set(range(world_size))
    # Roots come from the member set of the last op every survivor completed (an op
    # result they share), never from the local view, which changes at different
    # moments on different ranks.
    shared = list(range(world_size))
    phase_s = []
    for e, event in enumerate(plan["events"], start=1):
        target = members - set(event["victims"])
        victim = rank in event["victims"] or rank in event.get("slowed", ())
        t_phase = time.monotonic()
        converged_at = None
        i = 0
        while converged_at is None or i < converged_at + n:
            kind = kinds[i % n]
            arm = victim and i == event["arm_at"]
            if arm and event["mode"] != "pause":
                store.set(f"arm/{e}", str(rank))
                if event["mode"] == "timer":
                    kill_self_after(event["delay_frac"] * durations[kind])
            root = shared[i % len(shared)] if kind in ROOTED_KINDS else None
            rec = ops.run(kind, i, root=root)
            log.append((e, i, rec))
            if kind in MASK_KINDS and rec[1] == "ok":
                shared = ranks_of(rec[3])
            if is_left_out(rec):
                return _chaos_result(log, active, phase_s, warm_paths)
            if arm and event["mode"] == "between":
                os.kill(os.getpid(), signal.SIGKILL)
            if arm and event["mode"] == "pause":  # the parent stops this process meanwhile
                store.set(f"arm/{e}", str(rank))
                time.sleep(event["pause_s"])
            if arm and event["mode"] == "slow":
                deadline = time.monotonic() + 60
                while not store.check([f"resumed/{e}"]) and time.monotonic() < deadline:
                    time.sleep(0.001)
            i += 1
            if converged_at is None and kind in MASK_KINDS and rec[3] == bits(target):
                converged_at = i
                phase_s.append(time.monotonic() - t_phase)
            if time.monotonic() - t_phase > plan["phase_limit_s"]:
                log.append((e, i, ("phase", "err", None, None, "phase limit reached")))
                return _chaos_result(log, active, phase_s, warm_paths)
        store.set(f"done/{e}/{rank}", "1")
        members = target
    return _chaos_result(log, active, phase_s, warm_paths)


def _chaos_result(log, active, phase_s, warm_paths):
    return {
        "log": log,
        "active": active.tolist(),
        "synced": pg.get_num_synced_ranks(),
        "phase_s": phase_s,
        # Ops served by the device plane / staged (CUDA tensors), after the warm-up and at
        # the end: a device run must have used the plane, also among the survivors.
        "op_paths": (warm_paths, pg.get_op_paths()),
    }


# --- a rank that is alive but late -------------------------------------------------------


def late_rank(rank, world_size, port, plan):
    """Small all_reduces in steps; in step ``s`` rank ``plan["late"][s][0]`` sleeps
    ``plan["late"][s][1]`` seconds before the step's first op (a live rank that does not
    call the op in time). Records ``(step, op, record, seconds)``; a rank that learns it
    was left out returns."""
    active, _ = start_rank(rank, world_size, port, timeout_s=plan["timeout_s"])
    ops = Ops(rank, world_size, active)
    log = []
    for s, (late, delay) in enumerate(plan["late"]):
        for j in range(3):  # the late op, then two more
            if rank == late and j == 0:
                time.sleep(delay)
            t0 = time.monotonic()
            rec = ops.run("ar", 0)
            log.append((s, j, rec, time.monotonic() - t0))
            if is_left_out(rec):
                return {"log": log, "active": active.tolist(), "left_out": True}
    return {"log": log, "active": active.tolist(), "left_out": False}


def stopped_peer_recv_rank(rank, world_size, port, plan):
    """World 2: rank 1 is stopped (SIGSTOP) by the parent; rank 0 receives from it, then
    runs an all_reduce. Rank 0 returns ``[(outcome, seconds), (outcome, seconds)]``."""
    active, store = start_rank(rank, world_size, port, timeout_s=plan["timeout_s"])
    Ops(rank, world_size, active).run("ar", 0)
    if rank == 1:
        store.set("stop_me", "1")
        time.sleep(600)  # stopped, then killed by the parent
        return None
    while not store.check(["stopped"]):
        time.sleep(0.005)
    out = []
    t0 = time.monotonic()
    try:
        dist.recv(torch.zeros(4), src=1)
        out.append(("ok", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001
        out.append((describe(e), time.monotonic() - t0))
    t0 = time.monotonic()
    rec = Ops(rank, world_size, active).run("ar", 0)
    out.append((rec, time.monotonic() - t0))
    store.set("finished", "1")
    return out


def destroyed_peer_rank(rank, world_size, port, plan):
    """World 3: rank 2 destroys its process group and lives on; ranks 0 and 1 then run an
    all_reduce. Ranks 0 and 1 return ``(record, seconds)`` of that op."""
    active, store = start_rank(rank, world_size, port, timeout_s=plan["timeout_s"])
    Ops(rank, world_size, active).run("ar", 0)
    store.set(f"round1/{rank}", "1")
    store.wait([f"round1/{r}" for r in range(world_size)])
    if rank == 2:
        dist.destroy_process_group()
        store.set("destroyed", "1")
        store.wait(["finished/0", "finished/1"])
        return None
    store.wait(["destroyed"])
    t0 = time.monotonic()
    rec = Ops(rank, world_size, active).run("ar", 1)
    out = (rec, time.monotonic() - t0)
    store.set(f"finished/{rank}", "1")
    return out


# --- p2p with a dead peer ------------------------------------------------------------------


def caught_as_runtime_error(fn) -> tuple:
    """Runs ``fn``, which must raise: ``(type name, .ranks or None, message)`` of the
    RuntimeError it raised (a PeerFailedError is one), or ``("ok", None, "")``."""
    try:
        fn()
    except RuntimeError as e:
        return (type(e).__name__, getattr(e, "ranks", None), str(e)[:400])
    return ("ok", None, "")


def p2p_dead_peer_rank(rank, world_size, port, plan):
    """World 4: rank 2 dies. Rank 0 receives from it, rank 1 sends a small and a big
    message to it, ranks 0 and 3 exchange messages; then a broadcast from the dead rank
    (the op that notices its death), a collective, and the same again; last, every
    rooted op with the dead rank as root. Records ``(step, "ok"|error, seconds)``, and
    the rooted ops under ``dead_root/...``."""
    active, store = start_rank(rank, world_size, port, timeout_s=plan["timeout_s"])
    ops = Ops(rank, world_size, active)
    dead = 2
    out = {"pre": ops.run("ar", 0)}
    if rank == dead:
        store.set("dying", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    while not store.check(["dead"]):  # the parent saw it die
        time.sleep(0.005)

    def attempt(name, fn):
        t0 = time.monotonic()
        try:
            fn()
            out[name] = ("ok", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001
            out[name] = (describe(e), time.monotonic() - t0)

    for stage in ("before", "after"):  # before / after a collective noticed the death
        if rank == 0:
            attempt(f"{stage}/recv", lambda: dist.recv(torch.zeros(4), src=dead))
            attempt(f"{stage}/irecv", lambda: dist.irecv(torch.zeros(4), src=dead).wait())
        if rank == 1:
            attempt(f"{stage}/isend_small", lambda: dist.isend(torch.ones(4), dst=dead).wait())
            attempt(f"{stage}/send_small", lambda: dist.send(torch.ones(4), dst=dead))
            attempt(f"{stage}/send_big", lambda: dist.send(torch.ones(1 << 16), dst=dead))
        if rank in (0, 3):  # live peers keep talking
            peer = 3 - rank
            got = torch.zeros(P2P_N)

            def exchange(peer=peer, got=got):
                w = dist.isend(torch.full((P2P_N,), float(rank)), dst=peer)
                dist.recv(got, src=peer)
                w.wait()
                assert int(got.min()) == int(got.max()) == peer, got

            attempt(f"{stage}/live", exchange)
        if stage == "before":
            out["dead_root/bcast_first"] = caught_as_runtime_error(
                lambda: dist.broadcast(torch.zeros(4), src=dead)
            )
            out["collective"] = ops.run("ar", 0)
    out["dead_root/bcast"] = caught_as_runtime_error(
        lambda: dist.broadcast(torch.zeros(4), src=dead)
    )
    for kind in ("scatter", "reduce", "gather"):
        out[f"dead_root/{kind}"] = ops.run(kind, 0, root=dead)
    out["final"] = ops.run("ar", 0)
    out["active"] = active.tolist()
    return out


def stay_until_done(store, rank, ranks, timeout_s=60.0) -> None:
    """Marks this rank done and waits (bounded) until ``ranks`` all are: a rank that
    leaves looks like a failure to those still running ops."""
    store.set(f"done/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    while not store.check([f"done/{r}" for r in ranks]) and time.monotonic() < deadline:
        time.sleep(0.005)


# --- MOONCAKE_RECOVER=0 --------------------------------------------------------------------


def no_recover_rank(rank, world_size, port, plan):
    """Rank 1 dies; the others run each kind of op and record what happens."""
    active, store = start_rank(rank, world_size, port, timeout_s=plan["timeout_s"])
    ops = Ops(rank, world_size, active)
    log = [ops.run("ar", 0)]
    if rank == 1:
        store.set("dying", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    while not store.check(["dead"]):
        time.sleep(0.005)
    timed = []
    for i, kind in enumerate(("ar", "ar_big", "ag", "ar")):
        t0 = time.monotonic()
        timed.append((ops.run(kind, i), time.monotonic() - t0))
    # A survivor that left early would be a second failure the other survivor could meet
    # first (and name) in its own ops.
    stay_until_done(store, rank, (0, 2))
    return {"log": log, "timed": timed, "active": active.tolist()}


# --- elastic: replacements, extensions, joiners that die ------------------------------------


def battery(ops: Ops, kinds) -> list:
    """Every kind once, rooted kinds once with each member as the root."""
    recs = []
    for kind in kinds:
        if kind in ROOTED_KINDS:
            for root in members_of(ops.active):
                recs.append(ops.run(kind, 0, root=root))
        else:
            recs.append(ops.run(kind, 0))
    return recs


def _attempt(fn):
    try:
        value = fn()
        return ("ok", value if isinstance(value, (bool, int, list, type(None))) else None)
    except Exception as e:  # noqa: BLE001
        return ("err", describe(e))


def bad_input_checks(rank: int, ops: Ops, plan) -> list:
    """Elastic-API misuse on a healthy group (world 3, max_world_size 5, nobody waiting);
    each call is followed by an all_reduce that shows the group still works. Returns
    ``[(name, outcome, mask of the next all_reduce)]``."""
    W = dist.group.WORLD
    mws = plan["max_world_size"]
    calls = [
        ("recover_live", lambda: pg.recover_ranks(W, [1])),
        ("recover_out_of_range", lambda: pg.recover_ranks(W, [mws + 2])),
        ("recover_negative", lambda: pg.recover_ranks(W, [-1])),
        ("recover_not_extended", lambda: pg.recover_ranks(W, [mws - 1])),
        ("recover_empty", lambda: pg.recover_ranks(W, [])),
        ("recover_not_a_list", lambda: pg.recover_ranks(W, 3)),
        ("extend_beyond_max", lambda: pg.extend_group_size_to(W, mws + 1)),
        ("extend_below_size", lambda: pg.extend_group_size_to(W, 2)),
        ("peer_state_out_of_range", lambda: pg.get_peer_state(W, [mws])),
        ("join_group_not_extension", lambda: pg.join_group(W)),
        ("extend", lambda: pg.extend_group_size_to(W, mws)),
        ("peer_state_nobody_waits", lambda: pg.get_peer_state(W, [3, 4])),
        ("recover_nobody_waits", lambda: pg.recover_ranks(W, [3])),
        ("recover_twice_named", lambda: pg.recover_ranks(W, [3, 3])),
    ]
    out = []
    for name, call in calls:
        outcome = _attempt(call)
        rec = ops.run("ar", 0)
        out.append((name, outcome, rec[3] if rec[1] == "ok" else rec[4]))
    return out


def elastic_rank(rank, world_size, port, plan):
    """A member (``plan["role"] == "member"``) or a joiner of an elastic group.

    Everyone loops: a MAX all_reduce of a control vector (stop, battery wanted, iteration,
    the previous mask, which ranks were probed), so that a joiner learns the shared state
    and every decision below is the same on every member; then a small all_reduce whose
    mask says who is in. When every rank of ``plan["full"]`` is in and a battery is wanted
    (after a join), all run the battery (``plan["battery"]``) and each process sets
    ``full/<rank>/<pid>`` in the store. Members poll ``get_peer_state`` for the missing
    ranks and admit those that wait. For a rank of ``plan["probe_ranks"]``, the first time
    it goes missing after being a member, the members first call ``recover_ranks`` on it while nobody waits to
    replace it, record what happens, and ``plan["survivor"]`` sets ``probed/<rank>``.
    ``plan["survivor"]`` also samples its fds, threads and RSS after every battery, notes
    every change of the small all_reduce's mask with its time (``changes``) and counts,
    per rank, how often it saw it leave (store key ``dropped/<rank>``). The
    store key ``stop`` ends the loop. With ``plan["transports"]``, each process records
    at the end which transport reaches each other member (``transports``).

    A joiner with ``plan["doom"]`` dies on purpose: ``before_init``, ``waiting`` (after
    init, before join_group), ``in_join`` (a timer inside join_group; at the latest when it
    returns) or ``after_join`` (right after join_group returns, before any op).
    A joiner with ``plan["may_fail"]`` returns the error it meets instead of raising.
    """
    joiner = plan["role"] == "joiner"
    W = dist.group.WORLD
    pid = os.getpid()
    out = {
        "log": [],
        "batteries": [],
        "recover": [],
        "probes": [],
        "samples": [],
        "bad": [],
        "changes": [],
    }
    if joiner:
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", category=FutureWarning)
        store = client_store(port, world_size)
        doom = plan.get("doom")
        store.set(f"joining/{rank}/{pid}", "1")
        if doom == "before_init":
            os.kill(pid, signal.SIGKILL)
        try:
            active = init_rank(
                rank,
                world_size,
                port,
                timeout_s=plan["timeout_s"],
                max_world_size=plan.get("joiner_max_world_size", plan["max_world_size"]),
                is_extension=True,
            )
            if doom == "waiting":
                time.sleep(plan.get("doom_delay_s", 0.0))
                os.kill(pid, signal.SIGKILL)
            if doom == "in_join":
                kill_self_after(plan.get("doom_delay_s", 0.0))
            pg.join_group(W)
            if doom in ("in_join", "after_join"):  # an in_join timer that has not fired yet
                os.kill(pid, signal.SIGKILL)
        except Exception as e:  # noqa: BLE001
            if not plan.get("may_fail"):
                raise
            out["error"] = describe(e)
            return out
    else:
        active, store = start_rank(
            rank,
            world_size,
            port,
            timeout_s=plan["timeout_s"],
            max_world_size=plan["max_world_size"],
        )
    # Extended past the world size: the per-rank lists address every slot up to it.
    ops = Ops(rank, world_size, active, width=plan.get("extend_to"))
    if not joiner and plan.get("bad_input"):
        out["bad"] = bad_input_checks(rank, ops, plan)
    if plan.get("extend_to"):  # local: a joiner, too, must extend before recover_ranks
        pg.extend_group_size_to(W, plan["extend_to"])
    store.set(f"looping/{rank}/{pid}", "1")
    full = plan["full"]
    probe_ranks = plan.get("probe_ranks", [])
    want_battery = 0 if joiner else 1
    it, prev_mask = 0, 0
    probed = [0] * len(probe_ranks)
    replaced: set[int] = set()  # ranks admitted since the last battery
    seen = None  # the survivor's last mask
    while True:
        ctrl = torch.tensor(
            [int(store.check(["stop"])), want_battery, it, prev_mask, *probed], dtype=torch.int64
        )
        try:
            dist.all_reduce(ctrl, op=dist.ReduceOp.MAX)
        except Exception as e:  # noqa: BLE001
            out["log"].append((it, ("ctrl", "err", None, None, describe(e))))
            break
        stop, want_battery, it, prev_mask, *probed = ctrl.tolist()
        want_battery |= int(joiner and not out["batteries"])  # a joiner wants its battery
        it += 1
        if stop:
            break
        rec = ops.run("ar", 0)
        out["log"].append((it, rec))
        if rec[1] != "ok":
            if is_left_out(rec):
                break
            continue
        mask = rec[3]
        if rank == plan.get("survivor") and mask != seen:
            # When each change of membership reached this rank, and, per rank, how often
            # it was seen leaving (the parent waits on that).
            out["changes"].append((time.time(), mask))
            for r in full:
                if seen is not None and seen >> r & 1 and not mask >> r & 1:
                    store.add(f"dropped/{r}", 1)
            seen = mask
        missing = [r for r in full if not mask >> r & 1]
        if not missing and want_battery:
            if "ep" in plan["battery"]:
                ops.ep_rejoin()
            if "eep" in plan["battery"]:
                ops.eep_rejoin(store, sorted(replaced))
                replaced.clear()
            out["batteries"].append((it, battery(ops, plan["battery"])))
            want_battery = 0
            store.set(f"full/{rank}/{pid}", "1")
            if rank == plan.get("survivor"):
                out["samples"].append(process_resources())
        if missing:
            try:
                ready = pg.get_peer_state(W, missing)
            except Exception as e:  # noqa: BLE001
                out["recover"].append((it, missing, ("err", "get_peer_state " + describe(e))))
                prev_mask = mask
                continue
            for k, r in enumerate(probe_ranks):
                just_died = r in missing and prev_mask >> r & 1
                if just_died and not probed[k] and not ready[missing.index(r)]:
                    probed[k] = 1
                    out["probes"].append((it, r, _attempt(lambda r=r: pg.recover_ranks(W, [r]))))
                    if rank == plan.get("survivor"):
                        store.set(f"probed/{r}", "1")
            admit = [r for r, ok in zip(missing, ready, strict=True) if ok]
            if admit:
                outcome = _attempt(lambda admit=admit: pg.recover_ranks(W, admit))
                out["recover"].append((it, admit, outcome))
                if outcome[0] == "ok":
                    want_battery = 1
                    replaced.update(admit)
        prev_mask = mask
        time.sleep(plan["idle_s"])
    out["active"] = active.tolist()
    out["synced"] = pg.get_num_synced_ranks()
    if plan.get("transports"):  # a replacement on another host changes them
        backend = pg._backend_of(W)
        out["transports"] = {r: backend.transport_of(r) for r in members_of(active) if r != rank}
    return out


# --- subgroups -----------------------------------------------------------------------------

SUBGROUPS = {"A": [1, 2, 3], "B": [0, 2]}


def subgroup_rank(rank, world_size, port, plan):
    """World 4 with subgroups A = [1, 2, 3] and B = [0, 2]; rank 2 dies and is replaced.

    Every process runs a battery on each group it is in (WORLD, A, B) before the death,
    after it, and after the replacement joined: the members call recover_ranks on WORLD
    (which recovers it in the subgroups that hold it); the joiner creates the subgroups
    in the same order as the members did, then calls join_group on WORLD. Returns
    ``{stage: {group: (records, active_ranks, synced)}}``.
    """
    joiner = plan["role"] == "joiner"
    W = dist.group.WORLD
    if joiner:
        active, store = start_rank(
            rank,
            world_size,
            port,
            barrier=False,  # the healthy ranks are in the group already
            timeout_s=plan["timeout_s"],
            max_world_size=world_size,
            is_extension=True,
        )
    else:
        active, store = start_rank(
            rank, world_size, port, timeout_s=plan["timeout_s"], max_world_size=world_size
        )
    groups = {"W": (W, active, list(range(world_size)))}
    for name, ranks in SUBGROUPS.items():
        act = torch.ones(len(ranks), dtype=torch.int32)
        opts = pg.MooncakeBackendOptions(act, joiner, len(ranks))
        grp = dist.new_group(ranks, pg_options=opts)  # every rank creates every group
        if rank in ranks:
            groups[name] = (grp, act, ranks)
    out = {}

    def stage(tag):
        out[tag] = {}
        for name in ("A", "B", "W"):
            if name not in groups:
                continue
            grp, act, ranks = groups[name]
            ops = Ops(ranks.index(rank), len(ranks), act, group=grp, global_ranks=ranks)
            recs = battery(ops, KINDS)
            out[tag][name] = (recs, act.tolist(), pg.get_num_synced_ranks(grp))

    if joiner:
        pg.join_group(W)  # joins the subgroups created before, too
        stage("after_join")
        return out
    stage("before")
    victim = plan["victim"]
    if rank == victim:
        store.set("dying", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    while not store.check(["dead"]):
        time.sleep(0.005)
    stage("after_death")
    admit(W, [victim])  # recovers it in the subgroups that hold it, too
    stage("after_join")
    return out


# --- mismatched max_world_size --------------------------------------------------------------


def mismatched_capacity_rank(rank, world_size, port, plan):
    """Each rank creates the group with its own ``max_world_size``; returns what init did
    (``("ok", mask of an all_reduce)`` or ``("err", message)``) and how long it took."""
    torch.set_num_threads(1)
    t0 = time.monotonic()
    try:
        active, _ = start_rank(
            rank,
            world_size,
            port,
            timeout_s=plan["timeout_s"],
            max_world_size=plan["max_world_size"][rank],
        )
    except Exception as e:  # noqa: BLE001
        return ("err", describe(e), time.monotonic() - t0)
    rec = Ops(rank, world_size, active).run("ar", 0)
    return ("ok", rec, time.monotonic() - t0)


def uneven_extension_rank(rank, world_size, port, plan):
    """World 3, max_world_size 4: only rank 0 calls extend_group_size_to(4) (it is local);
    a joiner waits as rank 3; every member calls recover_ranks([3]), then three
    all_reduces. Returns ``[outcome of recover_ranks, record, record, record]``."""
    if plan["role"] == "joiner":
        torch.set_num_threads(1)
        active = init_rank(
            rank, world_size, port, timeout_s=plan["timeout_s"], max_world_size=4, is_extension=True
        )
        return _attempt(lambda: pg.join_group())
    active, store = start_rank(
        rank, world_size, port, timeout_s=plan["timeout_s"], max_world_size=4
    )
    W = dist.group.WORLD
    ops = Ops(rank, world_size, active)
    if rank == 0:
        pg.extend_group_size_to(W, 4)
    store.set(f"ready/{rank}", "1")
    out = [_attempt(lambda: admit(W, [3]))]
    out += [ops.run("ar", 0) for _ in range(3)]
    stay_until_done(store, rank, range(world_size))
    return out


def wrong_capacity_join_rank(rank, world_size, port, plan):
    """World 2 with max_world_size 3, extended to 3; a joiner for slot 2 is created with
    max_world_size 4. The members admit it when it waits (recover_ranks), then everyone
    runs three all_reduces. Returns ``[outcome of recover_ranks / join_group, records]``."""
    torch.set_num_threads(1)
    W = dist.group.WORLD
    if plan["role"] == "joiner":
        store = client_store(port, world_size)
        active = init_rank(
            rank, world_size, port, timeout_s=plan["timeout_s"], max_world_size=4, is_extension=True
        )
        first = _attempt(lambda: pg.join_group(W))
    else:
        active, store = start_rank(
            rank, world_size, port, timeout_s=plan["timeout_s"], max_world_size=3
        )
        pg.extend_group_size_to(W, 3)
        deadline = time.monotonic() + 120
        while not all(pg.get_peer_state(W, [2])):
            if time.monotonic() > deadline:
                raise TimeoutError("the joiner never waited")
            time.sleep(0.01)
        first = _attempt(lambda: pg.recover_ranks(W, [2]))
    ops = Ops(rank, world_size, active)
    recs = [ops.run("ar", 0) for _ in range(3)] if first[0] == "ok" else []
    stay_until_done(store, rank, range(3))
    return [first, recs]
