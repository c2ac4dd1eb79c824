"""The elastic Buffer's API (``Buffer.create_elastic``), as upstream Mooncake's elastic
Buffer declares it: :class:`ElasticMethods`, which ``Buffer`` inherits, and the elastic
forms of ``dispatch`` and ``combine`` (:func:`dispatch`, :func:`combine`).

The slots themselves (connections, masks, exchanges) are ``elastic.Slots``'; this
module checks what only the Buffer sees (its flags, the call forms), keeps the Buffer's
attributes in step, and says what each call does.

``Buffer.dispatch`` and ``Buffer.combine`` take two forms on an elastic Buffer: the
process group's (``active_ranks`` and ``timeout_us`` after ``topk_idx`` /
``topk_weights``) and upstream's elastic one (neither: the buffer's mask and its
``timeout_ms`` serve). :func:`upstream_dispatch_form` and :func:`upstream_combine_form`
tell them apart from the call's own arguments, before any binding: a dispatch's third
positional argument is ``num_max_dispatch_tokens_per_rank`` (an int) in upstream's form
and ``active_ranks`` (a tensor or None) in ours; a combine's fourth is the handle (a
sequence) in upstream's and ``active_ranks`` in ours. Without those positionals, the
keywords ``active_ranks`` or ``timeout_us`` mean ours.
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from .._checks import flags_error
from .elastic import Slots

__all__ = ["ElasticMethods", "combine", "dispatch"]


def upstream_dispatch_form(args: tuple, kwargs: dict) -> bool:
    """Whether ``dispatch(*args, **kwargs)`` is upstream's elastic form."""
    if len(args) >= 3:  # an int (numpy's too), not a bool: T
        return isinstance(args[2], numbers.Integral) and not isinstance(args[2], bool)
    return "active_ranks" not in kwargs and "timeout_us" not in kwargs


def upstream_combine_form(args: tuple, kwargs: dict) -> bool:
    """Whether ``combine(*args, **kwargs)`` is upstream's elastic form."""
    if len(args) >= 4:
        return isinstance(args[3], (tuple, list))
    return "active_ranks" not in kwargs and "timeout_us" not in kwargs


def _call_timeout_us(buf) -> int:
    """The buffer's timeout_ms as a call's timeout_us (upstream passes it so)."""
    return -1 if buf.timeout_ms == -1 else buf.timeout_ms * 1000


def dispatch(
    buf,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int | None = None,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
    use_fp8: bool = True,
    round_scale: bool = False,
    async_finish: bool = False,
    return_recv_hook: bool = False,
):
    """``buf.dispatch`` in upstream's elastic form (see :meth:`Buffer.dispatch`).

    Among the active slots, with the buffer's mask (``active_ranks=None``) and its
    ``timeout_ms`` per exchange phase. ``num_experts=None``: the rank bound times
    ``num_experts_per_rank``.

    Returns:
        ``(recv_x, recv_count, handle, event, hook)`` as the other form's, with
        ``handle`` upstream's plain 4-tuple ``(src_info, layout_range,
        num_max_dispatch_tokens_per_rank, hidden)`` (:meth:`Buffer.combine` takes it,
        and copies of it).

    Raises:
        NotImplementedError: ``round_scale=True`` or a ``dispatch_wait_recv_cost_stats``
            tensor (raised before the call takes part in any exchange).
        ValueError, RuntimeError: as the other form.
    """
    slots = buf._slots("dispatch")
    error = flags_error(round_scale=round_scale)
    if error:
        raise ValueError(f"dispatch: {error}")
    if round_scale:
        raise NotImplementedError(
            "dispatch: round_scale=True (power-of-two FP8 scales) is not implemented: pass "
            "round_scale=False; the scales are amax / 448 per 128 channels (mooncake.fp8)"
        )
    if dispatch_wait_recv_cost_stats is not None:
        raise NotImplementedError(
            "dispatch: dispatch_wait_recv_cost_stats is not implemented (the exchanges do "
            "not time each source): pass None; mask_events() names the slots masked for "
            "silence, and hook()/event bound the time a receive waits"
        )
    if num_experts is None:
        num_experts = slots.call_ranks(None) * slots.num_experts_per_rank
    recv_x, recv_count, handle, event, hook = buf._dispatch(
        x,
        topk_idx,
        None,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        _call_timeout_us(buf),
        use_fp8,
        async_finish,
        return_recv_hook,
        cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
    )
    return recv_x, recv_count, handle[:4], event, hook


