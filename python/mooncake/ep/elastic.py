"""The members of an elastic EP Buffer (``Buffer.create_elastic``): stable rank slots.

A fixed capacity of slots; each slot is disconnected, staged (connected but
masked) or active. Peers find each other through the caller's store; every rank
keeps its own mask. Slots, masks, staging and the exchanges live in the
torch-free core (``src/ep/elastic.h``, ``src/ep/slots.h``); this module adds
the argument checks, the tensor side, and the answers ``group.GroupMembers``
gives for a process group: how many slots a call covers, which take part now,
and how an exchange among them runs. The Buffer's elastic methods
(``connect_ranks`` and the others, ``elastic_api.ElasticMethods``) call the
methods of the same job here.

A dispatch covers ``R = num_experts // num_experts_per_rank`` slots (expert
``e`` lives on slot ``e // num_experts_per_rank``); ``R`` is at least the rank
bound (the highest active slot + 1) and at most the capacity. Slots in that
range that are not active send and receive nothing, as ranks marked 0 do in
``active_ranks``. ``recv_x`` is ``[E/R, R*T, H]`` with columns per source slot,
so a sparse set such as {0, 3} keeps its global-rank layout.

With a device workspace (``num_rdma_bytes > 0`` on a machine with CUDA and a
CUDA build), CUDA tensors run the device path's kernels (``device``, which
also maps the slots when this module says: ``DevicePath.map_slot`` and the
methods beside it): each slot's workspace is mapped when it connects (CUDA IPC; its card travels
with the slot's metadata in the store), enters the kernels' peer table when it
is published, after this device's earlier work, and leaves it when it is
disconnected, after that work too. The mask the kernels read lives in device
memory (1 = active), so masking needs no host round trip and a kernel that
times out on a slot masks it there; the slot table learns of it the next time
the host looks. Kernels tag their signals with the call count, which peers
must share; processes that ran calls without each other (a new one, or one
masked for a while) count differently, so when two publish each other they
tell their counts, and before the next call each moves up to the highest it
was told (``ElasticPeers::await_call_count``). Each slot's fence key is the
incarnation of the process connected there: nothing a process that was left out (or
replaced) stores is taken for a current call, and the workspace of a slot this side
leaves out is fenced as it learns of it (``DevicePath.fence_slot``). When an active
slot is not mapped (another host) or the tensors are on the CPU, calls run the
portable path: the core's exchange (shm on one host, tcp across hosts), CUDA
tensors staged through host memory.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import pg
from .._checks import (
    MAX_INT,
    MAX_TIMEOUT_MS,
    flags_error,
    int_arg,
    int_list,
    is_int,
    plain,
    tensor_error,
)
from . import device as device_path
from . import portable_rows

__all__ = ["Slots"]


class _Done:
    """The Work of an exchange that already ran."""

    def wait(self) -> None:
        return None


def _budget_ms(timeout_us: int) -> int:
    """An exchange's own budget, as the portable path rounds it: whole ms from now
    (-1 stays -1: the buffer's timeout_ms)."""
    return math.ceil(portable_rows.timeout_of(timeout_us).total_seconds() * 1000)


def _check_store(what: str, store) -> None:
    if store is not None and not isinstance(store, dist.Store):
        raise ValueError(
            f"{what}: tcp_store_group must be a torch.distributed.Store (a TCPStore) or None, "
            f"got {type(store).__name__}"
        )


class Slots:
    """The slots of one elastic Buffer and their peers (see ``Buffer.create_elastic``).

    Raises:
        ValueError: an argument of ``create_elastic`` breaks its rule.
    """

    group = None  # no process group: peers meet through the store

    def __init__(
        self,
        rank: int,
        store: dist.Store | None,
        timeout_ms: int,
        metadata_timeout_ms: int,
        store_prefix: str,
        disable_device: bool = False,
    ):
        what = "create_elastic"
        rank = int_arg(what, "rank", rank, 0)
        timeout_ms = plain(timeout_ms)
        _check_store(what, store)
        if not is_int(timeout_ms) or not (timeout_ms == -1 or 0 < timeout_ms < MAX_TIMEOUT_MS):
            raise ValueError(
                f"{what}: timeout_ms must be an int in [1, 2**40) or -1, got {timeout_ms!r}"
            )
        metadata_timeout_ms = int_arg(
            what, "metadata_timeout_ms", metadata_timeout_ms, 1, MAX_TIMEOUT_MS
        )
        if not isinstance(store_prefix, str) or not store_prefix:
            raise ValueError(f"{what}: store_prefix must be a non-empty str, got {store_prefix!r}")
        self.rank = rank
        self.store = store  # may come later (set_store), before allocation
        self.disable_device = disable_device  # create_elastic's disable_ll_nvlink
        self.destroyed = False
        self.timeout_ms = timeout_ms
        self.metadata_timeout_ms = metadata_timeout_ms
        self.store_prefix = store_prefix
        self.num_ranks = 0  # the capacity, once allocated
        self.num_experts_per_rank = 0
        self.num_rdma_bytes = 0
        self._peers = None  # the core's ElasticPeers, once allocated
        self.device: device_path.DevicePath | None = None  # the device path, with a workspace
        self._dev_views: dict[int, torch.Tensor] = {}  # the device's slot_mask[:R], per R
        self.count_pending = False  # peers published since the last device call told counts

    # --- allocation --------------------------------------------------------------------

    def allocate(self, num_ranks: int, num_experts_per_rank: int, num_rdma_bytes: int) -> None:
        """``Buffer.update_memory_buffers``: fixes the capacity on the first call; with
        ``num_rdma_bytes > 0`` and CUDA, allocates the device workspace."""
        what = "update_memory_buffers"
        self._check_alive(what)
        num_ranks = int_arg(what, "num_ranks", num_ranks, 1)
        num_experts_per_rank = int_arg(what, "num_experts_per_rank", num_experts_per_rank, 1)
        num_rdma_bytes = int_arg(what, "num_rdma_bytes", num_rdma_bytes, 0, 2**63)
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
            if num_rdma_bytes != self.num_rdma_bytes:
                self._reallocate(num_rdma_bytes)
            return
        if self.store is None:
            raise RuntimeError(
                f"{what}: this elastic Buffer has no store: pass tcp_store_group to "
                f"create_elastic, or call set_tcp_store_group(tcp_store_group) first"
            )
        path = self._device_path(num_rdma_bytes)
        self._peers = pg._ext.ElasticPeers(
            self.store,
            pg._default_engine(),
            self.rank,
            num_ranks,
            num_experts_per_rank,
            self.timeout_ms,
            self.metadata_timeout_ms,
            self.store_prefix,
            "" if path is None else path.card().hex(),
        )
        self.num_ranks = num_ranks
        self.num_experts_per_rank = num_experts_per_rank
        self.num_rdma_bytes = num_rdma_bytes
        self._attach_device(path)

    def _device_path(self, num_bytes: int) -> device_path.DevicePath | None:
        # disable_ll_nvlink: no device path, as Buffer's disable_p2p.
        return None if self.disable_device else device_path.for_slots(self, num_bytes)

    def _attach_device(self, path: device_path.DevicePath | None) -> None:
        self.device = path
        self._dev_views = {}
        if path is not None:
            path.attach_slots()

    def _reallocate(self, num_bytes: int) -> None:
        """Another workspace size: possible while no peer has mapped this one."""
        device_path.wait_for_gpu()
        path = self._device_path(num_bytes)
        if path is not None or self.device is not None:
            self._peers.set_device_meta("" if path is None else path.card().hex())
        self.num_rdma_bytes = num_bytes
        self._attach_device(path)

    def _recount_device(self) -> None:
        """After slots connect or disconnect: whether the device path can run, and how
        many processes share this GPU (``DevicePath.refresh_slots``)."""
        if self.device is not None:
            self.device.refresh_slots(recount=True)

    def _publish(self, slot: int) -> None:
        """A published slot enters the device path's kernels' table (``publish_slot``),
        and the next device call tells the peers' counts."""
        if self.device is None:
            return
        self.count_pending = True
        self.device.publish_slot(slot)

    def look(self, wait: bool = True) -> None:
        """Waits for this process's GPU work (``wait``), then takes in the slots its
        kernels masked (host-mapped words): the view after the calls made so far. A
        call returns before its kernels end, and a kernel that waits out a silent slot
        masks it at its deadline."""
        if wait:
            device_path.wait_for_gpu()
        if self.device is not None:
            self.device.poll()
        self._fence_left_out()

    def _fence_left_out(self) -> None:
        """Fences the device workspaces of the slots whose processes this side left out
        (``DevicePath.fence_slot``): a kernel of theirs still running stops storing into
        its peers' workspaces."""
        for slot in self._peers.take_left_out() if self._peers is not None else ():
            if self.device is not None:
                self.device.fence_slot(slot)

    def _check_alive(self, what: str) -> None:
        if self.destroyed:
            raise RuntimeError(
                f"{what}: this elastic Buffer was destroyed (destroy()); create a new one"
            )

    def need_peers(self, what: str):
        if self._peers is None:
            self._check_alive(what)
            raise RuntimeError(f"{what}: call update_memory_buffers first (it fixes the capacity)")
        return self._peers

    # --- peers -------------------------------------------------------------------------

    def _slot_list(self, what: str, peers) -> list[int]:
        """``remote_ranks`` less this rank, as upstream's: a list naming every slot
        (this one included) is a correct upstream program."""
        self.need_peers(what)
        peers = int_list(what, "remote_ranks", peers)
        for p in peers:  # the core checks the range of those that fit its ints
            self._check_int_slot(what, p)
        return [p for p in peers if p != self.rank]

    def _check_int_slot(self, what: str, slot: int) -> None:
        if not -MAX_INT <= slot < MAX_INT:
            raise ValueError(f"{what}: rank {slot} is outside the capacity [0, {self.num_ranks})")

    def _slot_arg(self, what: str, name: str, slot) -> int:
        self.need_peers(what)
        if not is_int(slot) or not 0 <= slot < self.num_ranks:
            raise ValueError(
                f"{what}: {name} must be an int in [0, {self.num_ranks}) (the capacity), "
                f"got {slot!r}"
            )
        return int(slot)

    def connect(self, peers, activate, calls: int = 0) -> None:
        slots = self._slot_list("connect_ranks", peers)
        error = flags_error(activate=activate)
        if error:
            raise ValueError(f"connect_ranks: {error}")
        if not slots:
            return
        if activate:
            self.look()
        self._peers.connect(slots, activate, calls)
        if self.device is not None:
            for p in slots:
                self.device.map_slot(p)
        if activate:
            for p in slots:
                self._publish(p)
        self._recount_device()

    def set_masked(self, peer, mask, calls: int = 0) -> None:
        what = "update_mask_buffer"
        self.need_peers(what)
        peer = plain(peer)
        if not is_int(peer):
            raise ValueError(f"{what}: rank_to_mask must be an int, got {peer!r}")
        self._check_int_slot(what, peer)
        error = flags_error(mask=mask)
        if error:
            raise ValueError(f"{what}: {error}")
        if peer == self.rank:
            if mask:
                raise ValueError(
                    f"{what}: rank_to_mask: rank {peer} is this rank itself, which cannot be masked"
                )
            return  # this slot is always active (upstream takes the call too)
        # A slot a kernel masked is published again as the core restarts it. Masking
        # is a device operation: no wait for the GPU.
        self.look(wait=not mask)
        self._peers.set_masked(peer, mask, calls)
        if mask:
            if self.device is not None:
                self.device.mask_slot(peer)
        else:
            self._publish(peer)

    def disconnect(self, peers) -> None:
        slots = self._slot_list("disconnect_ranks", peers)
        if not slots:
            return
        self.look()
        self._peers.disconnect(slots)
        self._fence_left_out()  # (disconnect leaves out the masked ones that are lost)
        if self.device is not None:
            for p in slots:
                self.device.unmap_slot(p)
        self._recount_device()

    def query_mask(self, out) -> None:
        peers = self.need_peers("query_mask_buffer")
        name = "mask_status"
        err = tensor_error(name, out, (torch.int32,), 1, shape=[self.num_ranks])
        if err is None and not out.is_contiguous():
            err = f"{name} must be contiguous"
        if err is None and out.device.type not in ("cpu", "cuda"):
            err = f"{name} must be a CPU or CUDA tensor, got one on {out.device}"
        if err:
            raise ValueError(f"query_mask_buffer: {err}")
        mask = None if self.device is None else self.device.slot_mask
        if out.is_cuda and mask is not None:
            # The kernels' own mask, on the device: no host round trip.
            out.copy_(mask).neg_().add_(1)
            return
        self.look()
        out.copy_(torch.tensor(peers.mask(), dtype=torch.int32))

    def barrier(self, timeout_ms) -> list[int]:
        peers = self.need_peers("barrier")
        timeout_ms = plain(timeout_ms)
        if timeout_ms is not None and (
            not is_int(timeout_ms) or not 1 <= timeout_ms < MAX_TIMEOUT_MS
        ):
            raise ValueError(
                f"barrier: timeout_ms must be None or an int in [1, 2**40), got {timeout_ms!r}"
            )
        got = peers.barrier(-1 if timeout_ms is None else timeout_ms)
        return [s for s, ok in enumerate(got) if ok]

    # --- upstream's other elastic calls (mooncake/ep/elastic_api.py documents them) -------

    def set_store(self, store) -> None:
        what = "set_tcp_store_group"
        self._check_alive(what)
        _check_store(what, store)
        if self._peers is not None and store is not self.store:
            # The core talks through the store it was built with.
            raise RuntimeError(
                f"{what}: tcp_store_group is fixed once update_memory_buffers has set this "
                f"buffer up with it (pass the same store, or create a new Buffer)"
            )
        self.store = store

    def clean_mask(self, calls: int = 0) -> None:
        """Publishes every staged slot (connected, masked by update_mask_buffer or by a
        timeout), as upstream's sets every connected slot active; disconnected slots stay
        masked, and so do slots whose process was left out (it can come back only as a
        new process, which disconnect_ranks and connect_ranks take in)."""
        what = "clean_mask_buffer"
        peers = self.need_peers(what)
        self.look()
        peers.check_member(what)
        staged = [
            s
            for s in range(self.num_ranks)
            if s != self.rank and peers.state(s) == "staged" and not peers.peer_left_out(s)
        ]
        failed = []
        for s in staged:  # each publish waits for its peer's side; one late peer stops none
            try:
                self.set_masked(s, False, calls)
            except TimeoutError as e:
                failed.append(str(e))
        if failed:
            raise TimeoutError(
                f"{what}: {len(failed)} of {len(staged)} staged slots were not published "
                f"(the others were): " + "; ".join(failed)
            )

    def destroy(self) -> None:
        """Releases the connections (after this process's GPU work), the core's peers and
        the device workspace (once no view of it is left); every later call raises."""
        self._check_alive("destroy")
        peers = self._peers
        if peers is not None:
            self.look()
            connected = [
                s
                for s in range(self.num_ranks)
                if s != self.rank and peers.state(s) != "disconnected"
            ]
            if connected:
                self.disconnect(connected)
        path = self.device
        self.destroyed = True
        self._peers = None
        self._attach_device(None)
        if path is not None:
            # The path and these slots refer to each other: drop the workspace now rather
            # than at the next garbage collection.
            path.ext = None

    def comm_stream(self):
        """The CUDA stream the buffer's device work runs on (see
        ``ElasticMethods.get_comm_stream``)."""
        what = "get_comm_stream"
        self.need_peers(what)
        if self.device is not None:
            return self.device.comm_stream()
        if torch.cuda.is_available():
            return torch.cuda.current_stream()
        raise RuntimeError(
            f"{what}: this machine has no CUDA: every call runs on the host, on no stream"
        )

    def local_tensor(self, dtype, size, offset, use_rdma_buffer) -> torch.Tensor:
        """A view of this process's device workspace (see
        ``ElasticMethods.get_local_buffer_tensor``)."""
        what = "get_local_buffer_tensor"
        self.need_peers(what)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{what}: dtype must be a torch.dtype, got {dtype!r}")
        error = flags_error(use_rdma_buffer=use_rdma_buffer)
        if error:
            raise ValueError(f"{what}: {error}")
        if not use_rdma_buffer:
            raise ValueError(
                f"{what}: use_rdma_buffer must be True: the device workspace is this "
                f"buffer's only one (there is no separate NVLink buffer)"
            )
        es = torch.empty(0, dtype=dtype).element_size()
        if not is_int(offset) or offset < 0 or offset % es:
            raise ValueError(
                f"{what}: offset must be an int >= 0, in bytes, and a multiple of "
                f"{str(dtype).replace('torch.', '')}'s size ({es}), got {offset!r}"
            )
        shape = None
        if size is not None:
            shape = [size] if is_int(size) else size
            try:
                shape = [int(d) for d in shape] if all(is_int(d) for d in shape) else None
            except TypeError:
                shape = None
            if shape is None or any(d < 0 for d in shape):
                raise ValueError(
                    f"{what}: size must be None or a sequence of ints >= 0 (a torch.Size), "
                    f"got {size!r}"
                )
        if self.device is None:
            raise RuntimeError(
                f"{what}: this elastic Buffer has no device workspace (it needs "
                f"num_rdma_bytes > 0 in update_memory_buffers, CUDA on this machine, a CUDA "
                f"build of mooncake and disable_ll_nvlink=False); the portable path keeps no "
                f"workspace to view"
            )
        ws = self.device.ext.workspace()  # uint8 [bytes], zero-copy, keeps the workspace
        total = ws.numel()
        if offset > total:
            raise ValueError(f"{what}: offset ({offset}) is past the workspace ({total} bytes)")
        fits = (total - offset) // es
        n = fits if shape is None else math.prod(shape)
        if n > fits:
            raise ValueError(
                f"{what}: size {shape} needs {n * es} bytes from offset {offset}; the "
                f"workspace has {total - offset} there"
            )
        view = ws[offset : offset + n * es].view(dtype)
        return view if shape is None else view.view(shape)

    @property
    def rank_bound(self) -> int:
        peers = self.need_peers("rank_bound")
        self.look()
        return peers.rank_bound

    @property
    def active_slots(self) -> list[int]:
        peers = self.need_peers("active_slots")
        self.look()
        return peers.active_slots

    def slot_state(self, slot) -> str:
        slot = self._slot_arg("slot_state", "slot", slot)
        self.look()
        return self._peers.state(slot)

    def transport_of(self, peer) -> str:
        peer = self._slot_arg("transport_of", "peer", peer)
        return self._peers.transport_of(peer)

    def mask_events(self) -> list[str]:
        """Why exchanges (or the device path's kernels) masked peers so far, oldest first."""
        return self.need_peers("mask_events").events()

    def refresh(self, num_bytes: int, seq: int) -> int:
        raise RuntimeError(
            "update_ep_member: an elastic Buffer changes its peers with connect_ranks, "
            "update_mask_buffer and disconnect_ranks"
        )

    # --- the shape of a call, who takes part, and the exchange ---------------------------

    def call_ranks(self, num_experts, what: str = "dispatch") -> int:
        """``R`` of a call with ``num_experts`` experts: their slots, or the rank bound
        when ``num_experts`` is invalid (the checks then say why)."""
        peers = self.need_peers(what)
        epr = self.num_experts_per_rank
        if is_int(num_experts) and num_experts > 0 and num_experts % epr == 0:
            r = num_experts // epr
            if peers.rank_bound <= r <= self.num_ranks:
                return r
        return peers.rank_bound

    def local_experts(self, num_experts, num_ranks: int) -> int:
        return self.num_experts_per_rank

    def experts_error(self, num_experts: int) -> str | None:
        epr, bound = self.num_experts_per_rank, self._peers.rank_bound
        if num_experts % epr or not bound <= num_experts // epr <= self.num_ranks:
            return (
                f"num_experts ({num_experts}) must be num_experts_per_rank ({epr}) times a slot "
                f"count between the rank bound ({bound}: active slots {self.active_slots}) and "
                f"the capacity ({self.num_ranks})"
            )
        return None

    def device_error(self, device: torch.device) -> str | None:
        if device.type not in ("cpu", "cuda"):
            return f"x must be a CPU or CUDA tensor, got one on {device}"
        return None

    def present(self, num_ranks: int) -> torch.Tensor:
        """bool [num_ranks], on CPU: the active slots (this one included)."""
        return torch.tensor(self._peers.mask()[:num_ranks], dtype=torch.int32) == 0

    def reject(self, device, reason: str) -> bool:
        """As ``GroupMembers.reject``: takes this slot's part in the next exchange by
        rejecting it, so that every active slot's exchange fails naming this one."""
        self._peers.reject(reason, -1)
        return True

    # --- the device path (mooncake/ep/device.py), which maps the slots -----------------

    def table_active_slots(self) -> list[int]:
        """The active slots as the slot table has them now, without looking at what the
        kernels masked (:attr:`active_slots` waits for the GPU and looks first)."""
        return self._peers.active_slots

    def device_card(self, slot: int) -> str:
        """The device card ``slot``'s process published with its metadata (hex; empty
        when it has no device workspace)."""
        return self._peers.device_meta(slot)

    def device_masks(
        self, active_ranks, R: int, device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernels' masks for a call over ``R`` slots: the slot mask (device, 1 =
        active) alone, or ``active_ranks`` with it beside."""
        view = self._dev_views.get(R)
        if view is None:
            view = self._dev_views[R] = self.device.slot_mask[:R]
        return (view, None) if active_ranks is None else (active_ranks, view)

    def device_guard(self, path, what: str) -> None:
        """Before a device launch: raises LeftOutError when the peers left this process
        out (one load: the hint they post into its segment). The workspaces of the slots
        this side leaves out are fenced as it learns of them (:meth:`look`)."""
        self._peers.check_member(what)

    def device_key(self, slot: int) -> int:
        """The fence key the device path expects in ``slot``'s signals: the incarnation
        of the process connected there (this process's own for its slot)."""
        return self._peers.incarnation if slot == self.rank else self._peers.incarnation_of(slot)

    def device_masked(self, slot: int, why: str) -> None:
        """A kernel masked ``slot`` (silent, or lost): the slot table masks it too."""
        if slot != self.rank:  # (never its own: it is not waited for across processes)
            self._peers.note_masked(slot, why)

    def watch_lost(self, ext) -> None:
        """Has this process's endpoint set the device path's lost words (``ext``, an
        EpDevice) of the slots it sees lost, so that kernels stop waiting for them."""
        self._peers.watch_peers(ext.lost_listener())

    def told_count(self, timeout_us: int) -> int:
        """The highest call count the peers published since the last call told this
        process, waiting up to the call's budget for each (-1: the buffer's
        timeout_ms; none: metadata_timeout_ms); 0 when none has. The device path moves
        its count up to it (``ElasticPeers::await_call_count``)."""
        self.count_pending = False
        timeout_ms = self.timeout_ms if timeout_us == -1 else max(1, _budget_ms(timeout_us))
        return self._peers.await_call_count(timeout_ms)

    def all_to_all(self, device, out, inp, out_splits, in_splits, timeout_us):
        """As ``GroupMembers.all_to_all``, among the active slots; runs at once."""

        def row_bytes(t: torch.Tensor) -> int:
            return t.element_size() * (t[0].numel() if t.dim() > 1 else 1)

        rb = row_bytes(out if out.numel() else inp) if (out.numel() or inp.numel()) else 0
        timeout_ms = _budget_ms(timeout_us)
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
        rejected = self._peers.rejections()
        if rejected:
            raise ValueError(
                "; ".join(
                    f"the op was not run: rank {slot} rejected it: {why}" for slot, why in rejected
                )
            )
        if host_out is not out:
            out.copy_(host_out)
        return _Done()
