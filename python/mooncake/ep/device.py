"""The EP device path: dispatch and combine as CUDA kernels over mapped workspaces.

Every rank of the group allocates its workspace (``get_ep_buffer_size_hint``
bytes) in device memory and exports it; same-host peers map each other's
through CUDA IPC (the device library's EP buffer, ``src/device/ep.h``, which
this module drives through the extension's ``EpDevice``). A dispatch stages each token
once, sends headers to the ranks holding its experts and publishes
per-(expert, source) counts; those ranks copy the rows from its stage. A
combine puts the expert outputs in the workspace (the zero-copy buffer is
already there) and flags them; each token's owner sums them from there
(``src/kernels/ep_ll/``). The
host only allocates outputs and launches: nothing here waits for the device,
so calls can be captured in a CUDA graph.

Outputs match the portable path (``portable_rows``): the same rows in the same
order, BF16/FP16 payloads bit-exact, FP8 quantised by the same formula, and
combine summed in the same order and rounded once.

Differences from the portable path, all because a check would need a host
sync: values of ``topk_idx`` are checked in the kernel (a bad expert id or an
expert selected more than ``T`` times is dropped, and the next call on this
rank raises ValueError naming it), combine does not compare its ``topk_idx``
with the dispatch's, and a rank whose arguments are rejected raises without
taking part, so its peers mask it when their deadline passes.

Fencing (``src/device/ep.h``): a rank's signals and headers carry a tag with its
fence key (a group's EP membership generation, from ``GroupMembers.agree``; an
elastic slot's process incarnation), and receivers take only the key of the process
they map in each slot. When the members leave a process out, they set the fence
word in its workspace (:meth:`DevicePath.fence_slot`), so its kernels still running
stop storing into theirs; and the process itself raises ``LeftOutError`` before its
next launch (``members.device_guard``).
"""

from __future__ import annotations

import os

import torch

from .. import _checks, pg
from ..errors import LeftOutError
from .types import NO_HOOK, DispatchHandle, HandleState, stream_waiter, tensor_key

MAX_TOPK = pg._ext.EP_MAX_TOPK  # index entries per token (src/ep/layout.h)
_BOTH = pg._ext.EP_PHASE_BOTH  # a launch of both phases
_SILENT = pg._ext.EP_STATUS_SILENT_PEER  # the status report of a peer masked for silence


def _env_int(name: str) -> int:
    default = {n: d for n, d, _ in pg._ext.env_registry()}[name]
    return int(os.environ.get(name) or default)


def available() -> bool:
    """Whether this build has the device path (a CUDA build of the extension)."""
    return hasattr(pg._ext, "EpDevice")


def forced_off() -> bool:
    return _env_int("MOONCAKE_EP_FORCE_FALLBACK") != 0


def _masked(rank: int, why: int) -> str:
    """What a kernel's mask of ``rank`` says, by its reason word."""
    if why == getattr(pg._ext, "EP_MASKED_LOST", -1):
        return f"rank {rank} masked: lost (its process gone, or silent past MOONCAKE_HANG_MS)"
    return f"rank {rank} masked: silent past the deadline of a receive phase"