def combine(
    buf,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: tuple,
    use_logfmt: bool = False,
    zero_copy: bool = False,
    async_finish: bool = False,
    return_recv_hook: bool = False,
    out: torch.Tensor | None = None,
    combine_wait_recv_cost_stats: torch.Tensor | None = None,
):
    """``buf.combine`` in upstream's elastic form (see :meth:`Buffer.combine`): with the
    buffer's mask and ``timeout_ms``; ``handle`` is the elastic dispatch's 4-tuple (or a
    copy of it, or any handle the other form takes).

    Raises:
        NotImplementedError: ``use_logfmt=True`` or a ``combine_wait_recv_cost_stats``
            tensor (raised before the call takes part in any exchange).
        ValueError, RuntimeError: as the other form.
    """
    buf._slots("combine")
    error = flags_error(use_logfmt=use_logfmt)
    if error:
        raise ValueError(f"combine: {error}")
    if use_logfmt:
        raise NotImplementedError(
            "combine: use_logfmt=True (LogFMT-compressed combine) is not implemented: pass "
            "use_logfmt=False (the combine sends x's dtype)"
        )
    if combine_wait_recv_cost_stats is not None:
        raise NotImplementedError(
            "combine: combine_wait_recv_cost_stats is not implemented (the exchanges do not "
            "time each source): pass None; mask_events() names the slots masked for silence"
        )
    return buf._combine(
        x,
        topk_idx,
        topk_weights,
        None,
        _call_timeout_us(buf),
        handle,
        zero_copy,
        async_finish,
        return_recv_hook,
        out,
    )


