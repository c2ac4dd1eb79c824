"""The rank side of test_ep_elastic.py: :func:`process_main`, run by elastic_parent.py in
the processes of a ``mooncake.launch.LocalGroup``.

One process holds one slot of an elastic EP buffer (``Buffer.create_elastic``) and plays
its part of a scenario's timeline (:data:`SCENARIOS`). There is no process group: the
processes meet only through the parent's ``TCPStore``. The parent
(``elastic_parent.Timeline``) starts every process, replacements included (a rank asks
for one with :meth:`Rank.request`), kills on request, and reads the JSON lines each
process appends to its own file:

* ``{"event": "round", "phase", "tag", "R", "plan", "view", "failures", ...}``: one
  dispatch + combine checked against the model (``elastic_round.play_round``);
* ``{"event": "check", "phase", "what", "failures", ...}``: other expectations (masks,
  slot states, timings), with the measured values the parent also checks;
* ``{"event": "phase", "phase"}``: this process finished a phase;
* ``{"event": "error", "traceback"}`` / ``{"event": "done"}``.

A round (``elastic_round``) covers ``R`` slots (``num_experts = epr * R``) with ``R``
between the rank bound and the capacity; the model routes among the slots active in this
process's view.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_round import SPEC, Aborted, ElasticRound, play_round
from ep_cases import (  # this file's folder is sys.path[0]
    Checks,
    expect_value_error,
)

# --- one process ----------------------------------------------------------------------------


class Rank:
    """One slot's process: the store, the result file, the checks and the round runner."""

    def __init__(self, cfg: dict, slot: int, gen: int, role: dict):
        self.cfg, self.slot, self.gen, self.role = cfg, slot, gen, role
        self.p = cfg["params"]
        self.cap, self.epr = self.p["capacity"], SPEC.epr
        self.store = dist.TCPStore(
            "127.0.0.1", cfg["port"], is_master=False, timeout=timedelta(seconds=60)
        )
        self.out = open(os.path.join(cfg["dir"], f"{slot}.{gen}.jsonl"), "a")
        self.chk = Checks(slot, self.cap, cfg["scenario"])
        # cumulative_local_expert_recv_stats over the process's life: (tensor, expected)
        self.stats_pair = tuple(torch.zeros(self.epr, dtype=torch.int32) for _ in range(2))
        self.phase = "start"

    # --- records and coordination ---

    def emit(self, event: str, **kw) -> None:
        rec = {"event": event, "slot": self.slot, "gen": self.gen, "t": time.time(), **kw}
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()

    def check(self, what: str, **values) -> None:
        """Emits the failures recorded since the last record (none: it held)."""
        self.emit("check", phase=self.phase, what=what, failures=list(self.chk.failures), **values)
        self.chk.failures.clear()

    def end_phase(self) -> None:
        self.emit("phase", phase=self.phase)

    def aborted(self) -> None:
        if self.store.check(["tl/abort"]):
            raise Aborted(self.store.get("tl/abort").decode())

    def wait_keys(self, keys: list[str], timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            self.aborted()
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise TimeoutError(
                    f"slot {self.slot}: store keys {missing} not set in {timeout_s} s"
                )
            time.sleep(0.005)

    def sync(self, name: str, slots, timeout_s: float = 90.0) -> None:
        """A store barrier of ``slots`` (each process of a slot calls it once per name)."""
        self.store.set(f"tl/sync/{name}/{self.slot}", "1")
        self.wait_keys([f"tl/sync/{name}/{s}" for s in slots], timeout_s)

    def request(self, op: str, **kw) -> None:
        """Asks the parent to ``spawn`` a process for a slot or to ``kill`` one."""
        n = self.store.add("tl/req_seq", 1) - 1
        self.store.set(f"tl/req/{n}", json.dumps({"op": op, "by": self.slot, **kw}))

    # --- the buffer ---

    def make_buffer(self):
        from mooncake.mooncake_ep_buffer import Buffer

        buf = Buffer.create_elastic(
            rank=self.slot,
            tcp_store_group=self.store,
            timeout_ms=self.p["timeout_ms"],
            metadata_timeout_ms=self.p.get("metadata_timeout_ms", 60000),
            store_prefix="ep/",
        )
        hint = Buffer.get_ep_buffer_size_hint(SPEC.T, SPEC.H, self.cap, self.epr * self.cap)
        buf.update_memory_buffers(
            num_ranks=self.cap, num_experts_per_rank=self.epr, num_rdma_bytes=hint
        )
        self.expect_slots(buf, [self.slot], "after update_memory_buffers")
        return buf

    def mask(self, buf) -> list[int]:
        out = torch.full((self.cap,), 7, dtype=torch.int32)
        buf.query_mask_buffer(out)
        return out.tolist()

    def expect_slots(self, buf, active, what: str, staged=(), disconnected=None) -> None:
        """The buffer's view: exactly ``active`` active (mask 0, rank bound max + 1),
        ``staged`` staged, ``disconnected`` (default: all others) disconnected."""
        active = sorted(active)
        mask = self.mask(buf)
        want = [0 if s in active else 1 for s in range(self.cap)]
        c = self.chk
        c.expect(mask == want, f"{what}: query_mask_buffer {mask}, want {want}")
        c.expect(
            buf.active_slots == active, f"{what}: active_slots {buf.active_slots}, want {active}"
        )
        bound = max(active) + 1
        c.expect(buf.rank_bound == bound, f"{what}: rank_bound {buf.rank_bound}, want {bound}")
        if disconnected is None:
            disconnected = [s for s in range(self.cap) if s not in active and s not in staged]
        for s, state in [(s, "active") for s in active] + [(s, "staged") for s in staged]:
            got = buf.slot_state(s)
            c.expect(got == state, f"{what}: slot_state({s}) {got!r}, want {state!r}")
        for s in disconnected:
            got = buf.slot_state(s)
            c.expect(got == "disconnected", f"{what}: slot_state({s}) {got!r}, want disconnected")

    def publish(self, buf, peers) -> None:
        for p in peers:
            buf.update_mask_buffer(p, mask=False)

    # --- rounds ---

    def round(self, buf, i: int, plan, **kw):
        """Round ``i`` of the current phase (see :func:`play_round`), recorded."""
        self.aborted()
        r, rec = play_round(
            self.chk, buf, self.p["seed"], self.phase, i, plan, stats=self.stats_pair, **kw
        )
        self.emit("round", **rec)
        return r

    def rounds(self, buf, n: int, plan, start: int = 0, **kw) -> None:
        for i in range(start, start + n):
            self.round(buf, i, plan, **kw)

    def connected_rounds(self, buf, plan, activate: bool = False) -> None:
        """The current phase: ``buf`` connects to the other slots of ``plan``, every
        one of them is checked connected, and the rounds run among them."""
        peers = others(plan, self.slot)
        buf.connect_ranks(peers, activate=activate)
        self.publish(buf, peers)
        self.expect_slots(buf, plan, "connected")
        self.check("connected")
        self.sync(self.phase, plan)
        self.rounds(buf, self.p["rounds"], plan)
        self.end_phase()


def others(slots, me):
    return [s for s in slots if s != me]


# --- growth: 1 -> 2 -> 4 -> 8 -> 16, then clean removal ------------------------------------


def growth(rk: Rank) -> None:
    """Slot 0 alone (plan 1), then growth through ``stages`` (plans 2 and 3): slot 0 asks
    the parent for each stage's new processes; they connect to everyone, the others connect
    to them; everyone publishes, then rounds. Last, clean removal (plan 4): the slots of
    ``removed`` disconnect everyone, run a round alone and exit; the rest disconnect them
    and go on (a sparse set)."""
    p, me = rk.p, rk.slot
    stages, n = p["stages"], p["rounds"]
    first = next(i for i, size in enumerate(stages) if me < size)
    buf = rk.make_buffer()
    rk.check("buffer")
    if first == 0:
        rk.phase = "solo"
        rk.expect_slots(buf, [me], "alone")
        rk.chk.expect(buf.barrier() == [me], "barrier alone")
        rk.chk.expect(buf.transport_of(me) == "self", f"transport_of(self) {buf.transport_of(me)}")
        rk.check("alone")
    else:
        rk.phase = f"grow{stages[first]}"
        everyone = list(range(stages[first]))
        buf.connect_ranks(others(everyone, me), activate=False)
        rk.expect_slots(buf, [me], "connected, unpublished", staged=others(everyone, me))
        rk.publish(buf, others(everyone, me))
        rk.expect_slots(buf, everyone, "published")
        rk.check("joined")
    for si in range(first, len(stages)):
        everyone = list(range(stages[si]))
        if si > first:
            rk.phase = f"grow{stages[si]}"
            old, new = list(range(stages[si - 1])), list(range(stages[si - 1], stages[si]))
            if me == 0:
                for s in new:
                    rk.request("spawn", slot=s)
            buf.connect_ranks(new, activate=False)
            rk.expect_slots(buf, old, "new peers staged", staged=new)
            rk.publish(buf, new)
            rk.expect_slots(buf, everyone, "new peers published")
            rk.check("grew")
        rk.sync(rk.phase, everyone)
        if len(everyone) > 1:
            peer = everyone[-1] if me != everyone[-1] else everyone[0]
            rk.check("transport", transport=buf.transport_of(peer))
        rk.rounds(buf, n, everyone)
        rk.end_phase()

    # Clean removal.
    rk.phase = "remove"
    everyone = list(range(stages[-1]))
    removed = p["removed"]
    rest = [s for s in everyone if s not in removed]
    rk.sync("remove", everyone)
    if me in removed:
        buf.disconnect_ranks(others(everyone, me))
        rk.expect_slots(buf, [me], "removed: disconnected from everyone")
        rk.check("removed")
        rk.round(buf, 0, [me])  # alone: nothing goes anywhere
        rk.end_phase()
        return
    buf.disconnect_ranks(removed)
    rk.expect_slots(buf, rest, "after removal")
    rk.check("removal")
    rk.sync("removed", rest)
    rk.rounds(buf, n, rest)
    rk.end_phase()


# --- faults: a killed rank and its replacement; then the sparse layout ----------------------


def victim_gen(cycles, c: int) -> int:
    """The generation of the process that cycle ``c`` kills (earlier cycles replaced it)."""
    v = cycles[c]["victim"]
    return sum(1 for cy in cycles[:c] if cy["victim"] == v)


def fault(rk: Rank) -> None:
    """Slots ``0..world-1`` of capacity 16. Per cycle (``cycles``) the parent kills one
    slot's process (SIGKILL): ``between`` rounds (it asks for the kill after round ``arm``
    and waits for it; the survivors' next round must mask exactly it, within timeout_ms),
    or ``mid`` rounds (it asks at round ``arm`` and goes on; the parent kills it
    ``delay`` s later, wherever it is; the survivors' rounds may mask it any time). The
    survivors check the mask, disconnect it, the lowest asks for a replacement (a new
    process in the same slot), everyone connects and publishes, then full rounds (plan
    5). Then, with ``sparse``, slots 1 and 2 leave cleanly and 0 and 3 go on (plan 6)."""
    p, me = rk.p, rk.slot
    world, n = list(range(p["world"])), p["rounds"]
    buf = rk.make_buffer()
    start = rk.role.get("cycle", -1) + 1
    if start == 0:  # an original process
        rk.phase = "full"
        # Odd slots activate at once, even ones stage and publish.
        buf.connect_ranks(others(world, me), activate=me % 2 == 1)
        if me % 2 == 0:
            rk.expect_slots(buf, [me], "staged", staged=others(world, me))
        rk.publish(buf, others(world, me))
    else:  # the replacement of cycle start - 1
        rk.phase = f"rejoin{start - 1}"
        buf.connect_ranks(others(world, me), activate=False)
        rk.publish(buf, others(world, me))
    rk.expect_slots(buf, world, "connected")
    rk.check("connected", transport=buf.transport_of(others(world, me)[0]))
    rk.sync(rk.phase, world)
    rk.rounds(buf, n, world)
    rk.end_phase()

    for c in range(start, len(p["cycles"])):
        cy = p["cycles"][c]
        v, arm = cy["victim"], cy["arm"]
        survivors = others(world, v)
        rk.phase = f"kill{c}"
        rk.sync(rk.phase, world)
        if me == v:
            victim(rk, buf, cy, world)  # never returns: killed, or it raises
        if cy["mode"] == "between":
            rk.rounds(buf, arm + 1, world)
            # The victim stopped after round `arm`: this round must mask exactly it.
            r = rk.round(buf, arm + 1, world, must_drop=(v,), style={"act": "plan", "R": "bound"})
            rk.chk.expect(rk.mask(buf)[v] == 1, f"query_mask_buffer[{v}] is not 1 after the round")
            rk.chk.expect(buf.slot_state(v) == "staged", f"slot_state({v}) {buf.slot_state(v)!r}")
            rk.check("detected", detect_s=r.dispatch_s, events=buf.mask_events())
            rk.rounds(buf, n, survivors, start=arm + 2)
        else:
            rk.rounds(buf, arm, world)
            for i in range(arm, arm + n):  # the victim dies during these, or after
                rk.round(buf, i, world, view=buf.active_slots, may_drop=(v,))
            rk.wait_keys([f"tl/killed/{v}/{victim_gen(p['cycles'], c)}"])
            t0 = time.monotonic()
            took = buf.barrier()
            detect_s = time.monotonic() - t0
            rk.chk.expect(took == survivors, f"barrier after the kill: {took}, want {survivors}")
            rk.chk.expect(rk.mask(buf)[v] == 1, f"query_mask_buffer[{v}] is not 1 after the kill")
            rk.check("detected", detect_s=detect_s, events=buf.mask_events())
            rk.rounds(buf, 2, survivors, start=arm + n)
        rk.end_phase()

        rk.phase = f"rejoin{c}"
        buf.disconnect_ranks([v])
        rk.expect_slots(buf, survivors, "victim disconnected")
        if me == min(survivors):
            rk.request("spawn", slot=v, role={"cycle": c})
        buf.connect_ranks([v], activate=False)  # waits for the replacement
        rk.expect_slots(buf, survivors, "replacement staged", staged=[v])
        rk.publish(buf, [v])
        rk.expect_slots(buf, world, "replacement published")
        rk.check("reconnected")
        rk.sync(rk.phase, world)
        rk.rounds(buf, n, world)
        rk.end_phase()

    if p.get("sparse"):
        sparse(rk, buf, world)


def victim(rk: Rank, buf, cy: dict, world) -> None:
    """The victim's side of a kill cycle: the parent kills it (SIGKILL); raises if not."""
    v, arm = rk.slot, cy["arm"]
    if cy["mode"] == "between":
        rk.rounds(buf, arm + 1, world)
        rk.request("kill", slot=v, delay_s=cy["delay"])
        time.sleep(60)
        raise RuntimeError(f"slot {v} asked to be killed and was not, in 60 s")
    rk.rounds(buf, arm, world)
    rk.request("kill", slot=v, delay_s=cy["delay"])
    for i in range(arm, arm + 400):
        rk.round(buf, i, world, view=buf.active_slots, may_drop=others(world, v))
    raise RuntimeError(f"slot {v} asked to be killed and was not, in 400 rounds")


def bad_dispatch(buf, num_experts: int):
    x = torch.zeros(4, SPEC.H, dtype=torch.bfloat16)
    idx = torch.zeros(4, 1, dtype=torch.int64)
    return buf.dispatch(x, idx, None, SPEC.T, num_experts, -1, use_fp8=False)


def sparse(rk: Rank, buf, world) -> None:
    """Slots 1 and 2 disconnect everyone and exit; 0 and 3 disconnect them and go on with
    rank bound 4: rounds with R = 4, 10 and 16 (recv_x [E/R, R*T, H], layout_range one
    column per slot). num_experts outside [epr * 4, epr * capacity], or not a multiple of
    epr, raises ValueError naming it, on both; when only slot 0 passes a bad one, slot 3
    is told that slot 0 rejected its arguments; rounds go on after each."""
    me, keep, leave = rk.slot, [0, 3], [1, 2]
    rk.phase = "sparse"
    rk.sync("sparse", world)
    if me in leave:
        buf.disconnect_ranks(others(world, me))
        rk.expect_slots(buf, [me], "left")
        rk.check("left")
        rk.end_phase()
        return
    buf.disconnect_ranks(leave)
    rk.expect_slots(buf, keep, "sparse")
    rk.check("sparse")
    rk.sync("sparse-go", keep)
    n = rk.p["rounds"]
    rk.rounds(buf, n, keep)
    epr, cap = rk.epr, rk.cap
    bad = {
        "below the rank bound": epr * 3,
        "above the capacity": epr * (cap + 1),
        "not a multiple of num_experts_per_rank": epr * 4 + 1,
    }
    for what, e in bad.items():
        expect_value_error(
            rk.chk, lambda e=e: bad_dispatch(buf, e), ["num_experts"], f"num_experts {what}"
        )
        rk.round(buf, n, keep)  # usable afterwards
    if me == 0:
        expect_value_error(rk.chk, lambda: bad_dispatch(buf, epr * 3), ["num_experts"], "one side")
    else:
        expect_value_error(
            rk.chk, lambda: bad_dispatch(buf, epr * 4), ["rank 0", "rejected"], "other"
        )
    rk.check("num_experts")
    rk.rounds(buf, 2, keep, start=n + 1)
    rk.end_phase()


# --- the 3-rank connection contract ---------------------------------------------------------


def contract(rk: Rank) -> None:
    """Slots 0 and 1 start; slot 2 is started when slot 0 asks (capacity 4). Phases:
    ``staging`` (0 and 1 run rounds while a background thread connects slot 2, which stays
    masked until published), ``reconnect`` (disconnect and reconnect a live peer),
    ``toggle`` (mask and publish a live peer on both sides), ``barrier`` (8 barriers),
    ``timeout`` (slot 2 skips a round: 0 and 1 mask it after timeout_ms and go on; then
    everyone reconnects)."""
    me, pair, trio = rk.slot, [0, 1], [0, 1, 2]
    n = rk.p["rounds"]
    buf = rk.make_buffer()
    if me in pair:
        rk.phase = "pair"
        buf.connect_ranks([1 - me], activate=False)
        rk.publish(buf, [1 - me])
        rk.expect_slots(buf, pair, "pair")
        rk.check("pair", transport=buf.transport_of(1 - me))
        rk.sync("pair", pair)
        rk.rounds(buf, n, pair)
        rk.end_phase()
        staging(rk, buf)
    else:
        rk.phase = "staging"
        buf.connect_ranks(pair, activate=False)
        rk.expect_slots(buf, [me], "newcomer", staged=pair)
        rk.check("newcomer", transport=buf.transport_of(0))
        rk.round(buf, 0, [me])  # alone while staged
        rk.sync("publish2", trio)
        rk.expect_slots(buf, [me], "newcomer before publishing", staged=pair)
        rk.publish(buf, pair)
        rk.expect_slots(buf, trio, "newcomer published")
        rk.check("published")
        rk.sync("trio", trio)
        rk.rounds(buf, n, trio, start=100)
        rk.end_phase()

    rk.phase = "reconnect"
    rk.sync(rk.phase, trio)
    if me in pair:
        buf.disconnect_ranks([2])
        rk.expect_slots(buf, pair, "2 disconnected")
        rk.check("disconnected")
        rk.rounds(buf, n, pair)
    else:
        buf.disconnect_ranks(pair)
        rk.expect_slots(buf, [me], "0 and 1 disconnected")
        rk.check("disconnected")
        rk.rounds(buf, 2, [me], start=100)
    rk.sync("reconnect-back", trio)
    if me == 0:
        buf.connect_ranks([2], activate=True)
    elif me == 1:
        buf.connect_ranks([2], activate=False)
        rk.expect_slots(buf, pair, "2 staged again", staged=[2])
        rk.publish(buf, [2])
    else:
        buf.connect_ranks(pair, activate=True)
    rk.expect_slots(buf, trio, "reconnected")
    rk.check("reconnected")
    rk.sync("reconnected", trio)
    rk.rounds(buf, n, trio, start=200)
    rk.end_phase()

    rk.phase = "toggle"
    rk.sync(rk.phase, trio)
    # Slot 2 runs its rounds first, with R = 4 where the pair's first has R = 2: a
    # masked peer that still stored signals into mapped workspaces by its own
    # layout would spoil the pair's first round every time, not by chance.
    if me in pair:
        buf.update_mask_buffer(2, mask=True)
        buf.update_mask_buffer(2, mask=True)  # idempotent
        rk.expect_slots(buf, pair, "2 masked", staged=[2])
        rk.check("masked")
        rk.sync("toggle-solo", trio)
        rk.rounds(buf, n, pair)
    else:
        for q in pair:
            buf.update_mask_buffer(q, mask=True)
        rk.expect_slots(buf, [me], "0 and 1 masked", staged=pair)
        rk.check("masked")
        rk.rounds(buf, 2, [me], start=100)  # checked on the host: its kernels are done
        rk.sync("toggle-solo", trio)
    rk.sync("toggle-back", trio)
    rk.publish(buf, others(trio, me))
    rk.publish(buf, others(trio, me))  # idempotent
    rk.expect_slots(buf, trio, "published again")
    rk.check("published")
    rk.sync("toggled", trio)
    rk.rounds(buf, n, trio, start=200)
    rk.end_phase()

    rk.phase = "barrier"
    rk.sync(rk.phase, trio)
    took = []
    for k in range(8):
        took.append(buf.barrier() if k % 2 == 0 else buf.barrier(timeout_ms=20000))
        if k in (3, 7):
            rk.round(buf, k, trio)
    rk.chk.expect(took == [trio] * 8, f"barriers returned {took}")
    rk.check("barriers", took=took)
    rk.end_phase()

    rk.phase = "timeout"
    rk.sync(rk.phase, trio)
    if me in pair:
        events = len(buf.mask_events())
        r = rk.round(buf, 0, trio, must_drop=(2,), style={"act": "plan", "R": "cap"})
        rk.chk.expect(rk.mask(buf)[2] == 1, "query_mask_buffer[2] is not 1 after the timeout")
        rk.chk.expect(buf.slot_state(2) == "staged", f"slot_state(2) {buf.slot_state(2)!r}")
        new = buf.mask_events()[events:]
        rk.chk.expect(len(new) == 1, f"mask_events after the timeout: {new}")
        rk.check("masked", dispatch_s=r.dispatch_s, events=new)
    rejoin_after_skip(rk, buf, trio, pair, skipped=2)


def rejoin_after_skip(rk: Rank, buf, trio, pair, skipped: int) -> None:
    """The end of a phase in which ``pair`` masked slot ``skipped`` for sitting out a
    round: the pair goes on alone while the skipped slot stays silent until both have
    returned; then the three reconnect and run full rounds."""
    me, n, tag = rk.slot, rk.p["rounds"], rk.phase
    if me in pair:
        rk.store.set(f"tl/{tag}/{me}", "1")
        rk.rounds(buf, n, pair, start=1)
        rk.sync(f"{tag}-rejoin", trio)
        buf.disconnect_ranks([skipped])
        buf.connect_ranks([skipped], activate=False)
        rk.publish(buf, [skipped])
    else:
        rk.wait_keys([f"tl/{tag}/{q}" for q in pair])
        rk.expect_slots(buf, trio, f"slot {skipped} after skipping a round")
        rk.check("skipped")
        rk.sync(f"{tag}-rejoin", trio)
        buf.disconnect_ranks(pair)
        buf.connect_ranks(pair, activate=False)
        rk.publish(buf, pair)
    rk.expect_slots(buf, trio, f"reconnected after the {tag} phase")
    rk.check("rejoined")
    rk.sync(f"{tag}-full", trio)
    rk.rounds(buf, n, trio, start=100)
    rk.end_phase()


def staging(rk: Rank, buf) -> None:
    """Slots 0 and 1: rounds among themselves while a background thread calls
    connect_ranks([2], activate=False); slot 0 asks for slot 2's process after round 2,
    so that the connect waits for it beside the traffic. The rounds go on until both have
    connected, plus two with slot 2 staged; it stays masked until published."""
    me, pair, trio = rk.slot, [0, 1], [0, 1, 2]
    rk.phase = "staging"
    done: dict = {}

    def connect() -> None:
        done["t0"] = time.monotonic()
        try:
            buf.connect_ranks([2], activate=False)
        except Exception as e:  # noqa: BLE001 - reported
            done["error"] = f"{type(e).__name__}: {e}"
        done["t1"] = time.monotonic()

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    spans, masked, after = [], [], 0
    for i in range(2000):
        if i == 2 and me == 0:
            rk.request("spawn", slot=2)
        t0 = time.monotonic()
        rk.round(buf, i, pair)
        spans.append((t0, time.monotonic()))
        masked.append(rk.mask(buf)[2])
        mine = "t1" in done
        rk.store.set(f"tl/stg/{me}/{i}", "1" if mine else "0")
        rk.wait_keys([f"tl/stg/{1 - me}/{i}"])
        theirs = rk.store.get(f"tl/stg/{1 - me}/{i}") == b"1"
        after += mine and theirs
        if after == 3:
            break
        time.sleep(0.01)
    thread.join(timeout=60)
    rk.chk.expect(not thread.is_alive() and "error" not in done, f"connect_ranks: {done}")
    during = [b - a for a, b in spans if a >= done.get("t0", 0) and b <= done.get("t1", 0)]
    rk.chk.expect(all(m == 1 for m in masked), f"slot 2's mask while staging: {masked}")
    rk.expect_slots(buf, pair, "staged beside traffic", staged=[2])
    rk.check(
        "staging",
        rounds=len(spans),
        rounds_during_connect=len(during),
        longest_round_during_connect_s=max(during, default=0.0),
        connect_s=done.get("t1", 0) - done.get("t0", 0),
    )
    rk.sync("publish2", trio)
    rk.expect_slots(buf, pair, "2 before publishing", staged=[2])
    rk.publish(buf, [2])
    rk.expect_slots(buf, trio, "2 published")
    rk.check("published")
    rk.sync("trio", trio)
    rk.rounds(buf, n=rk.p["rounds"], plan=trio, start=100)
    rk.end_phase()


# --- a silent peer beside a late one (issue 15) ---------------------------------------------


def silent(rk: Rank) -> None:
    """Slots 0, 1 and 3 of capacity 4 (slot 2 never connects). ``trio``: rounds among the
    three. ``silent``: slot 3 stays alive but skips a round; slot 0 calls it at once,
    slot 1 ``stagger_s`` later (well inside one timeout_ms). Every exchange phase has
    the whole timeout as its own budget, so the dispatch's counts phase masks slot 3 at
    its deadline, and the tokens phase then waits for slot 1, which answered the counts:
    both mask exactly slot 3 (mask [0, 0, 1, 1], one mask event naming it), receive each
    other's tokens and combine exactly. Then rounds among {0, 1}; slot 3 (which masked
    nobody) and the two reconnect, and full rounds pass."""
    p, me, trio, pair = rk.p, rk.slot, [0, 1, 3], [0, 1]
    buf = rk.make_buffer()
    rk.phase = "trio"
    rk.connected_rounds(buf, trio, activate=me == 3)

    rk.phase = "silent"
    rk.sync(rk.phase, trio)
    if me in pair:
        events = len(buf.mask_events())
        if me == 1:
            time.sleep(p["stagger_s"])
        style = {"R": "bound", "d": "sync", "c": "sync", "act": "none"}
        style["timeout_us"] = p["timeout_ms"] * 1000  # the call's own, not the buffer's
        r = rk.round(buf, 0, trio, must_drop=(3,), style=style)
        mask = rk.mask(buf)
        rk.chk.expect(mask == [0, 0, 1, 1], f"query_mask_buffer {mask}, want [0, 0, 1, 1]")
        new = buf.mask_events()[events:]
        rk.chk.expect(
            len(new) == 1 and "rank 3" in new[0],
            f"mask_events of the round: {new}, want one naming rank 3",
        )
        rk.check("masked", dispatch_s=r.dispatch_s, combine_s=r.combine_s, events=new)
    rejoin_after_skip(rk, buf, trio, pair, skipped=3)


# --- a stopped rank, left out and replaced, then resumed -----------------------------------


def stopped(rk: Rank) -> None:
    """Slots 0, 1 and 2 of capacity 4 (MOONCAKE_HANG_MS well below timeout_ms). ``full``:
    rounds among the three. ``stop``: slot 2 stops itself (SIGSTOP): 0 and 1 mask it in
    their next round once its heartbeat stood still past the hang limit (it is left out:
    it may come back only as a new process). ``replace``: 0 and 1 disconnect it and call
    connect_ranks for slot 2 at once, before its replacement exists (slot 0 asks for it
    right then): connect_ranks must wait for the replacement, not take the stopped
    process, which is alive and still named by the store (it did, and update_mask_buffer
    timed out on every side); then full rounds with the replacement. ``resume``: the
    parent resumes the stopped process; its next dispatch, barrier and connect_ranks
    raise LeftOutError naming it, at once; then the survivors and the replacement run
    full rounds again, exact (nothing of the resumed process reached them)."""
    p, me, trio, pair, v = rk.p, rk.slot, [0, 1, 2], [0, 1], 2
    n = p["rounds"]
    buf = rk.make_buffer()
    if rk.role.get("replacement"):
        rk.phase = "replace"
        buf.connect_ranks(pair, activate=False)
        rk.publish(buf, pair)
    else:
        rk.phase = "full"
        rk.connected_rounds(buf, trio)

        rk.phase = "stop"
        rk.sync(rk.phase, trio)
        if me == v:
            stopped_victim(rk, buf)
            return
        rk.wait_keys([f"tl/stopping/{v}"])
        r = rk.round(buf, 0, trio, must_drop=(v,), style={"act": "plan", "R": "bound"})
        rk.chk.expect(rk.mask(buf)[v] == 1, f"query_mask_buffer[{v}] is not 1 after the round")
        rk.check("masked", dispatch_s=r.dispatch_s, events=buf.mask_events())
        rk.end_phase()

        rk.phase = "replace"
        buf.disconnect_ranks([v])
        if me == 0:
            rk.request("spawn", slot=v, role={"replacement": True})
        t0 = time.monotonic()
        buf.connect_ranks([v], activate=False)  # waits for the replacement
        rk.publish(buf, [v])
        rk.check("reconnected", connect_s=time.monotonic() - t0)
    rk.expect_slots(buf, trio, "with the replacement")
    rk.sync("replaced", trio)
    rk.rounds(buf, n, trio)
    rk.end_phase()

    rk.phase = "resume"
    rk.sync("resume", trio)
    if me == 0:
        rk.request("resume", slot=v, gen=0)
    rk.wait_keys([f"tl/resumed/{v}"], timeout_s=60)
    rk.rounds(buf, n, trio, start=100)
    rk.end_phase()


def stopped_victim(rk: Rank, buf) -> None:
    """The stopped slot's side: stops itself; once resumed (after its replacement joined),
    its next calls must raise LeftOutError naming it, without waiting for anything."""
    from mooncake import LeftOutError

    rk.store.set(f"tl/stopping/{rk.slot}", "1")
    os.kill(os.getpid(), signal.SIGSTOP)
    rk.phase = "resumed"
    trio = [0, 1, 2]
    calls = {
        "dispatch": lambda: play_round(rk.chk, buf, rk.p["seed"], "resumed", 0, trio),
        "barrier": buf.barrier,
        "connect_ranks": lambda: buf.connect_ranks([0], activate=False),
    }
    told = {}
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            told[name] = "returned normally"
        except LeftOutError as e:
            ok = e.ranks == [rk.slot] and "left out" in str(e)
            told[name] = "LeftOutError" if ok else f"LeftOutError {e.ranks}: {e}"
        except Exception as e:  # noqa: BLE001 - reported
            told[name] = f"{type(e).__name__}: {e}"
        took = time.monotonic() - t0
        rk.chk.expect(told[name] == "LeftOutError", f"{name} after the resume: {told[name]}")
        rk.chk.expect(took < 2.0, f"{name} after the resume took {took:.2f} s")
    rk.chk.failures[:] = [f for f in rk.chk.failures if not f.startswith("resumed/")]
    late = None
    if buf._device is not None:  # the canary: a late kernel must store into nobody
        from ep_device_ranks import late_launch

        cap = rk.cap
        late = late_launch(buf, SPEC.T, SPEC.H, min(SPEC.K, rk.epr * cap), rk.epr * cap, cap)
        rk.chk.expect(late["fenced"], f"a late kernel was not fenced: {late}")
        rk.chk.expect(late["next"] == "LeftOutError", f"after a late kernel: {late}")
    rk.check("told", told=told, late=late)
    rk.store.set(f"tl/resumed/{rk.slot}", "1")
    rk.end_phase()


# --- main -----------------------------------------------------------------------------------


def upstream(rk: Rank) -> None:
    from upstream_elastic_ranks import upstream as scenario

    scenario(rk)


SCENARIOS = {
    "growth": growth,
    "fault": fault,
    "contract": contract,
    "silent": silent,
    "stopped": stopped,
    "upstream": upstream,
}


def process_main(slot: int, capacity: int, port: int, cfg_path: str, gen: int, role: str) -> None:
    """One process of a timeline (``mooncake.launch.LocalGroup`` runs it): slot
    ``slot``'s ``gen``-th. Exits with code 3 when told to abort, 1 on an error."""
    torch.set_num_threads(1)
    with open(cfg_path) as f:
        cfg = json.load(f)
    rk = Rank(cfg, slot, gen, json.loads(role))
    ElasticRound.device = cfg["params"].get("device", "cpu")
    try:
        SCENARIOS[cfg["scenario"]](rk)
        rk.emit("done")
    except Aborted as e:
        rk.emit("aborted", phase=rk.phase, reason=str(e))
        raise SystemExit(3) from None
    except BaseException:  # noqa: BLE001 - reported to the parent
        rk.emit("error", phase=rk.phase, traceback=traceback.format_exc())
        raise SystemExit(1) from None
