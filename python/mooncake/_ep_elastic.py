"""The elastic EP buffer: ``Buffer.create_elastic`` (upstream's elastic EP buffer design).

A fixed capacity of stable rank slots; each slot is disconnected, staged
(connected but masked) or active. Peers find each other through the caller's
store; every rank keeps its own mask. Slots, masks, staging and the exchanges
live in the torch-free core (``src/ep/elastic.h``, ``src/ep/slots.h``); this
module adds argument checks and the tensor side. ``dispatch``/``combine`` are
the portable path's (``mooncake_ep_buffer.Buffer``) with the exchange among the
active slots below the call's rank range.

A dispatch covers ``R = num_experts // num_experts_per_rank`` slots (expert
``e`` lives on slot ``e // num_experts_per_rank``); ``R`` is at least the rank
bound (the highest active slot + 1) and at most the capacity. Slots in that
range that are not active send and receive nothing, as ranks marked 0 do in
``active_ranks``. ``recv_x`` is ``[E/R, R*T, H]`` with columns per source slot,
so a sparse set such as {0, 3} keeps its global-rank layout.

CUDA tensors are staged through host memory; the exchange itself is the
core's (shm on one host, tcp across hosts).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import _ep_fallback as fb
from . import pg
from .mooncake_ep_buffer import Buffer, _is_int, _tensor_error

__all__ = ["ElasticBuffer"]


class _Done:
    """The Work of an exchange that already ran."""

    def wait(self) -> None:
        return None


#: Bound of the arguments the core takes as C ints (slots, capacities, expert counts).
_MAX_INT = 2**31
#: The longest deadline in milliseconds (about 35 years; longer ones would overflow the
#: core's nanosecond clocks).
_MAX_TIMEOUT_MS = 2**40


def _int_arg(what: str, name: str, v, low: int, high: int = _MAX_INT) -> int:
    """``v`` when it is an int in ``[low, high)``; else ValueError naming ``name``."""
    if not _is_int(v) or not low <= v < high:
        raise ValueError(
            f"{what}: {name} must be an int >= {low} and below 2**{high.bit_length() - 1}, "
            f"got {v!r}"
        )
    return v


def _sync_device() -> None:
    """Waits for this process's earlier GPU work (the RFC's rule before a peer is
    published or released)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class ElasticBuffer(Buffer):
    """An EP Buffer with a fixed capacity of slots; see :meth:`Buffer.create_elastic`."""

    def __init__(
        self,
        rank: int,
        tcp_store_group: dist.Store,
        timeout_ms: int = 30000,
        metadata_timeout_ms: int = 300000,
        store_prefix: str = "mooncake-ep/",
    ):
        what = "create_elastic"
        _int_arg(what, "rank", rank, 0)
        if not isinstance(tcp_store_group, dist.Store):
            raise ValueError(
                f"{what}: tcp_store_group must be a torch.distributed.Store (a TCPStore), "
                f"got {type(tcp_store_group).__name__}"
            )
        if not _is_int(timeout_ms) or not (timeout_ms == -1 or 0 < timeout_ms < _MAX_TIMEOUT_MS):
            raise ValueError(
                f"{what}: timeout_ms must be an int in [1, 2**40) or -1, got {timeout_ms!r}"
            )
        _int_arg(what, "metadata_timeout_ms", metadata_timeout_ms, 1, _MAX_TIMEOUT_MS)
        if not isinstance(store_prefix, str) or not store_prefix:
            raise ValueError(f"{what}: store_prefix must be a non-empty str, got {store_prefix!r}")
        self.group = None
        self.rank = rank
        self.store = tcp_store_group
        self.timeout_ms = timeout_ms
        self.metadata_timeout_ms = metadata_timeout_ms
        self.store_prefix = store_prefix
        self.num_ranks = 0  # the capacity, once update_memory_buffers ran
        self.num_experts_per_rank = 0
        self.num_ep_buffer_bytes = 0
        self.path = "portable"
        self._peers = None
        self._init_calls()

    # --- allocation --------------------------------------------------------------------

    def update_memory_buffers(
        self, num_ranks: int, num_experts_per_rank: int, num_rdma_bytes: int = 0
    ) -> None:
        """Allocates the buffer and fixes its capacity.

        Args:
            num_ranks: the capacity: slots ``[0, num_ranks)``; this rank's slot
                (``rank``) must be below it; below ``2**31``.
            num_experts_per_rank: experts on each slot (``E/R``); every peer
                must use the same; below ``2**31``.
            num_rdma_bytes: workspace to reserve, as ``num_ep_buffer_bytes`` of
                :class:`Buffer` (see :meth:`Buffer.get_ep_buffer_size_hint`);
                0 reserves none.

        A later call may change ``num_rdma_bytes`` and may ask for the same or a
        smaller capacity (the allocation stays); a larger one needs a new Buffer.

        Raises:
            ValueError: an argument breaks its rule; a larger capacity or other
                ``num_experts_per_rank`` than the first call's.
        """
        what = "update_memory_buffers"
        _int_arg(what, "num_ranks", num_ranks, 1)
        _int_arg(what, "num_experts_per_rank", num_experts_per_rank, 1)
        _int_arg(what, "num_rdma_bytes", num_rdma_bytes, 0, 2**63)
        if num_ranks <= self.rank:
            raise ValueError(
                f"{what}: num_ranks ({num_ranks}) must be above this buffer's rank ({self.rank})"
            )
        if self._peers is not None:
            if num_ranks > self.num_ranks:
                raise ValueError(
                    f"{what}: num_ranks={num_ranks} is larger than this buffer's capacity "
                    f"({self.num_ranks}); a larger capacity needs a new Buffer"
                )
            if num_experts_per_rank != self.num_experts_per_rank:
                raise ValueError(
                    f"{what}: num_experts_per_rank={num_experts_per_rank} differs from the "
                    f"allocated {self.num_experts_per_rank}; that needs a new Buffer"
                )
            self.num_ep_buffer_bytes = num_rdma_bytes
            return
        self._peers = pg._ext.ElasticPeers(
            self.store,
            pg._default_engine(),
            self.rank,
            num_ranks,
            num_experts_per_rank,
            self.timeout_ms,
            self.metadata_timeout_ms,
            self.store_prefix,
        )
        self.num_ranks = num_ranks
        self.num_experts_per_rank = num_experts_per_rank
        self.num_ep_buffer_bytes = num_rdma_bytes

    def _need_peers(self, what: str):
        if self._peers is None:
            raise RuntimeError(f"{what}: call update_memory_buffers first (it fixes the capacity)")
        return self._peers

    # --- peers -------------------------------------------------------------------------

    def _slot_list(self, what: str, peers) -> list[int]:
        self._need_peers(what)
        if isinstance(peers, torch.Tensor):
            peers = peers.tolist()
        if not isinstance(peers, (list, tuple)) or not all(_is_int(p) for p in peers):
            raise ValueError(f"{what}: peers must be a list of ints, got {peers!r}")
        for p in peers:  # the core checks the range of those that fit its ints
            self._check_int_slot(what, p)
        return list(peers)

    def _check_int_slot(self, what: str, slot: int) -> None:
        if not -_MAX_INT <= slot < _MAX_INT:
            raise ValueError(f"{what}: rank {slot} is outside the capacity [0, {self.num_ranks})")

    def connect_ranks(self, peers: list[int], activate: bool = False) -> None:
        """Connects the processes holding ``peers``' slots.

        Waits (up to ``metadata_timeout_ms``) for each peer's buffer to exist,
        maps its memory, and stages the slot: it stays masked and no traffic
        flows until :meth:`update_mask_buffer` publishes it (``activate=True``
        does that at once). Exchanges among the active slots go on meanwhile.
        Both sides of a pair call it; a replacement for a slot whose process
        died is waited for and connected into the same slot.

        Raises:
            ValueError: a peer is this rank, outside the capacity, listed twice,
                already connected, or its buffer has another capacity or
                ``num_experts_per_rank``.
            TimeoutError: no live process holds a slot within
                ``metadata_timeout_ms``.
        """
        slots = self._slot_list("connect_ranks", peers)
        if not isinstance(activate, bool):
            raise ValueError(f"connect_ranks: activate must be a bool, got {activate!r}")
        self._peers.connect(slots, activate)

    def update_mask_buffer(self, peer: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or publishes (``mask=False``) a connected peer.

        Publishing waits for this process's earlier GPU work, then for the
        peer's side of the connection (up to ``metadata_timeout_ms``); from the
        next call on, the peer takes part in dispatch and combine. A peer masked
        here, or by a timeout, is skipped by send, receive and wait paths.
        Publishing a peer again after it was masked restarts the connection
        with fresh generations, so nothing either side queued meanwhile is
        read: the peer publishes this rank too (a peer that kept calling has
        masked this rank by its own timeout by then), or both reconnect.

        Raises:
            ValueError: ``peer`` is not a connected slot, or this rank.
            TimeoutError: the peer has not connected back in time.
        """
        self._need_peers("update_mask_buffer")
        if not _is_int(peer):
            raise ValueError(f"update_mask_buffer: peer must be an int, got {peer!r}")
        self._check_int_slot("update_mask_buffer", peer)
        if not isinstance(mask, bool):
            raise ValueError(f"update_mask_buffer: mask must be a bool, got {mask!r}")
        if not mask:
            _sync_device()
        self._peers.set_masked(peer, mask)

    def disconnect_ranks(self, peers: list[int]) -> None:
        """Releases the connections of ``peers`` (staged or active) after this
        process's earlier GPU work and any exchange in flight; the slots stay
        reserved for a reconnect or a replacement.

        Raises:
            ValueError: a peer is this rank, outside the capacity, listed twice or
                not connected.
        """
        slots = self._slot_list("disconnect_ranks", peers)
        _sync_device()
        self._peers.disconnect(slots)

    def query_mask_buffer(self, out: torch.Tensor) -> None:
        """Writes the mask into ``out``: contiguous int32 ``[capacity]`` on the CPU
        or a CUDA device, 1 = masked (staged or disconnected), 0 = active.

        Raises:
            ValueError: ``out`` is not a contiguous int32 CPU or CUDA tensor of
                ``capacity`` entries.
        """
        peers = self._need_peers("query_mask_buffer")
        err = _tensor_error("out", out, (torch.int32,), 1, shape=[self.num_ranks])
        if err is None and not out.is_contiguous():
            err = "out must be contiguous"
        if err is None and out.device.type not in ("cpu", "cuda"):
            err = f"out must be a CPU or CUDA tensor, got one on {out.device}"
        if err:
            raise ValueError(f"query_mask_buffer: {err}")
        out.copy_(torch.tensor(peers.mask(), dtype=torch.int32))

    def barrier(self, timeout_ms: int | None = None) -> list[int]:
        """Waits until every active slot has reached this barrier (the optional
        native barrier): one exchange phase of empty messages. A slot that does not
        arrive within ``timeout_ms`` (None: the buffer's) of this call is masked.

        Returns:
            the slots that took part (this rank included).
        """
        peers = self._need_peers("barrier")
        if timeout_ms is not None and (
            not _is_int(timeout_ms) or not 1 <= timeout_ms < _MAX_TIMEOUT_MS
        ):
            raise ValueError(
                f"barrier: timeout_ms must be None or an int in [1, 2**40), got {timeout_ms!r}"
            )
        got = peers.barrier(-1 if timeout_ms is None else timeout_ms)
        return [s for s, ok in enumerate(got) if ok]

    @property
    def rank_bound(self) -> int:
        """The highest active slot + 1: the fewest slots a dispatch covers."""
        return self._need_peers("rank_bound").rank_bound

    @property
    def active_slots(self) -> list[int]:
        return self._need_peers("active_slots").active_slots

    def _slot_arg(self, what: str, name: str, slot) -> int:
        self._need_peers(what)
        if not _is_int(slot) or not 0 <= slot < self.num_ranks:
            raise ValueError(
                f"{what}: {name} must be an int in [0, {self.num_ranks}) (the capacity), "
                f"got {slot!r}"
            )
        return slot

    def slot_state(self, slot: int) -> str:
        """The slot's state: "disconnected", "staged" or "active"."""
        slot = self._slot_arg("slot_state", "slot", slot)
        return self._peers.state(slot)

    def transport_of(self, peer: int) -> str:
        """How this rank reaches ``peer``: "shm", "tcp", "self" or "none"."""
        peer = self._slot_arg("transport_of", "peer", peer)
        return self._peers.transport_of(peer)

    def mask_events(self) -> list[str]:
        """Why exchanges masked peers so far, oldest first."""
        return self._need_peers("mask_events").events()

    def update_ep_member(self) -> None:
        raise RuntimeError(
            "update_ep_member: an elastic Buffer changes its peers with connect_ranks, "
            "update_mask_buffer and disconnect_ranks"
        )

    # --- the portable path's hooks -----------------------------------------------------

    def _call_ranks(self, num_experts, what: str = "dispatch") -> int:
        peers = self._need_peers(what)
        epr = self.num_experts_per_rank
        if _is_int(num_experts) and num_experts > 0 and num_experts % epr == 0:
            r = num_experts // epr
            if peers.rank_bound <= r <= self.num_ranks:
                return r
        return peers.rank_bound

    def _local_experts(self, num_experts, num_ranks: int) -> int:
        return self.num_experts_per_rank

    def _device_error(self, device: torch.device) -> str | None:
        if device.type not in ("cpu", "cuda"):
            return f"x must be a CPU or CUDA tensor, got one on {device}"
        return None

    def _experts_error(self, num_experts: int) -> str | None:
        epr, bound = self.num_experts_per_rank, self._peers.rank_bound
        if num_experts % epr or not bound <= num_experts // epr <= self.num_ranks:
            return (
                f"num_experts ({num_experts}) must be num_experts_per_rank ({epr}) times a slot "
                f"count between the rank bound ({bound}: active slots {self.active_slots}) and "
                f"the capacity ({self.num_ranks})"
            )
        return None

    def _present(self, num_ranks: int) -> torch.Tensor:
        return torch.tensor(self._peers.mask()[:num_ranks], dtype=torch.int32) == 0

    def _all_to_all(self, device, out, inp, out_splits, in_splits, timeout_us):
        def row_bytes(t: torch.Tensor) -> int:
            return t.element_size() * (t[0].numel() if t.dim() > 1 else 1)

        rb = row_bytes(out if out.numel() else inp) if (out.numel() or inp.numel()) else 0
        # This exchange's own budget, as the portable path rounds it: whole ms from now
        # (-1: the buffer's timeout_ms).
        timeout_ms = math.ceil(fb.timeout_of(timeout_us).total_seconds() * 1000)
        host_out = out if out.device.type == "cpu" else torch.empty_like(out, device="cpu")
        host_in = inp.contiguous() if inp.device.type == "cpu" else inp.cpu()
        self._peers.exchange(
            host_out,
            host_in,
            [int(s) * rb for s in out_splits],
            [int(s) * rb for s in in_splits],
            len(out_splits),
            timeout_ms,
        )
        if host_out is not out:
            out.copy_(host_out)
        return _Done()