class ElasticMethods:
    """The methods of an elastic Buffer (:meth:`create_elastic`), which ``Buffer``
    inherits. Each raises RuntimeError on a process-group Buffer, before
    :meth:`update_memory_buffers` where it needs the allocation, and after
    :meth:`destroy`."""

    @classmethod
    def create_elastic(
        cls,
        disable_ll_nvlink: bool = False,
        explicitly_destroy: bool = False,
        rank: int = 0,
        tcp_store_group: dist.Store | None = None,
        timeout_ms: int = 30000,
        metadata_timeout_ms: int = 300000,
        *,
        store_prefix: str = "mooncake-ep/",
    ):
        """An elastic Buffer for global rank ``rank``: a fixed capacity of stable
        rank slots, peers connected, staged and masked one by one
        (upstream's elastic EP buffer design; ``mooncake.ep.elastic``).

        Upstream's parameters, in its order: pass them by keyword
        (``Buffer.create_elastic(rank=r, tcp_store_group=store)``). Call
        ``update_memory_buffers(num_ranks=capacity, num_experts_per_rank,
        num_rdma_bytes)`` next, then ``connect_ranks``/``update_mask_buffer``.
        ``dispatch``/``combine`` run among the active slots, in either form.

        Args:
            disable_ll_nvlink: True: no device path (no workspace is mapped by
                peers; every call runs the portable path), as Buffer's
                ``disable_p2p``.
            explicitly_destroy: True: :meth:`destroy` may release the buffer
                (without it, destroy raises; the buffer lives until collected).
            rank: this process's slot (logical rank), below ``2**31``.
            tcp_store_group: the ``torch.distributed.Store`` (a TCPStore) through
                which peers exchange metadata; None: give it later with
                :meth:`set_tcp_store_group`, before :meth:`update_memory_buffers`.
            timeout_ms: the wait budget of each exchange phase (communication
                only), from the phase's start; a peer silent past it is masked.
                A dispatch runs two phases (counts, then tokens), so it may wait
                up to twice it; a combine or a barrier one. A call's
                ``timeout_us`` (the process group's form) replaces it. -1: none;
                else below ``2**40``.
            metadata_timeout_ms: bound of store waits only (a peer's buffer or
                its side of a connection), in ``[1, 2**40)``.
            store_prefix: (keyword only) the store keys' namespace (one per set of
                buffers sharing a store).

        Attributes, as upstream's: ``rank``, ``group_size`` (the capacity; 0 before
        allocation), ``group`` and ``backend`` (None), ``device_type``, ``runtime``
        (None before allocation and after destroy), ``disable_ll_nvlink``,
        ``explicitly_destroy``, ``tcp_store_group``, ``timeout_ms``,
        ``metadata_timeout_ms``, ``num_rdma_bytes`` (None before allocation).

        Raises:
            ValueError: an argument breaks its rule (the message names it).
        """
        what = "create_elastic"
        for name, flag in (
            ("disable_ll_nvlink", disable_ll_nvlink),
            ("explicitly_destroy", explicitly_destroy),
        ):
            if not isinstance(flag, bool):
                raise ValueError(
                    f"{what}: {name} must be a bool, got {flag!r} (upstream's order: "
                    f"disable_ll_nvlink, explicitly_destroy, rank, tcp_store_group, ...; "
                    f"pass rank= and tcp_store_group= by keyword)"
                )
        slots = Slots(
            rank, tcp_store_group, timeout_ms, metadata_timeout_ms, store_prefix, disable_ll_nvlink
        )
        buf = cls.__new__(cls)  # not __init__: that one builds a process group's members
        buf._compose(slots, 0)
        buf.runtime = None  # upstream's: none until update_memory_buffers
        buf.disable_ll_nvlink = disable_ll_nvlink
        buf.explicitly_destroy = explicitly_destroy
        buf.tcp_store_group = buf.store = tcp_store_group
        buf.timeout_ms = timeout_ms
        buf.metadata_timeout_ms = metadata_timeout_ms
        buf.store_prefix = store_prefix
        buf.num_rdma_bytes = None
        buf.num_experts_per_rank = 0  # with num_ranks (the capacity), set by allocation
        return buf

    def _slots(self, what: str) -> Slots:
        if not isinstance(self._members, Slots):
            raise RuntimeError(
                f"{what}: only an elastic Buffer (Buffer.create_elastic) has slots; this "
                f"Buffer's members are its process group's ranks (see update_ep_member)"
            )
        return self._members

    def set_tcp_store_group(self, tcp_store_group: dist.Store | None) -> None:
        """Gives the store (a TCPStore) through which peers exchange metadata, when
        ``create_elastic`` had none. It must come before :meth:`update_memory_buffers`;
        afterwards only the same store is taken.

        Raises:
            ValueError: not a ``torch.distributed.Store`` or None.
            RuntimeError: another store after :meth:`update_memory_buffers`; not an
                elastic Buffer, or destroyed.
        """
        self._slots("set_tcp_store_group").set_store(tcp_store_group)
        self.tcp_store_group = self.store = tcp_store_group

    def update_memory_buffers(
        self, num_ranks: int, num_experts_per_rank: int, num_rdma_bytes: int = 0
    ) -> None:
        """Allocates an elastic Buffer and fixes its capacity.

        Args:
            num_ranks: the capacity: slots ``[0, num_ranks)``; this rank's slot
                (``rank``) must be below it; below ``2**31``.
            num_experts_per_rank: experts on each slot (``E/R``); every peer
                must use the same; below ``2**31``.
            num_rdma_bytes: workspace to reserve, as ``num_ep_buffer_bytes`` of
                :class:`Buffer` (see :meth:`Buffer.get_ep_buffer_size_hint`, with
                ``num_ranks`` the capacity); 0 reserves none. On a machine with CUDA
                (and ``disable_ll_nvlink=False``) it is device memory on the current
                device, which same-host peers map when they connect: dispatches of
                CUDA tensors then run the device path's kernels (``Buffer.path ==
                "device"``) whenever every active slot is mapped.

        A later call with the same sizes changes nothing; it may ask for a smaller
        capacity (the allocation stays); a larger one needs a new Buffer. Another
        ``num_rdma_bytes`` reallocates the workspace, which only works while no peer
        is connected (peers map it).

        Raises:
            ValueError: an argument breaks its rule; a larger capacity or other
                ``num_experts_per_rank`` than the first call's; another
                ``num_rdma_bytes`` while a peer is connected.
            RuntimeError: no store yet (:meth:`set_tcp_store_group`); not an elastic
                Buffer, or destroyed.
        """
        slots = self._slots("update_memory_buffers")
        slots.allocate(num_ranks, num_experts_per_rank, num_rdma_bytes)
        self.num_ranks, self.num_experts_per_rank = slots.num_ranks, slots.num_experts_per_rank
        self.group_size = self.num_ranks
        self.num_ep_buffer_bytes = self.num_rdma_bytes = num_rdma_bytes
        self._device = slots.device
        if self.runtime is None:
            from .buffer import Runtime  # (buffer.py imports this module)

            self.runtime = Runtime(self)

    def connect_ranks(self, remote_ranks: list[int], activate: bool = True) -> None:
        """Connects the processes holding ``remote_ranks``' slots (elastic Buffer).

        Waits (up to ``metadata_timeout_ms``) for each peer's buffer to exist and
        maps its memory. ``activate=True`` (the default, as upstream's) then
        publishes each slot as :meth:`update_mask_buffer` does, which waits for the
        peer's side of the connection; ``activate=False`` stages it: it stays masked
        and no traffic flows until :meth:`update_mask_buffer` publishes it.
        Exchanges among the active slots go on meanwhile. Both sides of a pair call
        it; a replacement for a slot whose process died is waited for and connected
        into the same slot. This rank's own slot, where listed, is skipped (as
        upstream's).

        Raises:
            ValueError: ``remote_ranks`` is not a list of ints; a slot is outside
                the capacity, listed twice, already connected, or its buffer has
                another capacity or ``num_experts_per_rank``.
            TimeoutError: no live process holds a slot (a process that was left out,
                such as one stopped past ``MOONCAKE_HANG_MS``, does not count: the call
                waits for its replacement), or (activating) a peer has not connected
                back, within ``metadata_timeout_ms``.
            mooncake.LeftOutError: the peers left this process out.
            RuntimeError: before :meth:`update_memory_buffers`, not an elastic
                Buffer, or destroyed.
        """
        self._slots("connect_ranks").connect(remote_ranks, activate, self._seq)

    def update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or publishes (``mask=False``) a connected peer.

        Publishing waits for this process's earlier GPU work, then for the
        peer's side of the connection (up to ``metadata_timeout_ms``); from the
        next call on, the peer takes part in dispatch and combine. A peer masked
        here, or by a timeout, is skipped by send, receive and wait paths.
        Publishing a peer again after it was masked restarts the connection
        with fresh generations, so nothing either side queued meanwhile is
        read: the peer publishes this rank too (a peer that kept calling has
        masked this rank by its own timeout by then), or both reconnect.
        ``rank_to_mask`` = this rank with ``mask=False`` does nothing (it is
        always active).

        Raises:
            ValueError: ``rank_to_mask`` is not a connected slot, or is this rank
                with ``mask=True``.
            TimeoutError: the peer has not connected back in time.
            mooncake.PeerFailedError: publishing a peer whose process this side left
                out (gone, or stopped or hung past ``MOONCAKE_HANG_MS``): disconnect
                it and connect its replacement.
            mooncake.LeftOutError: publishing, when the peers left this process out.
            RuntimeError: before :meth:`update_memory_buffers`, not an elastic
                Buffer, or destroyed.
        """
        self._slots("update_mask_buffer").set_masked(rank_to_mask, mask, self._seq)

    def disconnect_ranks(self, remote_ranks: list[int]) -> None:
        """Releases the connections of ``remote_ranks`` (staged or active) after this
        process's earlier GPU work and any exchange in flight; the slots stay
        reserved for a reconnect or a replacement. This rank's own slot, where
        listed, is skipped (as upstream's).

        Raises:
            ValueError: a slot is outside the capacity, listed twice or not
                connected.
            RuntimeError: before :meth:`update_memory_buffers`, not an elastic
                Buffer, or destroyed.
        """
        self._slots("disconnect_ranks").disconnect(remote_ranks)

    def query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes the mask into ``mask_status``: contiguous int32 ``[capacity]`` on the
        CPU or a CUDA device, 1 = masked (staged or disconnected), 0 = active.

        Raises:
            ValueError: ``mask_status`` is not a contiguous int32 CPU or CUDA tensor
                of ``capacity`` entries.
            RuntimeError: before :meth:`update_memory_buffers`, not an elastic
                Buffer, or destroyed.
        """
        self._slots("query_mask_buffer").query_mask(mask_status)

    def clean_mask_buffer(self) -> None:
        """Unmasks every connected slot, as upstream's: each staged slot (connected
        with ``activate=False``, masked by :meth:`update_mask_buffer` or by a timeout)
        is published as ``update_mask_buffer(slot, mask=False)`` does, one after the
        other; disconnected slots stay masked, and so do slots whose process was left
        out (gone, or stopped or hung past ``MOONCAKE_HANG_MS``: only a replacement,
        connected after :meth:`disconnect_ranks`, takes such a slot again). Each
        publish waits for the peer's side (up to ``metadata_timeout_ms``): disconnect
        slots whose process is gone first.

        Raises:
            TimeoutError: some peers did not publish this rank in time (the message
                names them; the others are published).
            mooncake.LeftOutError: the peers left this process out.
            RuntimeError: before :meth:`update_memory_buffers`, not an elastic
                Buffer, or destroyed.
        """
        self._slots("clean_mask_buffer").clean_mask(self._seq)

    def barrier(self, timeout_ms: int | None = None) -> list[int]:
        """Waits until every active slot has reached this barrier (the optional
        native barrier): one exchange phase of empty messages. A slot that does not
        arrive within ``timeout_ms`` (None: the buffer's) of this call is masked.

        Returns:
            the slots that took part (this rank included).

        Raises:
            ValueError: ``timeout_ms`` is not None or an int in ``[1, 2**40)``.
            mooncake.LeftOutError: the peers left this process out.
            RuntimeError: before :meth:`update_memory_buffers`, not an elastic
                Buffer, or destroyed.
        """
        return self._slots("barrier").barrier(timeout_ms)

    def destroy(self) -> None:
        """Releases this elastic Buffer (``explicitly_destroy=True`` only): disconnects
        every connected slot (after this process's earlier GPU work), closes its
        connections and frees the device workspace once no view of it from
        :meth:`get_local_buffer_tensor` is left. Peers see this slot go as they see a
        process end (they mask it). Tensors from :meth:`get_next_combine_buffer` must
        not be used afterwards. Every later call raises RuntimeError.

        Raises:
            RuntimeError: created with ``explicitly_destroy=False``; already
                destroyed; not an elastic Buffer.
        """
        slots = self._slots("destroy")
        if not self.explicitly_destroy:
            raise RuntimeError(
                "destroy: this elastic Buffer was created with explicitly_destroy=False: "
                "it is released when it is garbage collected (create it with "
                "explicitly_destroy=True to release it with destroy())"
            )
        slots.destroy()
        self._device = None
        self.runtime = None
        self._combine_buffers = [None, None]
        self._handles = [None, None]

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The CUDA stream the buffer's device work runs on: with a device workspace,
        the stream ``async_finish`` calls run on (other calls run on the current
        stream); without one, the current stream, where the portable path stages CUDA
        tensors.

        Raises:
            RuntimeError: no CUDA on this machine (every call runs on the host);
                before :meth:`update_memory_buffers`, not an elastic Buffer, or
                destroyed.
        """
        return self._slots("get_comm_stream").comm_stream()

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = True,
    ) -> torch.Tensor:
        """A zero-copy view of this process's device workspace (``num_rdma_bytes``).

        Args:
            dtype: the view's dtype.
            size: its shape (contiguous); None: 1-D, as many elements as fit.
            offset: where it starts, in bytes; a multiple of ``dtype``'s size.
            use_rdma_buffer: must be True (the workspace is the only buffer).

        Returns:
            a CUDA tensor on the workspace's device over its bytes ``[offset, ...)``.
            Its storage keeps the workspace alive (also past :meth:`destroy`). The
            kernels use the workspace: writing into it while calls run corrupts them.

        Raises:
            ValueError: an argument breaks its rule, or the view does not fit.
            RuntimeError: no device workspace (``num_rdma_bytes=0``, no CUDA, a CPU
                build, or ``disable_ll_nvlink=True``); before
                :meth:`update_memory_buffers`, not an elastic Buffer, or destroyed.
        """
        slots = self._slots("get_local_buffer_tensor")
        return slots.local_tensor(dtype, size, offset, use_rdma_buffer)

    @property
    def rank_bound(self) -> int:
        """The highest active slot + 1: the fewest slots a dispatch covers."""
        return self._slots("rank_bound").rank_bound

    @property
    def active_slots(self) -> list[int]:
        """The active slots, this rank's included, in order."""
        return self._slots("active_slots").active_slots

    def slot_state(self, slot: int) -> str:
        """The slot's state: "disconnected", "staged" or "active"."""
        return self._slots("slot_state").slot_state(slot)

    def transport_of(self, peer: int) -> str:
        """How this rank reaches ``peer``: "shm", "tcp", "self" or "none"."""
        return self._slots("transport_of").transport_of(peer)
