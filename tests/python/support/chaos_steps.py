"""The checked steps of the chaos soak (test_gpu_chaos.py) and the failover benchmark
(bench/bench_ep_failover.py), rank side: one process's EP ``Buffer`` (process-group
mode), its elastic buffer, the group's collectives, and the faults a victim plays.

Every result is checked against a model that shares nothing with the library:

* EP calls against ``ep_cases``' plain-Python routing model (``route_model``,
  ``combine_model``) through its ``Round`` checks: every rank makes every rank's
  inputs from ``(seed, tag)``, so each knows what every peer sent; BF16 rows and
  combined tokens bit for bit, FP8 data and scales exactly ``mooncake.fp8.quantize`` of
  the source's tokens and the combine within its error bound. A rank that the call
  masked counts as having sent nothing (all of its rows or none, per the mask).
* The elastic buffer through ``elastic_round.play_round`` (the same model).
* Collectives through ``ft_ranks.Ops``: rank ``r`` contributes ``1 << r``, so a sum, and
  which slices of a gather or all-to-all hold data, spell the set of ranks covered.

On CUDA (``device == "cuda"``) the calls take CUDA tensors (the EP device path, the
``mooncake`` backend's device plane) and the checks read CPU copies. A step's time
(:meth:`Steps.ep`) covers the dispatch, the experts (on the same device) and the combine,
up to the synchronised result, and nothing else: the checks come after it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import capture
from elastic_round import SPEC as EEP_SPEC
from elastic_round import ElasticRound, play_round
from ep_cases import Checks, Spec, dequant, expert_fn, seed_for
from ft_ranks import Ops, bits, describe, ranks_of
from mooncake.launch import process_resources
from mooncake.mooncake_ep_buffer import DispatchHandle

#: The collectives a battery runs (ft_ranks.Ops kinds): a small and a chunked all_reduce,
#: all_gather_into_tensor and all_to_all_single.
COLLECTIVES = ("ar", "ar_big", "ag", "a2a")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now() -> float:
    """``time.monotonic()``: CLOCK_MONOTONIC on Linux, one clock for every process of the
    host, so stamps taken in different ranks compare."""
    return time.monotonic()


def busy(ms: float, device: torch.device) -> None:
    """``ms`` of busy computation: a matmul loop on the GPU, a spinning loop on the CPU
    (the heartbeat thread keeps running: a busy rank is alive)."""
    end = now() + ms / 1000
    if device.type == "cuda":
        a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
        b = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
        while now() < end:
            for _ in range(4):
                a = (a @ b).clamp_(-1, 1)
            torch.cuda.synchronize(device)
        return
    while now() < end:
        pass


def thread_names() -> dict[str, int]:
    """This process's threads by name (the library names its own "mc-..."; Python's
    carry the interpreter's name, the CUDA driver's its own)."""
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return names


def resources(device: torch.device) -> dict:
    """This process's fds, threads and RSS, and on CUDA its allocated bytes and the GPU's
    used bytes (every process's: what a leak of device memory would grow)."""
    out = dict(process_resources())
    out["thread_names"] = thread_names()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out["cuda_allocated"] = int(torch.cuda.memory_allocated(device))
        out["cuda_used"] = int(total - free)
    return out


class Steps:
    """One process's buffers and checked calls (see the module docstring).

    ``plan``: ``device``, ``spec`` (``ep_cases.Spec`` fields of the EP calls), ``seed``,
    ``timeout_us`` (the EP calls' budget), ``eep`` (whether there is an elastic buffer)
    and ``eep_timeout_ms``. ``active``: the group's ``active_ranks`` (for the collectives).
    """

    def __init__(self, rank: int, world: int, plan: dict, store, active: torch.Tensor):
        self.rank, self.world, self.plan, self.store = rank, world, plan, store
        cuda = plan["device"] == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        self.device = self.device or torch.device("cpu")
        self.chk = Checks(rank, world, plan.get("label", "chaos"))
        self.spec = Spec(**plan["spec"], timeout_us=plan["timeout_us"])
        self.E = self.spec.epr * world
        # The EP calls' active_ranks: one tensor kept across calls, as engines keep theirs;
        # set back to ones once a replacement has joined.
        self.act = torch.ones(world, dtype=torch.int32, device=self.device)
        self.ops = Ops(rank, world, active, device=self.device.type)
        self.buf = None
        self.eep = None
        self._graph = None  # graph_all_reduce's CUDA graph and its tensor
        self._graph_x = None
        self._ready = {}  # (tag, fp8): an ep call's model and inputs, made ahead (prepare)
        ElasticRound.device = self.device.type  # the elastic rounds' tensors

    # --- the buffers ---------------------------------------------------------------------

    def make_buffer(self) -> None:
        """The process group's EP Buffer (collective: a joiner's meets the others'
        ``update_ep_member``), with a device workspace on CUDA."""
        from mooncake.mooncake_ep_buffer import Buffer

        s = self.spec
        hint = Buffer.get_ep_buffer_size_hint(s.T, s.H, self.world, self.E)
        kw = {"device": "cuda"} if self.device.type == "cuda" else {}
        self.buf = Buffer(dist.group.WORLD, hint, **kw)
        if self.device.type == "cuda" and not self.buf.runtime.p2p_enabled():
            raise AssertionError(f"rank {self.rank}: the device path did not map every peer")

    def after_join(self, joined: list[int], wait_cards) -> None:
        """After ``pg.recover_ranks``: the Buffer takes the group's members again (the
        joiners make theirs), the EP mask goes back to ones, and the elastic buffer
        releases the old slots and connects the new processes, once ``wait_cards()``
        says that their elastic buffers exist (connect_ranks would wait for them by
        itself: it never takes a process that was left out, such as a stopped one)."""
        if self.buf is not None:
            self.buf.update_ep_member()
            if self.device.type == "cuda" and not self.buf.runtime.p2p_enabled():
                raise AssertionError(f"rank {self.rank}: not every peer mapped after the join")
        self.act.fill_(1)
        if self.eep is not None:
            wait_cards()
            self.eep.disconnect_ranks(joined)
            self.eep.connect_ranks(joined, activate=False)  # waits (bounded) for the joiner
            for r in joined:
                self.eep.update_mask_buffer(r, mask=False)

    def make_eep(self, made=None) -> None:
        """The elastic buffer: a slot per rank, connected to every other slot; ``made()``
        is called once it exists, before it connects."""
        from mooncake.mooncake_ep_buffer import Buffer

        cap, epr = self.world, EEP_SPEC.epr
        buf = Buffer.create_elastic(
            rank=self.rank,
            tcp_store_group=self.store,
            timeout_ms=self.plan["eep_timeout_ms"],
            metadata_timeout_ms=60_000,
            store_prefix="chaos-eep/",
        )
        hint = Buffer.get_ep_buffer_size_hint(EEP_SPEC.T, EEP_SPEC.H, cap, epr * cap)
        buf.update_memory_buffers(num_ranks=cap, num_experts_per_rank=epr, num_rdma_bytes=hint)
        if made is not None:
            made()
        others = [r for r in range(cap) if r != self.rank]
        buf.connect_ranks(others, activate=False)
        for r in others:
            buf.update_mask_buffer(r, mask=False)
        self.eep = buf

    # --- EP through the process group's Buffer -----------------------------------------

    def _round(self, tag: str, fp8: bool) -> ElasticRound:
        """The model of a call: every rank's inputs for ``tag``; its views come from the
        mask this rank passes (``Round``'s rule: alike on every rank)."""
        spec = replace(self.spec, fp8=fp8)
        r = ElasticRound(
            self.chk, self.buf, spec, tag, seed_for(self.plan["seed"], tag), self.world, None, None
        )
        return r

    def _experts(self, recv_x, spec: Spec) -> torch.Tensor:
        """``ep_cases.expert_fn`` of every received row, on the rows' device."""
        epr = spec.epr
        if spec.fp8:
            data, scales = recv_x
            rows = [dequant(data[j], scales[j]) for j in range(epr)]
        else:
            rows = [recv_x[j] for j in range(epr)]
        return torch.stack([expert_fn(rows[j], self.rank * epr + j, spec) for j in range(epr)])

    def prepare(self, tag: str, fp8: bool) -> None:
        """Makes ``ep(tag, fp8)``'s model and inputs now (on the device), so that a fault
        timed from before that call meets the call itself, not the test's making of them."""
        r = self._round(tag, fp8)
        mine = r.ins[self.rank]
        dev = self.device
        self._ready[(tag, fp8)] = (r, mine.x.to(dev), mine.idx.to(dev), mine.w.to(dev))

    def ep(self, tag: str, fp8: bool, may_drop=(), must_drop=None) -> dict:
        """One timed dispatch + combine on the Buffer, then checked. ``may_drop`` /
        ``must_drop``: ranks the dispatch may / must mask (the combine may mask those
        too, and no other)."""
        if (tag, fp8) not in self._ready:
            self.prepare(tag, fp8)
        r, x, idx, w = self._ready.pop((tag, fp8))
        spec, dev = r.spec, self.device
        before = self.act.tolist()
        sync(dev)
        t0 = now()
        recv_x, count, handle, _, _ = self.buf.dispatch(
            x, idx, self.act, spec.T, self.E, spec.timeout_us, use_fp8=fp8
        )
        mid = self.act.clone()  # stream-ordered: the mask as the dispatch left it
        y = self._experts(recv_x, spec)
        out, _, _ = self.buf.combine(y, idx, w, self.act, spec.timeout_us, handle)
        sync(dev)
        t1 = now()
        path = self.buf.path
        # The checks, on CPU copies.
        r.act, r.before = mid.cpu(), before
        r.recv_x = tuple(t.cpu() for t in recv_x) if fp8 else recv_x.cpu()
        r.count = count.cpu()
        r.handle = DispatchHandle(handle.src_info.cpu(), handle.layout_range.cpu(), *handle[2:5])
        r.check_dispatch(may_drop=may_drop, must_drop=must_drop)
        r.cact, r.cbefore, r.combined = self.act.cpu(), r.act.tolist(), out.cpu()
        r.check_combine(may_drop=set(may_drop) | set(must_drop or ()))
        if dev.type == "cuda" and path != "device":
            self.chk.fail(f"{tag}: the call ran the {path} path, not the device path")
        return self._record(
            tag, "ep_fp8" if fp8 else "ep_bf16", t0, t1, ranks=self.act.tolist(), path=path
        )

    def launch_dispatch(self, tag: str, fp8: bool) -> None:
        """The victim's side of a kill inside a dispatch: its dispatch of ``tag`` is
        launched (device path: the kernels are queued; portable path: the counts are
        exchanged and the tokens' exchange started) and not finished."""
        r = self._round(tag, fp8)
        spec, dev = r.spec, self.device
        mine = r.ins[self.rank]
        x, idx = mine.x.to(dev), mine.idx.to(dev)
        sync(dev)
        hook = dev.type == "cpu"  # the portable path returns at once with its hook
        self.buf.dispatch(
            x, idx, self.act, spec.T, self.E, spec.timeout_us, use_fp8=fp8, return_recv_hook=hook
        )

    # --- the elastic buffer --------------------------------------------------------------

    def eep_call(self, tag: str, i: int, fp8: bool, plan, must_drop=None) -> dict:
        """Round ``i`` of the elastic buffer over the slots of ``plan``, checked (its
        inputs come from ``tag`` and ``i``, so every process must pass the same; its style
        from ``i``: ``elastic_round.STYLES``). The first call after a fault passes its
        mask explicitly, as the elastic device tests do."""
        style = {"fp8": fp8}
        if must_drop is not None:
            style.update(act="plan", R="bound")
        t0 = now()
        _, rec = play_round(
            self.chk,
            self.eep,
            self.plan["seed"],
            tag,
            i,
            plan,
            must_drop=must_drop,
            style=style,
        )
        t1 = now()
        self.chk.failures[:0] = rec["failures"]  # play_round took them out: put them back
        mask = torch.zeros(self.world, dtype=torch.int32)
        self.eep.query_mask_buffer(mask)
        return self._record(
            f"{tag}/eep{i}",
            "eep_fp8" if fp8 else "eep_bf16",
            t0,
            t1,
            ranks=[1 - int(v) for v in mask.tolist()],
            path=rec["path"],
        )

    # --- collectives ---------------------------------------------------------------------

    def collective(self, tag: str, kind: str, alive) -> dict:
        """``kind`` over the group; it must cover exactly ``alive``."""
        t0 = now()
        rec = self.ops.run(kind, 0)
        t1 = now()
        _, status, _, mask, detail = rec
        if status != "ok":
            self.chk.fail(f"{tag}: {kind} {status}: {detail}")
        elif mask != bits(alive):
            self.chk.fail(f"{tag}: {kind} covered {ranks_of(mask)}, want {sorted(alive)}")
        return self._record(f"{tag}/{kind}", kind, t0, t1, ranks=self._ranks(mask))

    def big_all_reduce(self, tag: str, nbytes: int, alive, old=None, victim=False) -> dict:
        """A float32 all_reduce of ``nbytes``, rank ``r`` contributing ``2**r``: the sum
        must be uniform and cover exactly ``alive``, or (the op a rank died in) ``old``.
        ``victim``: this rank issues it and returns at once (it dies inside)."""
        n = nbytes // 4
        x = torch.full((n,), float(1 << self.rank), dtype=torch.float32, device=self.device)
        sync(self.device)
        if victim:
            self._pending = (x, dist.all_reduce(x, async_op=True))
            return {}
        t0 = now()
        dist.all_reduce(x)
        sync(self.device)
        t1 = now()
        ranks = self._sum_covers(tag, "all_reduce", x, alive, old)
        return self._record(tag, "ar_64m", t0, t1, ranks=ranks)

    def graph_all_reduce(self, tag: str, nbytes: int, alive, warm: bool = True) -> dict:
        """A float32 all_reduce of ``nbytes`` (at most the device-driven kernels' bound)
        captured in a CUDA graph on this process's first call and replayed, rank ``r``
        contributing ``2**r``: the sum must be uniform and cover exactly ``alive``.
        ``warm``: an eager all_reduce of the graph's tensor first, on every rank alike (it
        sets the kernels up again after the group's ranks changed, as a replay needs);
        without it (the step right after a kill) the replay itself meets the lost rank."""
        n = nbytes // 4
        first = self._graph is None
        if first:
            self._graph_x = torch.zeros(n, dtype=torch.float32, device=self.device)
        x = self._graph_x
        if warm or first:
            dist.all_reduce(x)
            sync(self.device)
        if first:
            graph = torch.cuda.CUDAGraph()
            with capture.graph(graph):
                dist.all_reduce(x)
            self._graph = graph
        x.fill_(float(1 << self.rank))
        sync(self.device)
        t0 = now()
        self._graph.replay()
        sync(self.device)
        t1 = now()
        ranks = self._sum_covers(tag, "replayed all_reduce", x, alive)
        return self._record(tag, "graph_ar", t0, t1, ranks=ranks)

    def _sum_covers(self, tag: str, what: str, x, alive, old=None) -> list[int] | None:
        """The ranks an all_reduce of ``2**r`` from each rank ``r`` (``x``) covered, checked:
        uniform, and exactly ``alive`` or (the op a rank died in) ``old``."""
        lo, hi = float(x.min()), float(x.max())
        mask = int(lo) if lo == hi and lo == int(lo) else None
        allowed = {bits(alive)} | ({bits(old)} if old is not None else set())
        if mask is None:
            self.chk.fail(f"{tag}: {what} not uniform ({lo} .. {hi})")
        elif mask not in allowed:
            self.chk.fail(
                f"{tag}: {what} covered {ranks_of(mask)}, want {sorted(alive)}"
                + (f" or {sorted(old)}" if old is not None else "")
            )
        return self._ranks(mask)

    def _ranks(self, mask: int | None) -> list[int] | None:
        """``mask`` (bit r: rank r) as a 0/1 list per rank; None for none."""
        return [int(mask >> q & 1) for q in range(self.world)] if mask is not None else None

    # --- records -------------------------------------------------------------------------

    def _record(self, tag: str, kind: str, t0: float, t1: float, **extra) -> dict:
        rec = {"tag": tag, "kind": kind, "t0": t0, "t1": t1, "failures": list(self.chk.failures)}
        rec.update(extra)
        self.chk.failures.clear()
        return rec

    def events(self) -> list[str]:
        """Why the Buffer's device path masked peers so far."""
        return self.buf.mask_events() if self.buf is not None else []


# --- a victim's faults ----------------------------------------------------------------------


def stamp(store, key: str, what: str) -> float:
    """Notes in the store when this process fails, just before it does (the stamp is
    taken before the store's round trip: a measured interval is at most that much long)."""
    import json

    t = now()
    store.set(key, json.dumps({"t": t, "pid": os.getpid(), "what": what}))
    return t


def die(store, key: str, what: str) -> None:
    """kill -9 of this process, stamped (never returns)."""
    stamp(store, key, what)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: SIGKILL is not delivered late
    raise AssertionError("SIGKILL did not end the process")


def stop_self(store, key: str, what: str) -> float:
    """SIGSTOP of this whole process (every thread, the heartbeat included), stamped;
    returns when something (the parent) resumes it with SIGCONT: the time it resumed."""
    stamp(store, key, what)
    os.kill(os.getpid(), signal.SIGSTOP)
    return now()


def left_out_check(rank: int, device: torch.device, buf, eep=None) -> dict:
    """A resumed process the others left out: its next op on the group, its next EP
    dispatch (on the device path too: it launches nothing) and its elastic buffer's next
    dispatch must raise LeftOutError naming this rank."""
    from mooncake import LeftOutError

    out: dict = {}
    t0 = now()
    try:
        dist.all_reduce(torch.ones(1))
        out["op"] = "returned normally"
    except LeftOutError as e:
        out["op"] = "LeftOutError" if e.ranks == [rank] and "left out" in str(e) else describe(e)
    except Exception as e:  # noqa: BLE001  (reported)
        out["op"] = describe(e)
    out["op_ms"] = (now() - t0) * 1e3

    def ep_call(b, num_experts: int, T: int, H: int) -> str:
        x = torch.ones(1, H, dtype=torch.bfloat16, device=device)
        idx = torch.zeros(1, 1, dtype=torch.int64, device=device)
        try:
            b.dispatch(x, idx, None, T, num_experts, -1, use_fp8=False)
            return "returned normally"
        except LeftOutError as e:
            return "LeftOutError" if e.ranks == [rank] else describe(e)
        except Exception as e:  # noqa: BLE001
            return describe(e)

    if buf is not None:
        out["ep"] = ep_call(buf, buf.num_ranks, 1, 128)
    if eep is not None:
        epr = EEP_SPEC.epr
        out["eep"] = ep_call(eep, epr * eep.num_ranks, EEP_SPEC.T, EEP_SPEC.H)
    out["told"] = out["op"] == "LeftOutError" and all(
        out.get(k, "LeftOutError") == "LeftOutError" for k in ("ep", "eep")
    )
    return out