def wait_for_gpu() -> None:
    """Waits for this process's earlier GPU work (the RFC's rule before a peer is
    published or released)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return pid > 0


def _gpu_key(store_prefix: str, slot: int) -> str:
    return f"{store_prefix}gpu/{slot}"


def for_slots(slots, num_bytes: int) -> DevicePath | None:
    """The device path of an elastic buffer's ``slots``: a workspace of ``num_bytes`` on
    the current CUDA device, when there is one (and this build has the device path)."""
    if num_bytes == 0 or not available() or not torch.cuda.is_available():
        return None
    return DevicePath(slots, num_bytes, torch.device("cuda", torch.cuda.current_device()))


class DevicePath:
    """One Buffer's device workspace, its peers' mappings and its launches.

    Its members (``group.GroupMembers`` or ``elastic.Slots``) say who the peers are
    and when they change; this class maps them: a group's every member at once
    (:meth:`connect_group`), an elastic buffer's slots one at a time as it connects
    them (:meth:`attach_slots`, then :meth:`map_slot`, :meth:`publish_slot`,
    :meth:`mask_slot`, :meth:`unmap_slot`). The members also give each call its masks
    and take the ranks the kernels masked (``device_masks``, ``device_masked``).
    """

    def __init__(self, members, num_bytes: int, device: torch.device):
        self.members, self.rank = members, members.rank
        self.device = device
        self.ext = pg._ext.EpDevice(num_bytes, device.index)
        self.reachable: list[bool] = []
        # The grid of each launch: this GPU's SMs split among the processes on it (the
        # extension's count, kept here: it is read on every launch).
        self.num_blocks = 1
        self._comm: torch.cuda.Stream | None = None  # async_finish's stream
        # The last eager async_finish launch's event: the next launch on the caller's
        # stream waits for it (_after_comm).
        self._comm_pending: torch.cuda.Event | None = None
        self._cap_ns = _env_int("MOONCAKE_EP_WAIT_CAP_MS") * 1_000_000  # timeout_us == -1
        self.usable = False  # whether every member that takes part is mapped
        self._forced_off = forced_off()
        self._checked_dispatch: tuple | None = None  # the last call shapes that passed
        self._checked_combine: tuple | None = None
        self._combine_views: dict[tuple, torch.Tensor] = {}  # combine_buffer's, per half and shape
        # An elastic buffer's slots (attach_slots):
        self.slot_mask: torch.Tensor | None = None  # device int32 [capacity], 1 = active
        self._mapped: set[int] = set()  # slots whose workspace is mapped

    def card(self) -> bytes:
        """This workspace's card for the peers: its IPC handle, host and GPU
        (``src/device/peers.h``; peers map it where they run on the same host)."""
        return self.ext.card()

    def share_gpu(self, processes: int) -> None:
        """Every block of a launch must be resident at once (blocks wait for each
        other's stores), and ``processes`` processes on this GPU (this one included) run
        their kernels side by side: each takes its share of the SMs."""
        self.ext.share_gpu(processes)
        self.num_blocks = self.ext.num_blocks

    # --- a process group's members (group.GroupMembers) -------------------------------

    def connect_group(self) -> None:
        """Maps every same-host member's workspace (collective: every member calls it, at
        construction and after membership changes). A member that dies later stays
        mapped (its memory outlives it): the kernels mask it. So whether every member is
        mapped is settled here, once."""
        members = self.members
        R = members.num_ranks
        own = self.card()
        card = torch.frombuffer(bytearray(own), dtype=torch.uint8).clone()
        cards = members.all_gather(card).reshape(R, card.numel())
        # A rank outside the group's view sends zeros: absent, not unreachable.
        # A rank mapped before whose process left (another card, or none) is fenced first.
        self.reachable, present = self.ext.connect(
            [bytes(c.tolist()) for c in cards], members.rank, members.fence_key
        )
        members.connected()
        # The group's transport tells the kernels of a peer it sees lost (they stop waiting
        # for it at once); connect renewed the words, so it is told of them again.
        members.watch_lost(self.ext)
        self.num_blocks = self.ext.num_blocks  # connect counted the processes on this GPU
        self.usable = all(m for m, p in zip(self.reachable, present, strict=True) if p)

    # --- an elastic buffer's slots (elastic.Slots), one at a time -----------------------

    def attach_slots(self) -> None:
        """Sets this workspace up for its slots, just allocated: the kernels' peer table
        for the capacity, this process's GPU in the store, and the kernels' mask with
        this slot alone active."""
        slots = self.members
        self.ext.reserve(slots.num_ranks, slots.rank, slots.device_key(slots.rank))
        slots.watch_lost(self.ext)  # reserve renewed the lost words
        # This process's GPU, as the store records it: its card, which says the host and GPU.
        slots.store.set(
            _gpu_key(slots.store_prefix, slots.rank), f"{self.card().hex()} {os.getpid()}"
        )
        self.slot_mask = torch.zeros(slots.num_ranks, dtype=torch.int32, device=self.device)
        self.slot_mask[slots.rank] = 1
        self.refresh_slots(recount=True)

    def refresh_slots(self, recount: bool = False) -> None:
        """Whether the device path can run (every active slot mapped); with
        ``recount``, how many processes share this GPU (store reads: done when slots
        connect or disconnect, not per publish)."""
        slots = self.members
        active = slots.table_active_slots()
        self.usable = all(s == slots.rank or s in self._mapped for s in active)
        if recount:
            self.share_gpu(self.count_gpu_sharers())

    def count_gpu_sharers(self) -> int:
        """The live processes of these slots on this GPU, this one included. Each
        process's kernels need all their blocks resident at once, so processes on one
        GPU split its SMs; a process that is not connected here (it disconnected
        everyone, or is still staging) still runs kernels, so its peers count it
        through the store, not through their mappings. A process counted after it died
        (a zombie not yet reaped) only costs blocks."""
        slots = self.members
        store = slots.store
        n = 1
        for s in range(slots.num_ranks):
            key = _gpu_key(slots.store_prefix, s)
            if s == slots.rank or not store.check([key]):
                continue
            card, _, pid = store.get(key).decode().rpartition(" ")
            if self.ext.shares_gpu(bytes.fromhex(card)) and _pid_alive(int(pid or 0)):
                n += 1
        return n

    def map_slot(self, slot: int) -> None:
        """Maps a connected slot's workspace (staged: the kernels do not see it yet)."""
        if slot in self._mapped:
            return
        meta = self.members.device_card(slot)
        try:
            row = bytes.fromhex(meta)
        except ValueError:
            return  # not a device row: reached through the portable path only
        if self.ext.map_peer(slot, row, self.members.device_key(slot)):
            self._mapped.add(slot)

    def publish_slot(self, slot: int) -> None:
        """Puts a published slot into the kernels' table (after this device's earlier
        work) and its mask entry to 1."""
        if slot in self._mapped:
            self.ext.publish_peer(slot)
        self.slot_mask[slot] = 1
        self.refresh_slots()

    def fence_slot(self, slot: int) -> None:
        """Sets the fence word in the workspace of ``slot``'s process, which its peers
        left out (mapped: else nothing to do), at once: its kernels still running stop
        storing into the peers' workspaces (``src/device/ep.h`` says what is and is not
        guaranteed)."""
        if slot != self.rank and 0 <= slot < self.members.num_ranks:
            self.ext.fence_peer(slot)

    def mask_slot(self, slot: int) -> None:
        """Sets a masked slot's mask entry to 0 (a device operation: no wait for the GPU)."""
        self.slot_mask[slot] = 0
        self.refresh_slots()

    def unmap_slot(self, slot: int) -> None:
        """Sets a released slot's mask entry to 0, then unmaps its workspace."""
        self.slot_mask[slot] = 0
        if slot in self._mapped:
            self._mapped.discard(slot)
            self.ext.unmap_peer(slot)  # after the mask write and earlier kernels

    # --- what the kernels report --------------------------------------------------------

    def _hand_over_silent(self) -> None:
        for r, why in self.ext.take_masked():
            self.members.device_masked(r, _masked(r, why))

    def poll(self) -> None:
        """Hands the ranks kernels masked for silence to the members and clears that
        report (an error report is kept for :meth:`raise_reported`). Reads host-mapped
        words: no wait for the device, so a kernel still running may mask more later."""
        self._hand_over_silent()
        if self.ext.status_code() == _SILENT:
            self.ext.status(clear=True)

    def raise_reported(self, what: str) -> None:
        """As :meth:`poll`, then raises what an earlier kernel on this rank reported
        (ValueError for bad ``topk_idx`` values, RuntimeError for corrupt data or a
        grid that was not resident, LeftOutError when it found this process fenced)."""
        self._hand_over_silent()
        self.ext.raise_reported(what)

    # --- the Buffer's calls on this path ----------------------------------------------

    def takes(self, x) -> bool:
        """Whether a dispatch of ``x`` runs here."""
        return (
            self.usable
            and isinstance(x, torch.Tensor)
            and x.is_cuda
            and x.device == self.device
            and not self._forced_off
        )

    @staticmethod
    def _call_error(x, topk_idx) -> str | None:
        if x.dtype not in (torch.bfloat16, torch.float16):
            return f"x must be bfloat16 or float16 on the device path, got {x.dtype}"
        if x.shape[1] % 8:
            return f"x's hidden size ({x.shape[1]}) must be a multiple of 8 on the device path"
        if topk_idx.shape[1] > MAX_TOPK:
            return (
                f"topk_idx has {topk_idx.shape[1]} columns; the device path takes at most "
                f"{MAX_TOPK}"
            )
        return None

    def dispatch_call(
        self, buf, x, topk_idx, active_ranks, T, E, timeout_us, use_fp8, async_finish, hook, stats
    ):
        """``buf.dispatch`` on this path (``buf``: the Buffer, for its members, workspace
        size and call numbers)."""
        members = self.members
        members.device_guard(self, "dispatch")  # a process left out launches nothing
        self._call_seq = None  # the number this call takes, once known
        try:
            return self._dispatch_call(
                buf, x, topk_idx, active_ranks, T, E, timeout_us, use_fp8, async_finish, hook,
                stats,
            )  # fmt: skip
        except (ValueError, RuntimeError) as e:
            if not isinstance(e, LeftOutError):
                # The others' call goes on without this rank (they mask it): its next
                # call must carry their next number, or every later one would miss.
                buf._seq = max(buf._seq, self._call_seq or buf._seq + 1)
            raise

    def _dispatch_call(
        self, buf, x, topk_idx, active_ranks, T, E, timeout_us, use_fp8, async_finish, hook, stats
    ):
        members = self.members
        if self.ext.status_code():  # first: it may mask slots, which R depends on
            self.raise_reported("dispatch")
        R = members.call_ranks(E)
        # The checks need no tensor values, so a call shaped like the last good one
        # passes them too: skip them (they cost more than the launch).
        key = (
            x.shape, x.dtype, x.device, topk_idx.shape, topk_idx.dtype, topk_idx.device, T, E,
            R, timeout_us, use_fp8, async_finish, hook, tensor_key(active_ranks),
            tensor_key(stats),
        )  # fmt: skip
        if key != self._checked_dispatch:
            error = _checks.dispatch_error(
                buf._members, buf.num_ep_buffer_bytes, x, topk_idx, active_ranks, T, E,
                timeout_us, use_fp8, stats, async_finish, hook, values=False,
                path_device=self.device,
            ) or self._call_error(x, topk_idx)  # fmt: skip
            if error:
                raise ValueError(f"dispatch: {error}")
            self._checked_dispatch = key
        if members.count_pending:  # an elastic buffer published peers: join their count
            buf._seq = max(buf._seq, members.told_count(timeout_us))
        seq = self._call_seq = buf._seq + 1
        if self._comm_pending is not None and not async_finish:
            self._after_comm()  # before device_masks, which may write the masks it reads
        active, slots = members.device_masks(active_ranks, R, x.device)
        recv_x, recv_count, src_info, layout_range, event, recv_hook = self.dispatch(
            x, topk_idx, active, slots, T, E, R, seq, timeout_us, use_fp8, async_finish, hook,
            stats,
        )  # fmt: skip
        buf._seq, buf.path = seq, "device"
        dtype = torch.bfloat16 if use_fp8 else x.dtype
        state = HandleState(
            buf._id, seq, dtype, x.shape[0], topk_idx, not hook, True, event,
            members=buf._members_epoch,
        )  # fmt: skip
        handle = DispatchHandle(src_info, layout_range, T, x.shape[1], E, state)
        overlap = stream_waiter(event)
        if not hook:
            return recv_x, recv_count, handle, overlap, NO_HOOK

        def finish_hook() -> None:
            recv_hook()
            state.finished = True

        return recv_x, recv_count, handle, overlap, finish_hook

    def combine_call(
        self, buf, x, topk_idx, topk_weights, active_ranks, timeout_us, handle, zero_copy, af,
        hook, out,
    ):  # fmt: skip
        """``buf.combine`` for a handle of this path."""
        state = handle.state
        key = (
            x.shape, x.dtype, x.device, topk_idx.shape, topk_idx.dtype, topk_idx.device,
            topk_weights.shape, topk_weights.dtype, topk_weights.device, timeout_us, zero_copy,
            af, hook, tensor_key(active_ranks), tensor_key(out), handle.src_info.shape,
            handle.hidden, state.dtype, state.topk_idx.shape,
        )  # fmt: skip
        if key != self._checked_combine:
            error = _checks.combine_error(
                buf._id, buf._seq, buf._combine_buffers, x, topk_idx, topk_weights, active_ranks,
                timeout_us, handle, zero_copy, af, hook, out, members=buf._members_epoch, values=False,
            )  # fmt: skip
            if error:
                raise ValueError(f"combine: {error}")
            self._checked_combine = key
        else:  # what depends on this handle and this call, not on the shapes
            epoch = buf._members_epoch
            if state.buffer != buf._id or not state.finished or state.members != epoch:
                raise ValueError(f"combine: {_checks.handle_error(handle, buf._id, epoch)}")
        # Zero-copy or not: the dispatch's routing lies in its workspace half.
        error = _checks.half_error(handle, buf._seq)
        if error is None and zero_copy:
            error = _checks.zero_copy_error(x, handle, buf._combine_buffers)
        if error:
            raise ValueError(f"combine: {error}")
        self.members.device_guard(self, "combine")
        if self.ext.status_code():
            self.raise_reported("combine")
        if state.event is not None:  # the dispatch ran on the communication stream
            torch.cuda.current_stream(x.device).wait_event(state.event)
        R = handle.layout_range.shape[1]
        if self._comm_pending is not None and not af:
            self._after_comm()  # before device_masks, which may write the masks it reads
        active, slots = self.members.device_masks(active_ranks, R, x.device)
        result, event, recv_hook = self.combine(
            x,
            handle.layout_range,
            topk_idx,
            topk_weights,
            active,
            slots,
            out,
            handle.num_max_dispatch_tokens_per_rank,
            handle.num_experts,
            R,
            state.seq,
            timeout_us,
            af,
            hook,
        )
        buf.path = "device"
        overlap = stream_waiter(event)
        return result, overlap, recv_hook or NO_HOOK

    def combine_buffer(self, handle: DispatchHandle) -> torch.Tensor:
        """The zero-copy combine buffer of ``handle``'s half: the workspace's rows
        region, where the token owners read the expert outputs."""
        state = handle.state
        R = handle.layout_range.shape[1]
        key = (state.seq % 2, handle.num_max_dispatch_tokens_per_rank, handle.hidden,
               handle.num_experts, R, state.dtype)  # fmt: skip
        view = self._combine_views.get(key)
        if view is None:
            like = torch.empty(0, dtype=state.dtype)
            view = self.ext.combine_buffer(key[1], key[2], key[3], R, state.seq, like)
            self._combine_views[key] = view
        return view

    # --- calls ----------------------------------------------------------------------------

    def timeout_ns(self, timeout_us: int) -> int:
        return self._cap_ns if timeout_us == -1 else min(timeout_us * 1000, 2**62)

    def dispatch(
        self, x, topk_idx, active, slots, T, E, R, seq, timeout_us, use_fp8, async_finish, hook,
        stats,
    ):  # fmt: skip
        """Launches a dispatch; returns ``(recv_x, recv_count, src_info, layout_range,
        event, recv_hook)`` with ``event`` a CUDA event (async_finish) or
        None and ``recv_hook`` the receive half's launcher (hook) or None."""
        launch, blocks, timeout_ns = self.ext.dispatch, self.num_blocks, self.timeout_ns(timeout_us)
        event = recv_hook = None
        if not (hook or async_finish):  # the usual call: no closures (host time is latency)
            outputs = launch(
                x, topk_idx, active, slots, stats, None, T, E, R, seq, timeout_ns, use_fp8,
                _BOTH, blocks,
            )  # fmt: skip
        else:
            outputs = None

            def run(phases: int) -> None:
                nonlocal outputs
                outputs = launch(
                    x, topk_idx, active, slots, stats, outputs, T, E, R, seq, timeout_ns,
                    use_fp8, phases, blocks,
                )  # fmt: skip

            event, recv_hook = self._run(run, async_finish, hook)
            if event is not None:
                extra = tuple(t for t in (slots, stats) if t is not None)
                for t in (x, topk_idx, active, *outputs, *extra):
                    t.record_stream(self._comm)  # made on the caller's stream, used on ours
        data, scales, recv_count, src_info, layout_range = outputs
        recv_x = (data, scales) if use_fp8 else data
        return recv_x, recv_count, src_info, layout_range, event, recv_hook

    def combine(
        self, x, layout_range, topk_idx, weights, active, slots, out, T, E, R, seq, timeout_us,
        async_finish, hook,
    ):  # fmt: skip
        """Launches a combine; returns ``(out, event, recv_hook)`` as dispatch."""
        launch, blocks, timeout_ns = self.ext.combine, self.num_blocks, self.timeout_ns(timeout_us)
        args = (x, layout_range, topk_idx, weights, active, slots)
        if not (hook or async_finish):
            result = launch(*args, out, T, E, R, seq, timeout_ns, _BOTH, blocks)
            return result, None, None
        result = out

        def run(phases: int) -> None:
            nonlocal result
            result = launch(*args, result, T, E, R, seq, timeout_ns, phases, blocks)

        event, recv_hook = self._run(run, async_finish, hook)
        if event is not None:
            for t in (*args, result):
                if t is not None:
                    t.record_stream(self._comm)
        return result, event, recv_hook

    def comm_stream(self) -> torch.cuda.Stream:
        """The stream that async_finish calls run on (made on first use)."""
        if self._comm is None:
            self._comm = torch.cuda.Stream(self.device)
        return self._comm

    def _run(self, run, async_finish: bool, hook: bool):
        """Runs a call's phases: the send half now and the receive half in the returned
        hook, or both on the communication stream (returns its event)."""
        if hook:
            run(pg._ext.EP_PHASE_SEND)

            def receive() -> None:
                if self._comm_pending is not None:  # an async_finish call came between
                    self._after_comm()
                run(pg._ext.EP_PHASE_RECV)

            return None, _Once(receive)
        current = torch.cuda.current_stream(self.device)
        if self._comm is None:
            self._comm = torch.cuda.Stream(self.device)
        self._comm.wait_stream(current)
        with torch.cuda.stream(self._comm):
            run(_BOTH)
        event = torch.cuda.Event()
        event.record(self._comm)
        if not torch.cuda.is_current_stream_capturing():
            self._comm_pending = event
        return event, None

    def _after_comm(self) -> None:
        """Orders an eager launch on the caller's stream after the last eager
        async_finish launch, whose event the caller may not have waited on: both use
        this workspace (upstream runs such calls on one stream). Captured calls are left
        to the caller, as for NCCL: an event of one capture cannot be waited on in
        another."""
        if torch.cuda.is_current_stream_capturing():
            return  # kept for the next eager launch
        event, self._comm_pending = self._comm_pending, None
        torch.cuda.current_stream(self.device).wait_event(event)


class _Once:
    """Calls ``fn`` the first time it is called, then nothing."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()
