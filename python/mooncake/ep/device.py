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
"""

from __future__ import annotations

import os

import torch

from .. import _checks, pg
from .types import DispatchHandle, HandleState, stream_waiter, tensor_key

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


def _silent(rank: int) -> str:
    return f"rank {rank} masked: silent past the deadline of a receive phase"


class DevicePath:
    """One Buffer's device workspace, its peers' mappings and its launches.

    Its members (``group.GroupMembers`` or ``elastic.Slots``) decide who is
    mapped and when: a group maps every member at once (:meth:`GroupMembers.connect_device`),
    an elastic buffer one slot at a time as it connects them. They also give each call
    its masks and take the ranks the kernels masked (``device_masks``,
    ``device_masked``).
    """

    def __init__(self, members, num_bytes: int, device: torch.device):
        self.members, self.rank = members, members.rank
        self.device = device
        self.ext = pg._ext.EpDevice(num_bytes, device.index)
        self.reachable: list[bool] = []
        self._comm: torch.cuda.Stream | None = None  # async_finish's stream
        self._cap_ns = _env_int("MOONCAKE_EP_WAIT_CAP_MS") * 1_000_000  # timeout_us == -1
        self.usable = False  # whether every member that takes part is mapped
        self._forced_off = forced_off()
        self._checked_dispatch: tuple | None = None  # the last call shapes that passed
        self._checked_combine: tuple | None = None
        self._combine_views: dict[tuple, torch.Tensor] = {}  # combine_buffer's, per half and shape

    def card(self) -> bytes:
        """This workspace's card for the peers: its IPC handle, host and GPU
        (``src/device/peers.h``; peers map it where they run on the same host)."""
        return self.ext.card()

    @property
    def num_blocks(self) -> int:
        """The grid of each launch: this GPU's SMs split among the processes on it."""
        return self.ext.num_blocks

    def share_gpu(self, processes: int) -> None:
        """Every block of a launch must be resident at once (blocks wait for each
        other's stores), and ``processes`` processes on this GPU (this one included) run
        their kernels side by side: each takes its share of the SMs."""
        self.ext.share_gpu(processes)

    def _hand_over_silent(self) -> None:
        for r in self.ext.take_silent():
            self.members.device_masked(r, _silent(r))

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
        grid that was not resident)."""
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
        if self.ext.status_code():  # first: it may mask slots, which R depends on
            self.raise_reported("dispatch")
        members = self.members
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
        seq = buf._seq + 1
        active, slots = members.device_masks(active_ranks, R, x.device)
        recv_x, recv_count, src_info, layout_range, event, recv_hook = self.dispatch(
            x, topk_idx, active, slots, T, E, R, seq, timeout_us, use_fp8, async_finish, hook,
            stats,
        )  # fmt: skip
        buf._seq, buf.path = seq, "device"
        dtype = torch.bfloat16 if use_fp8 else x.dtype
        state = HandleState(buf._id, seq, dtype, x.shape[0], topk_idx, not hook, True, event)
        handle = DispatchHandle(src_info, layout_range, T, x.shape[1], E, state)
        overlap = stream_waiter(event)
        if not hook:
            return recv_x, recv_count, handle, overlap, None

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
                timeout_us, handle, zero_copy, af, hook, out, values=False,
            )  # fmt: skip
            if error:
                raise ValueError(f"combine: {error}")
            self._checked_combine = key
        else:  # what depends on this handle and this call, not on the shapes
            if state.buffer != buf._id or not state.finished:
                raise ValueError(f"combine: {_checks.handle_error(handle, buf._id)}")
            if zero_copy:
                error = _checks.half_error(handle, buf._seq) or _checks.zero_copy_error(
                    x, handle, buf._combine_buffers
                )
                if error:
                    raise ValueError(f"combine: {error}")
        if self.ext.status_code():
            self.raise_reported("combine")
        if state.event is not None:  # the dispatch ran on the communication stream
            torch.cuda.current_stream(x.device).wait_event(state.event)
        R = handle.layout_range.shape[1]
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
        return result, overlap, recv_hook

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

    def _run(self, run, async_finish: bool, hook: bool):
        """Runs a call's phases: the send half now and the receive half in the returned
        hook, or both on the communication stream (returns its event)."""
        if hook:
            run(pg._ext.EP_PHASE_SEND)
            return None, _Once(lambda: run(pg._ext.EP_PHASE_RECV))
        current = torch.cuda.current_stream(self.device)
        if self._comm is None:
            self._comm = torch.cuda.Stream(self.device)
        self._comm.wait_stream(current)
        with torch.cuda.stream(self._comm):
            run(_BOTH)
        event = torch.cuda.Event()
        event.record(self._comm)
        return event, None


class _Once:
    """Calls ``fn`` the first time it is called, then nothing."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()
