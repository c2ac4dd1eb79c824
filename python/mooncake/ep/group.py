"""The members of an EP Buffer built on a process group (``Buffer(group, ...)``).

Who the ranks are (the group's), which of them take part right now (the
group's rank-health mask, ``pg.get_active_ranks``) and how an exchange among
them runs (the group's mooncake backend, ``alltoall_base`` with a per-exchange
timeout). ``elastic.Slots`` answers the same questions for an elastic
Buffer; the Buffer and its paths only ask them through these methods. The
device path maps the members' workspaces itself (``device.DevicePath.connect_group``,
when the Buffer is made and after ``update_ep_member``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .. import pg
from .._checks import MAX_INT, is_int
from ..errors import LeftOutError
from . import portable_rows


class GroupMembers:
    """The ranks of ``group``, as its mooncake backend sees them."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = group.rank()
        self.num_ranks = group.size()
        self._events: list[str] = []  # ranks the device path's kernels masked
        self._mask_version = -1  # the group's view_version that _mask_dev shows
        self._mask_dev = torch.zeros(0, dtype=torch.int32)
        self._old_masks: list[torch.Tensor] = []  # _mask_dev's before: graphs may read them
        # The device path's fence key: the generation of the EP membership this process
        # agreed on last (agree); a process left out keeps an older one.
        self.fence_key = 0
        self._backends: tuple | None = None  # the group's mooncake backends (backends())
        self._guard_version = -1  # the view_version device_guard fenced for
        self._fenced: set[int] = set()  # ranks whose workspaces device_guard fenced

    # --- the shape of a call ----------------------------------------------------------

    def call_ranks(self, num_experts, what: str = "dispatch") -> int:
        """``R`` of a call with ``num_experts`` experts (``what``: the calling method)."""
        return self.num_ranks

    def local_experts(self, num_experts, num_ranks: int) -> int:
        """``E/R``: the width of the counts rows (0 when num_experts is invalid)."""
        valid = is_int(num_experts) and num_ranks <= num_experts < MAX_INT
        return num_experts // num_ranks if valid else 0

    def experts_error(self, num_experts: int) -> str | None:
        if num_experts % self.num_ranks:
            return (
                f"num_experts ({num_experts}) must be divisible by the number of ranks "
                f"({self.num_ranks})"
            )
        return None

    def device_error(self, device: torch.device) -> str | None:
        """Why the group's exchanges cannot move tensors on ``device`` (None: they can)."""
        try:
            self.backend_for(device)
        except (RuntimeError, ValueError):
            return f"x is on {device}, but the group has no mooncake backend for {device.type}"
        return None

    # --- who takes part, and the exchange ---------------------------------------------

    def present(self, num_ranks: int) -> torch.Tensor:
        """bool [num_ranks], on CPU: the ranks that take part right now."""
        return pg.get_active_ranks(self.group)[:num_ranks].cpu().bool()

    def all_to_all(self, device, out, inp, out_splits, in_splits, timeout_us):
        """Starts an uneven exchange of ``inp``'s rows (splits per rank); returns a Work.
        ``device`` None: this rank rejected its call and only takes part. ``timeout_us``
        is this exchange's own budget, from its start (-1: the group's timeout): a call
        of several exchanges gives each the whole ``timeout_us``."""
        return portable_rows.all_to_all(
            self.backend_for(device), out, inp, out_splits, in_splits, timeout_us
        )

    def reject(self, device, reason: str) -> bool:
        """Takes this rank's part in the next exchange without running it, so that every
        member's exchange fails naming this rank and ``reason``. False where the
        exchange's backend cannot (then only this rank knows)."""
        backend = self.backend_for(device)
        if not hasattr(backend, "reject_next"):
            return False
        try:
            backend.reject_next(reason).wait()
        except ValueError:
            pass  # this rank's own part of the rejection
        return True

    def backend_for(self, device: torch.device | None):
        if device is None or device.type == "cpu":
            return pg._backend_of(self.group)
        b = self.group._get_backend(torch.device(device.type))
        if not isinstance(b, pg.MooncakeBackend):
            raise ValueError(
                f"x is on {device}, but the group has no mooncake backend for {device.type}"
            )
        return b

    # --- membership changes -----------------------------------------------------------

    def agree(self, what: str, num_bytes: int, seq: int = 0) -> int:
        """Checks, with every present member, that all have the same workspace size and
        group size (collective: every member calls it); returns the highest call number
        ``seq`` among them, which every member takes as its own (a replacement starts
        at 0, the others where they are: the device path tags its signals with it).
        The members also move to a new fence key, above every one of theirs: a process
        that was left out before keeps its old one, so nothing it sends is taken.

        Raises:
            ValueError: a member has another ``num_bytes``.
        """
        mine = torch.tensor([1, num_bytes, self.num_ranks, seq, self.fence_key])
        rows = self.all_gather(mine).reshape(self.num_ranks, 5).tolist()
        for r, (present, nbytes, size, _, _) in enumerate(rows):
            if present and (nbytes, size) != (num_bytes, self.num_ranks):
                raise ValueError(
                    f"{what}: ranks disagree on num_ep_buffer_bytes: rank {r} has {nbytes}, "
                    f"rank {self.rank} has {num_bytes}"
                )
        self.fence_key = max(row[4] for row in rows if row[0]) + 1
        return max(row[3] for row in rows if row[0])

    def all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every member's ``mine`` (a 1-D CPU tensor, the same size on each), as one CPU
        tensor of ``num_ranks`` rows (collective). Members outside the view send zeros."""
        device = self._gather_device()
        everyone = torch.zeros(self.num_ranks * mine.numel(), dtype=mine.dtype, device=device)
        self._all_gather_into(everyone, mine.to(device))
        return everyone.cpu()

    def control_device(self) -> torch.device:
        """Where the group's small control exchanges run (a call's counts, the
        ElasticBuffer's agreement): the same device on every rank, whatever device a
        call's tensors are on, so that a rank that rejects its call still meets the
        others' exchange."""
        return self._gather_device()

    def _gather_device(self) -> torch.device:
        try:
            cpu = isinstance(self.group._get_backend(torch.device("cpu")), pg.MooncakeBackend)
        except (RuntimeError, ValueError):
            cpu = False
        return torch.device("cpu" if cpu else "cuda")

    def _all_gather_into(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        self.backend_for(out.device)._allgather_base(out, mine).wait()

    def refresh(self, num_bytes: int, seq: int) -> int:
        """``Buffer.update_ep_member``: the members after the group changed membership
        agree again (the device path then reconnects); returns the call number to go on
        from, as :meth:`agree`."""
        return self.agree("update_ep_member", num_bytes, seq)

    def mask_events(self) -> list[str]:
        """Ranks the device path's kernels masked (a rank silent past a deadline). The
        process group's own exchanges leave failed ranks out instead, and
        ``pg.get_active_ranks`` shows it."""
        return list(self._events)

    # --- the device path (mooncake/ep/device.py), which maps every member at once -------

    def backends(self) -> tuple:
        """The group's mooncake backends (``pg._iter_backends``), looked up once: the
        device path reads them before every launch."""
        if self._backends is None:
            self._backends = tuple(pg._iter_backends(self.group))
        return self._backends

    def device_masks(self, active_ranks, R: int, device) -> tuple[torch.Tensor, None]:
        """The kernels' masks for a call: ``active_ranks``, or the group's view kept on
        the device (copied again only when the view changes or a kernel masked a rank:
        reading it costs several torch ops, more than the launch; never inside a CUDA
        graph capture, which keeps the last); no slot mask."""
        if active_ranks is not None:
            return active_ranks, None
        version = self.backends()[0].view_version()
        if version != self._mask_version or self._mask_dev.device != device:
            if self._mask_dev.device == device and torch.cuda.is_current_stream_capturing():
                return self._mask_dev, None  # no host copy in a capture: the last view
            # The one before stays alive: a graph captured with it replays it.
            self._old_masks.append(self._mask_dev)
            now = self.present(R).to(torch.int32)
            self._mask_version, self._mask_dev = version, now.to(device)
        return self._mask_dev, None

    def device_masked(self, rank: int, why: str) -> None:
        """A kernel masked ``rank`` (silent past a deadline, or lost). The mask it wrote
        into the kept view holds for that call only: the next one takes the group's view
        again, as the portable path does (a rank alive but slow once is not dropped for
        good while it still counts the others in, each side losing the other's tokens;
        one that is gone or hung leaves the group's view soon, and its lost word masks it
        at once meanwhile)."""
        self._events.append(why)
        self._mask_version = -1

    def device_guard(self, path, what: str) -> None:
        """Before a device launch: raises LeftOutError when the group left this rank out
        (one load per mooncake backend: the others post it into its segment), and when
        the group's view changed, fences the device workspaces of the mapped ranks it
        no longer holds (``DevicePath.fence_slot``): they were left out, and a kernel of
        theirs still running stops storing into this one's."""
        backends = self.backends()
        for b in backends:
            if b.left_out():
                raise LeftOutError(
                    f"{what}: rank {self.rank} was left out of the group by the other ranks "
                    f"(it was stopped, hung or gone past MOONCAKE_HANG_MS, or deactivated); "
                    f"it launches nothing more. It can come back only as a new process: "
                    f"create its group with MooncakeBackendOptions(..., is_extension=True), "
                    f"pg.join_group() and a new Buffer, while the others call "
                    f"pg.recover_ranks and update_ep_member",
                    [self.rank],
                )
        if not backends:
            return
        version = backends[0].view_version()
        if version == self._guard_version:
            return
        self._guard_version = version
        present = self.present(self.num_ranks).tolist()
        for r, here in enumerate(present):
            if not here and r != self.rank and r not in self._fenced:
                path.fence_slot(r)
                self._fenced.add(r)

    def connected(self) -> None:
        """The device path mapped the members again (``connect`` fenced those that left)."""
        self._fenced.clear()
        self._guard_version = -1
        self._mask_version = -1

    def watch_lost(self, ext) -> None:
        """Has the group's transport set the device path's lost words (``ext``, an
        EpDevice) of the peers it sees lost, so that kernels stop waiting for them."""
        pg._backend_of(self.group).watch_peers(ext.lost_listener())

    #: Never: the members agree on the call count when the Buffer is made (:meth:`agree`).
    count_pending = False


def members_of(group: dist.ProcessGroup, owner: str, stall: str) -> GroupMembers:
    """The members of ``group``: its mooncake backend's, or a foreign group's with a
    warning that nothing detects failed ranks (``owner``: the class; ``stall``: what a dead
    rank stalls)."""
    if has_mooncake_backend(group):
        return GroupMembers(group)
    warnings.warn(
        f"mooncake {owner}: the group has no mooncake backend: failed ranks are not "
        f"detected{stall}",
        RuntimeWarning,
        stacklevel=3,
    )
    return ForeignMembers(group)


def has_mooncake_backend(group: dist.ProcessGroup) -> bool:
    try:
        pg._backend_of(group)
    except ValueError:
        return False
    return True


def backend_serves(group: dist.ProcessGroup, device_type: str) -> bool:
    """Whether ``group`` has a backend for tensors on ``device_type``."""
    try:
        group._get_backend(torch.device(device_type))
    except (RuntimeError, ValueError):
        return False
    return True


class _Done:
    """A finished exchange, for callers that wait on a Work."""

    def wait(self) -> bool:
        return True


class ForeignMembers(GroupMembers):
    """The ranks of a group without a mooncake backend (an engine's NCCL or gloo EP
    group). Its backend neither detects failed ranks nor bounds an exchange: every rank
    takes part unless the caller's ``active_ranks`` says otherwise, exchanges run under
    the group's own timeout, and a rank that dies stalls the portable path's exchanges
    until that timeout (NCCL's watchdog, gloo's). The device path's kernels still mask
    a silent peer after ``timeout_us``, for that call (nothing tells a slow rank from a
    dead one here: the next call waits for it again)."""

    def device_error(self, device: torch.device) -> str | None:
        if backend_serves(self.group, device.type):
            return None
        return f"x is on {device}, but the group has no backend for {device.type}"

    def watch_lost(self, ext) -> None:
        """Nobody watches the peers: the kernels wait for a dead one until the deadline."""

    def device_guard(self, path, what: str) -> None:
        """Nothing tells this rank it was left out: only the fence keys (agree) and the
        mappings a new connect fences protect the others."""

    def present(self, num_ranks: int) -> torch.Tensor:
        return torch.ones(num_ranks, dtype=torch.bool)

    def _exchange_device(self, device: torch.device) -> torch.device:
        """Where the group can move tensors that live on ``device`` (CPU tensors go
        through the GPU for an NCCL group, CUDA tensors through the host for a CPU-only
        one)."""
        if backend_serves(self.group, device.type):
            return device
        if device.type == "cpu":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_to_all(self, device, out, inp, out_splits, in_splits, timeout_us):
        """As :meth:`GroupMembers.all_to_all`, under the group's own timeout (a foreign
        backend takes no per-exchange budget)."""
        out_splits, in_splits = [int(s) for s in out_splits], [int(s) for s in in_splits]
        where = self._exchange_device(out.device)
        if where == out.device:
            return dist.all_to_all_single(
                out, inp, out_splits, in_splits, group=self.group, async_op=True
            )
        staged = torch.empty(out.shape, dtype=out.dtype, device=where)
        dist.all_to_all_single(staged, inp.to(where), out_splits, in_splits, group=self.group)
        out.copy_(staged)
        return _Done()

    def reject(self, device, reason: str) -> bool:
        return False  # no way to fail the others' exchange: only this rank knows

    def backend_for(self, device: torch.device | None):
        raise ValueError("the group has no mooncake backend")

    def _gather_device(self) -> torch.device:
        return self._exchange_device(torch.device("cpu"))

    def _all_gather_into(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        # torch 2.13 renamed it (the old name warns); the GPU machine's 2.11 has only that.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=self.group)

    def device_masks(self, active_ranks, R: int, device) -> tuple[torch.Tensor, None]:
        if active_ranks is not None:
            return active_ranks, None
        if self._mask_dev.device != device or self._mask_dev.numel() != R:
            self._mask_dev = torch.ones(R, dtype=torch.int32, device=device)
        elif self._mask_version == -1:  # a kernel masked a rank: for that call only
            self._mask_dev.fill_(1)
        self._mask_version = 0
        return self._mask_dev, None
