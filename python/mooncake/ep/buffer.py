"""Expert-parallel dispatch and combine that know which ranks are healthy.

``Buffer`` follows the DeepEP low-latency model, with upstream Mooncake's
API: ``dispatch`` sends each token to
the ranks holding its top-k experts and returns them packed per local expert;
``combine`` sends the experts' outputs back and sums them per token with the
top-k weights. It stays usable when ranks fail: a rank that dies is masked out
(``active_ranks[rank] = 0``) and treated as having sent nothing, within
``timeout_us``. Users import it from ``mooncake.mooncake_ep_buffer``
(upstream's path), which re-exports it.

A Buffer is composed of two parts, each with one job:

* its **members**: who the ranks are, which take part right now, and how an
  exchange among them runs. ``Buffer(group, ...)`` has a process group's
  (``mooncake/ep/group.py``); ``Buffer.create_elastic`` has a fixed capacity
  of stable slots connected one by one (``mooncake/ep/elastic.py``), and the
  slot methods (``connect_ranks`` ...) that only such a Buffer answers, which
  ``Buffer`` inherits from ``mooncake/ep/elastic_api.py`` with upstream's
  elastic forms of ``dispatch`` and ``combine``.
* its **paths**, which run the calls. The portable path
  (``mooncake/ep/portable.py`` over ``portable_rows.py``) is torch ops over the
  members' exchange, for CPU tensors and everything else. The device path
  (``mooncake/ep/device.py``) runs CUDA kernels that store tokens straight
  into peers' mapped workspaces; a process-group Buffer with a device
  workspace has one, and it serves CUDA tensors there when every member is on
  this host. ``Buffer.path`` says which one ran last; a combine runs on its
  dispatch's path.

Both paths check arguments with the same rules (``mooncake/_checks.py``); the
device path skips those that read tensor values, since reading them would wait
for the device.

Shapes below: ``N`` tokens on this rank, ``K`` top-k, ``H`` hidden, ``R``
ranks (``group.size()``), ``E`` experts, ``E/R`` local experts per rank,
``T`` = ``num_max_dispatch_tokens_per_rank``.
"""

from __future__ import annotations

import inspect
import itertools
import weakref

import torch
import torch.distributed as dist

from .. import _checks, pg
from . import device as device_path
from . import elastic_api
from .elastic import Slots
from .elastic_api import ElasticMethods
from .group import GroupMembers, backend_serves, members_of
from .portable import PortablePath
from .types import DispatchHandle, EventOverlap

__all__ = ["Buffer"]

_buffer_ids = itertools.count(1)


class Runtime:
    """``Buffer.runtime``: what upstream's native buffer answers about the transport."""

    def __init__(self, buffer: Buffer):
        self._buffer = buffer

    def ibgda_disabled(self) -> bool:
        """Always True: peers are reached by mapped device memory or the portable path,
        never by GPU-initiated RDMA."""
        return True

    def p2p_enabled(self) -> bool:
        """Whether the device path runs: a workspace with every member mapped."""
        device = self._buffer._device
        return device is not None and device.usable


def _workspace_device(group: dist.ProcessGroup, device) -> torch.device | None:
    """The CUDA device of the device path's workspace, or None (portable only)."""
    if device is None:
        if not device_path.available() or not backend_serves(group, "cuda"):
            return None
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Buffer: device must be a CUDA device, got {device!r}") from None
    if dev.type != "cuda":
        raise ValueError(f"Buffer: device must be a CUDA device, got {dev}")
    if not device_path.available():
        raise ValueError(
            "Buffer: device: this build of mooncake has no CUDA device path (build it "
            "against a CUDA torch)"
        )
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


