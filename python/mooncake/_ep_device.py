"""The EP device path: dispatch and combine as CUDA kernels over mapped workspaces.

Every rank of the group allocates its workspace (``get_ep_buffer_size_hint``
bytes) in device memory and exports it; same-host peers map each other's
through CUDA IPC (``src/transport/cuda_ipc.h``). A dispatch stages each token
once, sends headers to the ranks holding its experts and publishes
per-(expert, source) counts; those ranks copy the rows from its stage. A
combine puts the expert outputs in the workspace (the zero-copy buffer is
already there) and flags them; each token's owner sums them from there
(``src/kernels/ep.cu``). The
host only allocates outputs and launches: nothing here waits for the device,
so calls can be captured in a CUDA graph.

Outputs match the portable path (``_ep_fallback``): the same rows in the same
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

from . import _checks, pg
from ._ep_types import DispatchHandle, HandleState, stream_waiter, tensor_key

#: Status codes of ``src/kernels/api.h``.
_BAD_EXPERT, _OVERFLOW, _BAD_HEADER, _BAD_COUNT, _SILENT, _NOT_RESIDENT = 1, 2, 3, 4, 5, 6
MAX_TOPK = pg._ext.EP_MAX_TOPK  # index entries per token (src/ep/layout.h)
_BOTH = pg._ext.EP_PHASE_BOTH  # a launch of both phases
_ROW_BYTES = 128  # one exchanged row: the IPC handle, the boot id, the bus id, present


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


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()[:40]
    except OSError:
        return b""


class DevicePath:
    """One Buffer's device workspace and its peers' mappings.

    Collective: every rank of the group constructs it at the same time (and
    calls :meth:`connect` together after membership changes).
    """

    def __init__(self, group, num_bytes: int, device: torch.device, rank: int, num_ranks: int):
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.device = device
        self.ext = pg._ext.EpDevice(num_bytes, device.index)
        self.reachable: list[bool] = [False] * num_ranks
        self.num_blocks = 1
        self._comm: torch.cuda.Stream | None = None  # async_finish's stream
        self._cap_ns = _env_int("MOONCAKE_EP_WAIT_CAP_MS") * 1_000_000  # timeout_us == -1
        self.usable = False
        self._forced_off = forced_off()
        self._backend = pg._backend_of(group)
        self._mask_version = -1  # the group's view_version that _mask_dev shows
        self._mask_dev = torch.zeros(0, dtype=torch.int32)
        self._mask_events: list[str] = []
        self._checked_dispatch: tuple | None = None  # the last call shapes that passed
        self._checked_combine: tuple | None = None
        self._combine_views: dict[tuple, torch.Tensor] = {}  # combine_buffer's, per half and shape
        self.connect()

    def connect(self) -> None:
        """Exchanges workspace handles through the group and maps every same-host peer."""
        mine = bytearray(_ROW_BYTES)
        handle = self.ext.handle()
        boot, bus = _boot_id(), self.ext.bus_id.encode()[:16]
        mine[0:64] = handle
        mine[64 : 64 + len(boot)] = boot
        mine[104 : 104 + len(bus)] = bus
        mine[124] = 1  # present
        row = torch.frombuffer(mine, dtype=torch.uint8).clone()
        rows = torch.zeros(self.num_ranks * _ROW_BYTES, dtype=torch.uint8)
        pg._backend_of(self.group)._allgather_base(rows, row).wait()
        rows = rows.reshape(self.num_ranks, _ROW_BYTES)
        handles, present, sharing = [], [], 0
        for r in range(self.num_ranks):
            theirs = bytes(rows[r].tolist())
            present.append(theirs[124] == 1)
            same_host = bool(boot) and theirs[124] == 1 and theirs[64:104].rstrip(b"\0") == boot
            handles.append(theirs[0:64] if same_host and r != self.rank else b"")
            if same_host and theirs[104:120].rstrip(b"\0") == bus:
                sharing += 1
        self.reachable = self.ext.connect(handles, self.rank)
        # A member that dies later stays mapped (its memory outlives it): the kernels
        # mask it. So whether every member is mapped is settled here, once.
        self.usable = all(m for m, p in zip(self.reachable, present, strict=True) if p)
        # Every block of a launch must be resident at once (blocks wait for each
        # other's stores), and ranks sharing this GPU run their kernels side by side.
        self.num_blocks = max(1, self.ext.sm_count // max(1, sharing))

    def poll_events(self) -> list[str]:
        """Mask events the kernels reported since the last poll (an error report is
        kept for :meth:`raise_reported`)."""
        code, d0, _, _ = self.ext.status(clear=False)
        if code != _SILENT:
            return []
        self.ext.status(clear=True)
        return [_silent(d0)]

    def raise_reported(self, what: str) -> list[str]:
        """Raises what an earlier kernel on this rank reported; returns mask events
        (peers masked for silence), which are not errors."""
        code, d0, d1, _ = self.ext.status(clear=True)
        if code == 0:
            return []
        if code == _SILENT:
            return [_silent(d0)]
        if code == _BAD_EXPERT:
            raise ValueError(
                f"{what}: an earlier dispatch on this rank had topk_idx holding expert {d0} "
                f"(token {d1}); ids must be in [0, num_experts) or -1; that selection was "
                f"dropped"
            )
        if code == _OVERFLOW:
            raise ValueError(
                f"{what}: an earlier dispatch on this rank had topk_idx sending {d1} tokens to "
                f"expert {d0}, more than num_max_dispatch_tokens_per_rank: a token selects it "
                f"twice; the rows past it were dropped"
            )
        if code == _BAD_HEADER:
            raise RuntimeError(
                f"{what}: an earlier dispatch received a message from rank {d0} for local "
                f"expert {d1} whose header disagrees with its place: the data is corrupt"
            )
        if code == _NOT_RESIDENT:
            raise RuntimeError(
                f"{what}: in an earlier FP8 dispatch on this rank only {d0} of its {d1} blocks "
                f"ran at once (the GPU is shared with other work), so some tokens may have "
                f"been sent before they were quantised; set MOONCAKE_EP_FORCE_FALLBACK=1 on "
                f"such a GPU"
            )
        raise RuntimeError(
            f"{what}: an earlier dispatch received a count of {d1} from rank {d0}, more than "
            f"num_max_dispatch_tokens_per_rank: its data is corrupt"
        )

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

    def mask_events(self) -> list[str]:
        self._mask_events += self.poll_events()
        return list(self._mask_events)

    def _mask(self, buf, active_ranks, num_ranks: int, device) -> torch.Tensor:
        """The kernels' mask: ``active_ranks``, or the group's view kept on the device
        (copied again only when the view changes: reading it costs several torch ops,
        more than the launch)."""
        if active_ranks is not None:
            return active_ranks
        version = self._backend.view_version()
        if version != self._mask_version or self._mask_dev.numel() != num_ranks:
            now = buf._members.present(num_ranks).to(torch.int32)
            self._mask_version, self._mask_dev = version, now.to(device)
        return self._mask_dev

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
        R = self.num_ranks
        # The checks need no tensor values, so a call shaped like the last good one
        # passes them too: skip them (they cost more than the launch).
        key = (
            x.shape, x.dtype, x.device, topk_idx.shape, topk_idx.dtype, topk_idx.device, T, E,
            timeout_us, use_fp8, async_finish, hook, tensor_key(active_ranks), tensor_key(stats),
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
        if self.ext.status_code():
            self._mask_events += self.raise_reported("dispatch")
        seq = buf._seq + 1
        mask = self._mask(buf, active_ranks, R, x.device)
        recv_x, recv_count, src_info, layout_range, event, recv_hook = self.dispatch(
            x, topk_idx, mask, T, E, seq, timeout_us, use_fp8, async_finish, hook, stats
        )
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
            self._mask_events += self.raise_reported("combine")
        if state.event is not None:  # the dispatch ran on the communication stream
            torch.cuda.current_stream(x.device).wait_event(state.event)
        R = handle.layout_range.shape[1]
        mask = self._mask(buf, active_ranks, R, x.device)
        result, event, recv_hook = self.combine(
            x,
            handle.layout_range,
            topk_idx,
            topk_weights,
            mask,
            out,
            handle.num_max_dispatch_tokens_per_rank,
            handle.num_experts,
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
        key = (state.seq % 2, handle.num_max_dispatch_tokens_per_rank, handle.hidden,
               handle.num_experts, state.dtype)  # fmt: skip
        view = self._combine_views.get(key)
        if view is None:
            like = torch.empty(0, dtype=state.dtype)
            view = self.ext.combine_buffer(key[1], key[2], key[3], state.seq, like)
            self._combine_views[key] = view
        return view

    # --- calls ----------------------------------------------------------------------------

    def timeout_ns(self, timeout_us: int) -> int:
        return self._cap_ns if timeout_us == -1 else min(timeout_us * 1000, 2**62)

    def dispatch(
        self, x, topk_idx, active, T, E, seq, timeout_us, use_fp8, async_finish, hook, stats
    ):
        """Launches a dispatch; returns ``(recv_x, recv_count, src_info, layout_range,
        event, recv_hook)`` with ``event`` a CUDA event (async_finish) or
        None and ``recv_hook`` the receive half's launcher (hook) or None."""
        launch, blocks, timeout_ns = self.ext.dispatch, self.num_blocks, self.timeout_ns(timeout_us)
        event = recv_hook = None
        if not (hook or async_finish):  # the usual call: no closures (host time is latency)
            outputs = launch(
                x, topk_idx, active, stats, None, T, E, seq, timeout_ns, use_fp8, _BOTH, blocks
            )
        else:
            outputs = None

            def run(phases: int) -> None:
                nonlocal outputs
                outputs = launch(
                    x, topk_idx, active, stats, outputs, T, E, seq, timeout_ns, use_fp8, phases,
                    blocks,
                )  # fmt: skip

            event, recv_hook = self._run(run, async_finish, hook)
            if event is not None:
                for t in (x, topk_idx, active, *outputs, *(() if stats is None else (stats,))):
                    t.record_stream(self._comm)  # made on the caller's stream, used on ours
        data, scales, recv_count, src_info, layout_range = outputs
        recv_x = (data, scales) if use_fp8 else data
        return recv_x, recv_count, src_info, layout_range, event, recv_hook

    def combine(
        self, x, layout_range, topk_idx, weights, active, out, T, E, seq, timeout_us,
        async_finish, hook,
    ):  # fmt: skip
        """Launches a combine; returns ``(out, event, recv_hook)`` as dispatch."""
        launch, blocks, timeout_ns = self.ext.combine, self.num_blocks, self.timeout_ns(timeout_us)
        args = (x, layout_range, topk_idx, weights, active)
        if not (hook or async_finish):
            result = launch(*args, out, T, E, seq, timeout_ns, _BOTH, blocks)
            return result, None, None
        result = out

        def run(phases: int) -> None:
            nonlocal result
            result = launch(*args, result, T, E, seq, timeout_ns, phases, blocks)

        event, recv_hook = self._run(run, async_finish, hook)
        if event is not None:
            for t in (*args, result):
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