class Buffer(ElasticMethods):
    """The EP runtime of one mooncake process group (or, from
    :meth:`create_elastic`, of a set of elastic slots).

    Args:
        group: a ``torch.distributed`` ProcessGroup; ``R = group.size()``. With a
            mooncake backend (``mooncake-cpu`` or ``mooncake``) the Buffer follows the
            group's view of failed ranks. Any other group (an engine's NCCL or gloo EP
            group) works too, with a warning: nothing then tells the Buffer that a rank
            failed between calls (pass ``active_ranks``), the portable path's exchanges
            run under the group's own timeout, and only the device path's kernels mask a
            silent peer (after ``timeout_us``).
        num_ep_buffer_bytes: the workspace to reserve, from
            :meth:`get_ep_buffer_size_hint`; 0 reserves none. When it is
            non-zero, a dispatch whose shape needs more raises ValueError
            instead of overflowing. The portable path allocates its tensors
            per call and needs no workspace; the device path needs one.
        disable_p2p: True: no device path (peers' workspaces are not mapped);
            every call runs the portable path. Upstream's switch for NVLink
            peer-to-peer; here it is the device path's.
        device: (keyword only) where the device path's workspace lives: a CUDA device (an
            index or ``"cuda:N"``; ``"cuda"`` is the current one). ``None``:
            the current CUDA device when the group has a ``mooncake`` CUDA
            backend, else no device path. With a workspace on a device,
            dispatches of CUDA tensors there run the device path when every
            member is mapped (``MOONCAKE_EP_FORCE_FALLBACK=1`` turns it off).

    Collective: every rank of the group constructs its Buffer together (they
    check that they agree on the size), and a process that joined the group
    later constructs its Buffer while the others call
    :meth:`update_ep_member`.

    Attributes upstream code reads: ``rank``, ``group_size`` (``R``; an elastic
    Buffer's capacity once allocated), ``group`` and ``backend`` (the process
    group; None for an elastic Buffer), ``num_ep_buffer_bytes``, ``device_type``
    (``"cuda"``), and ``runtime``, which answers ``ibgda_disabled()`` (always
    True: there is no GPU-initiated RDMA here) and ``p2p_enabled()`` (whether
    the device path's peers are all mapped). An elastic Buffer's ``runtime`` is None
    before its allocation, as upstream's; its other attributes are in
    :meth:`create_elastic`.

    Raises:
        ValueError: ``group`` is not a ProcessGroup; ``num_ep_buffer_bytes``
            is not an int in ``[0, 2**63)``; the ranks disagree on it;
            ``device`` is not a CUDA device or this build has no CUDA.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_ep_buffer_bytes: int = 0,
        disable_p2p: bool = False,
        *,
        device: torch.device | str | int | None = None,
    ):
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(
                f"Buffer: group must be a torch.distributed ProcessGroup, got "
                f"{type(group).__name__}"
            )
        num_ep_buffer_bytes = _checks.plain(num_ep_buffer_bytes)
        if not _checks.is_int(num_ep_buffer_bytes) or not 0 <= num_ep_buffer_bytes < 2**63:
            raise ValueError(
                f"Buffer: num_ep_buffer_bytes must be an int in [0, 2**63), got "
                f"{num_ep_buffer_bytes!r}"
            )
        if not isinstance(disable_p2p, bool):
            raise ValueError(f"Buffer: disable_p2p must be a bool, got {disable_p2p!r}")
        members = members_of(
            group,
            "Buffer",
            " between calls (pass active_ranks to mask them), and a dead rank stalls the "
            "portable path's exchanges for the group's timeout",
        )
        self._compose(members, num_ep_buffer_bytes)
        workspace_device = None if disable_p2p else _workspace_device(group, device)
        # A replacement's constructor meets the others' update_ep_member here.
        self._seq = self._members.agree("Buffer", num_ep_buffer_bytes, self._seq)
        if workspace_device is not None and num_ep_buffer_bytes > 0:
            self._device = device_path.DevicePath(
                self._members, num_ep_buffer_bytes, workspace_device
            )
            self._device.connect_group()

    def _compose(self, members: GroupMembers | Slots, num_ep_buffer_bytes: int) -> None:
        """Puts the Buffer together: ``members`` and the portable path over them (the
        device path, when there is one, is added by the constructor). The paths share
        the call numbers and zero-copy buffers kept here."""
        self._members = members
        self._portable = PortablePath(members)
        self._device: device_path.DevicePath | None = None
        self.group = members.group
        self.backend = members.group  # upstream's name for the group
        self.rank = members.rank
        self.num_ranks = self.group_size = members.num_ranks
        self.num_ep_buffer_bytes = num_ep_buffer_bytes
        self.device_type = "cuda"
        self.runtime = Runtime(self)
        self.path = "portable"
        self._id = next(_buffer_ids)
        self._seq = 0  # the latest dispatch's number (either path); its half is _seq % 2
        self._members_epoch = 0  # update_ep_member calls: older handles are refused
        self._combine_buffers: list[torch.Tensor | None] = [None, None]
        # Per half, the latest dispatch's (src_info, layout_range) weakly, its state, (T, H, E).
        self._handles: list[tuple | None] = [None, None]

    # --- sizes -------------------------------------------------------------------------

    @staticmethod
    def get_ep_buffer_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """The workspace, in bytes, for dispatches of up to ``T`` tokens per rank.

        A closed formula (``src/ep/layout.h``): two halves (even and odd calls),
        each ``align128(2E * 8)`` signal bytes + ``E * T`` message headers of
        16 bytes + ``E * T`` rows of ``P`` (the expert outputs a combine
        returns) + a stage of ``T * P`` + an index of ``T * 16 * 8``, where
        ``P = align16(max(2H, H + 4 * ceil(H / 128)))`` is one row (BF16, or
        FP8 with its scales); every region is 128-byte aligned. For T=128,
        H=7168, R=8, E=288 that is about 1.06 GB.

        Raises:
            ValueError: an argument is < 1, ``num_experts % num_ranks != 0``, or
                the result would exceed 2**50 bytes.
        """
        _checks.size_hint_args(
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            hidden=hidden,
            num_ranks=num_ranks,
            num_experts=num_experts,
        )
        return pg._ext.ep_layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)[
            "total_bytes"
        ]

    @staticmethod
    def get_low_latency_buffer_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Upstream's name for :meth:`get_ep_buffer_size_hint` (with ``num_ranks`` an
        elastic Buffer's capacity): the workspace bytes for that shape."""
        return Buffer.get_ep_buffer_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        )

    @staticmethod
    def get_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Upstream's other name for :meth:`get_ep_buffer_size_hint`."""
        return Buffer.get_ep_buffer_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        )

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded now on the current CUDA stream, as an :class:`EventOverlap`
        (``current_stream_wait()`` makes the stream that is current then wait for it).
        Without CUDA, an EventOverlap with nothing to wait for."""
        if not torch.cuda.is_available():
            return EventOverlap()
        event = torch.cuda.Event()
        event.record()
        return EventOverlap(event)

    # --- membership ----------------------------------------------------------------------

    def connect(self, is_update: bool = False) -> None:
        """Connects the peers again, collectively (the constructor has connected them
        once): with ``is_update``, :meth:`update_ep_member`; without, the device path
        maps every member's workspace again (nothing to do without one).

        Raises:
            RuntimeError: an elastic Buffer (its slots connect with :meth:`connect_ranks`).
        """
        if not isinstance(is_update, bool):
            raise ValueError(f"connect: is_update must be a bool, got {is_update!r}")
        if isinstance(self._members, Slots):
            raise RuntimeError(
                "connect: an elastic Buffer connects its slots with connect_ranks and "
                "update_mask_buffer"
            )
        if is_update:
            self.update_ep_member()
        elif self._device is not None:
            self._device.connect_group()

    def update_ep_member(self) -> None:
        """Refreshes the EP peers after the process group changed membership.

        Call it on every healthy rank after ``pg.recover_ranks`` admitted
        replacements (the replacements construct their Buffer at the same
        time: both sides run the same exchange). Afterwards a dispatch with
        ``active_ranks`` back at 1 for the recovered ranks (or
        ``active_ranks=None``) runs at full strength. A rank that died is
        masked by dispatch and combine themselves; no call is needed for that.
        The replacement takes over the others' call count, which the device
        path's signals carry, so its first dispatch is theirs. A handle from a
        dispatch before this call no longer combines (ValueError): its rows
        belong to the old members.

        Raises:
            ValueError: the members disagree on ``num_ep_buffer_bytes``.
            RuntimeError: an elastic Buffer (it changes its peers with
                :meth:`connect_ranks` and the other slot methods).
        """
        self._seq = self._members.refresh(self.num_ep_buffer_bytes, self._seq)
        self._members_epoch += 1
        if self._device is not None:
            self._device.connect_group()

    def mask_events(self) -> list[str]:
        """Why peers were masked so far, oldest first: by the device path's kernels (a
        peer silent past a deadline; read without waiting for the device, so a call
        still running may add to it later), or by an elastic Buffer's exchanges.

        Raises:
            RuntimeError: an elastic Buffer before :meth:`update_memory_buffers`.
        """
        if self._device is not None:
            self._device.poll()
        return self._members.mask_events()

    # --- dispatch ------------------------------------------------------------------------

    def _dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        active_ranks: torch.Tensor | None,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        timeout_us: int,
        use_fp8: bool | None = None,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        topk_weights: torch.Tensor | None = None,
        *,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    ):
        """Sends every token to the ranks that hold its selected experts.

        Collective over the group's members: every healthy rank calls it, with
        the same ``T``, ``H``, ``E`` and ``use_fp8``.

        An elastic Buffer also takes upstream's elastic form, ``dispatch(x, topk_idx,
        num_max_dispatch_tokens_per_rank, num_experts=None,
        cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
        use_fp8=True, round_scale=False, async_finish=False, return_recv_hook=False)``
        (``elastic_api.dispatch``): the buffer's mask and ``timeout_ms`` serve, and the
        handle is upstream's 4-tuple. The third positional argument tells the forms
        apart (an int there is ``T``); without it, the keywords ``active_ranks`` or
        ``timeout_us`` mean this form.

        Args:
            x: ``[N, H]`` bf16 (fp16 and fp32 work too), ``N <= T``, on a
                device the group has a mooncake backend for.
            topk_idx: ``[N, K]`` int64 (or int32), expert ids in ``[0, E)``;
                ``-1`` marks a selection to skip.
            active_ranks: int32 ``[R]`` on ``x``'s device, 1 = healthy. Tokens go
                only to ranks marked 1 and are taken only from them (a pair of
                ranks exchanges tokens when each counts the other healthy). A
                rank that fails to deliver within ``timeout_us`` (it died) is
                set to 0 in place and counted as sending nothing. ``None``:
                the process group's view (``pg.get_active_ranks``).
            num_max_dispatch_tokens_per_rank: ``T``, the most tokens any rank
                sends in one call; sizes ``recv_x``; below ``2**31``.
            num_experts: ``E``, divisible by ``R``; below ``2**31``.
            timeout_us: the wait budget of each exchange phase, in
                microseconds, from the phase's start, at most ``2**50`` (about
                35 years); ``-1``: no EP deadline (the group's own timeout and
                failure detection still apply). The portable path's dispatch
                runs two phases (counts, then tokens), so it may wait up to
                twice ``timeout_us`` (plus, per phase, the group's grace of at
                most 0.5 s for the others to report when it leaves a rank out);
                each phase has the whole budget, so a rank that answered one
                phase is never masked because another rank was slow. A rank
                that is alive but misses a phase's deadline is left out of the
                process group, as the group does with any rank silent past an
                op's deadline.
            use_fp8: send FP8 e4m3 with one fp32 scale per token per 128
                channels (``mooncake.fp8``); ``H % 128 == 0``. None (the
                default, as upstream's): True.
            async_finish: (bool) return at once; ``event.current_stream_wait()``
                finishes the receive and fills the outputs.
            return_recv_hook: (bool) return at once; ``hook()`` finishes the
                receive and fills the outputs (exclusive with ``async_finish``).
            topk_weights: accepted where upstream's signature has it, and not
                used: the weights are :meth:`combine`'s (upstream reads them here on
                XPU only).
            cumulative_local_expert_recv_stats: (keyword only) optional int32
                ``[E/R]``; the tokens each local expert received are added to it.

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``:

            * ``recv_x``: ``[E/R, R*T, H]`` of ``x``'s dtype, or with FP8 a
              pair ``(data float8_e4m3fn [E/R, R*T, H], scales float32
              [E/R, R*T, H/128])``. For local expert ``j``, rows
              ``[0, recv_count[j])`` hold its tokens grouped by source rank in
              rank order (token order within a source); later rows are
              undefined.
            * ``recv_count``: int32 ``[E/R]``.
            * ``handle``: a :class:`DispatchHandle` for :meth:`combine` and
              :meth:`get_next_combine_buffer`.
            * ``event``: an :class:`EventOverlap`.
            * ``hook``: with ``return_recv_hook=True`` a callable that
              finishes the receive; else one with nothing to do (upstream's
              callers call it without looking).

            Outputs are on ``x``'s device and valid on return, unless
            ``async_finish``/``return_recv_hook`` defer them.

        Raises:
            ValueError: an argument breaks a rule above (the message names it),
                or the ranks disagree on the call's shape; raised on every rank
                alike, and the group stays usable.
            mooncake.LeftOutError: this rank was left out of the group (a
                ``RuntimeError``; ``.ranks == [this rank]``).
        """
        if use_fp8 is None:
            use_fp8 = True
        T, E, timeout_us = map(
            _checks.plain, (num_max_dispatch_tokens_per_rank, num_experts, timeout_us)
        )
        device = self._device
        path = device if device is not None and device.takes(x) else self._portable
        out = path.dispatch_call(
            self,
            x,
            topk_idx,
            active_ranks,
            T,
            E,
            timeout_us,
            use_fp8,
            async_finish,
            return_recv_hook,
            cumulative_local_expert_recv_stats,
        )
        # Kept so that a copy of the handle (upstream's is a plain tuple that engines
        # store and pass on) finds its dispatch again; a half holds one at a time. Its
        # tensors only weakly: the device path reuses a call's outputs once nothing
        # refers to them.
        handle = out[2]
        self._handles[self._seq % 2] = (
            weakref.ref(handle.src_info),
            weakref.ref(handle.layout_range),
            handle.state,
            (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts),
        )
        return out

    def dispatch(self, *args, **kwargs):
        # Two forms share the name; which one is the call's own arguments' to say
        # (elastic_api.upstream_dispatch_form), before Python binds them to either.
        if isinstance(self._members, Slots) and elastic_api.upstream_dispatch_form(args, kwargs):
            return elastic_api.dispatch(self, *args, **kwargs)
        return self._dispatch(*args, **kwargs)

    dispatch.__signature__ = inspect.signature(_dispatch)
    dispatch.__doc__ = _dispatch.__doc__

    def _handle_of(self, handle):
        """``handle`` itself when it is a DispatchHandle; for a copy of one (any sequence
        of its five items, as upstream's tuple), the handle of the dispatch it copies,
        while that dispatch's half is this Buffer's; else ``handle`` (the checks then
        say what is wrong)."""
        if isinstance(handle, DispatchHandle):
            return handle
        try:
            items = tuple(handle)
        except TypeError:
            return handle
        if len(items) in (4, 5):  # (an elastic dispatch's upstream form returns four)
            for kept in self._handles:
                if (
                    kept is not None
                    and kept[0]() is items[0]
                    and kept[1]() is items[1]
                    and items[2:] == kept[3][: len(items) - 2]
                ):
                    return DispatchHandle(*items[:4], kept[3][2], kept[2])
        return handle

    # --- combine -------------------------------------------------------------------------

    def get_next_combine_buffer(self, handle: DispatchHandle) -> torch.Tensor:
        """The tensor to write expert outputs into for ``combine(..., zero_copy=True)``.

        Args:
            handle: from this Buffer's latest or second-latest dispatch.

        Returns:
            ``[E/R, R*T, H]`` of the dispatch's dtype (bf16 with FP8), on the
            dispatch's device; one per half (even and odd calls), reused. On
            the device path it is the workspace itself (token owners read the
            expert outputs where they are, so the combine copies nothing); it
            stays valid while this Buffer lives.

        Raises:
            ValueError: the handle is not from this Buffer, or two later
                dispatches have reused its half.
        """
        handle = self._handle_of(handle)
        error = _checks.handle_error(handle, self._id, self._members_epoch) or _checks.half_error(
            handle, self._seq
        )
        if error:
            raise ValueError(f"get_next_combine_buffer: {error}")
        state = handle.state
        half = state.seq % 2
        if state.on_device and self._device is not None:
            self._combine_buffers[half] = self._device.combine_buffer(handle)
            return self._combine_buffers[half]
        shape = tuple(handle.src_info.shape) + (handle.hidden,)
        device = handle.src_info.device
        buf = self._combine_buffers[half]
        if (
            buf is None
            or tuple(buf.shape) != shape
            or buf.dtype != state.dtype
            or buf.device != device
        ):
            buf = torch.zeros(shape, dtype=state.dtype, device=device)
            self._combine_buffers[half] = buf
        return buf

    def _combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        active_ranks: torch.Tensor | None,
        timeout_us: int,
        handle: DispatchHandle,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
    ):
        """Sends expert outputs back and sums them per token with the top-k weights.

        Collective over the group's members, like :meth:`dispatch`.

        An elastic Buffer also takes upstream's elastic form, ``combine(x, topk_idx,
        topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False,
        return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None)``
        (``elastic_api.combine``), with the buffer's mask and ``timeout_ms``: a sequence
        as the fourth positional argument is the handle.

        Args:
            x: ``[E/R, R*T, H]`` expert outputs in ``recv_x``'s layout (rows
                past ``recv_count`` are ignored); the dispatch's dtype.
            topk_idx: ``[N, K]``, the one passed to the dispatch.
            topk_weights: ``[N, K]`` float32 (bf16/fp16 accepted).
            active_ranks: int32 ``[R]`` as in :meth:`dispatch`. Outputs of
                experts on ranks marked 0 (or that die now) are skipped; ranks
                that die are set to 0. ``None``: the process group's view.
            timeout_us: as in :meth:`dispatch`; a combine is one exchange phase,
                so it waits at most ``timeout_us``.
            handle: the dispatch's :class:`DispatchHandle`, or a copy of its items (the
                elastic form's 4-tuple too) while no later dispatch reused its half; on
                the device path, from one of the two latest dispatches (a later one
                rewrote the half where its routing lies).
            zero_copy: (bool) ``x`` is :meth:`get_next_combine_buffer` (handle).
            async_finish, return_recv_hook: as in :meth:`dispatch`.
            out: optional ``[N, H]`` of ``x``'s dtype, filled in place.

        Returns:
            ``(combined_x, event, hook)`` (``hook`` as :meth:`dispatch`'s):
            ``combined_x`` ``[N, H]`` of ``x``'s
            dtype (``out`` when given): per token, the sum over its top-k of
            ``weight * expert output``, skipping ``-1`` selections and experts
            on inactive ranks, accumulated in fp32 and rounded once.

        Raises:
            ValueError: an argument breaks a rule above (a handle from another
                Buffer, a ``topk_idx`` other than the dispatch's, wrong shapes,
                dtypes or devices); every rank takes part in the exchange, so
                the group stays usable.
            mooncake.LeftOutError: this rank was left out of the group (a
                ``RuntimeError``; ``.ranks == [this rank]``).
        """
        # A combine runs on its dispatch's path (a bad handle: the portable path, which
        # says why on every rank).
        handle = self._handle_of(handle)
        timeout_us = _checks.plain(timeout_us)
        state = handle.state if isinstance(handle, DispatchHandle) else None
        device = self._device
        on_device = state is not None and state.on_device and device is not None
        path = device if on_device else self._portable
        return path.combine_call(
            self,
            x,
            topk_idx,
            topk_weights,
            active_ranks,
            timeout_us,
            handle,
            zero_copy,
            async_finish,
            return_recv_hook,
            out,
        )

    def combine(self, *args, **kwargs):
        # As dispatch: the elastic form's fourth positional argument is the handle.
        if isinstance(self._members, Slots) and elastic_api.upstream_combine_form(args, kwargs):
            return elastic_api.combine(self, *args, **kwargs)
        return self._combine(*args, **kwargs)

    combine.__signature__ = inspect.signature(_combine)
    combine.__doc__ = _combine.__doc__
