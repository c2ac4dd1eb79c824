"""The mooncake process-group backends and their helpers.

Importing this module registers two ``torch.distributed`` backends:

* ``mooncake-cpu`` for CPU tensors (shared memory between processes on one
  host, tcp between hosts);
* ``mooncake`` for CUDA tensors, and CPU tensors in the same group (only
  when this build has CUDA). Its ops stage device tensors through pinned
  host memory on a stream of its own, ordered after the caller's current
  stream; ``Work.wait()`` makes the caller's stream wait for the results.

Use it like gloo::

    import torch.distributed as dist
    from mooncake import pg

    dist.init_process_group("mooncake-cpu", rank=rank, world_size=world_size)
    # or, with a rank-health mask the backend keeps up to date:
    active = torch.ones(world_size, dtype=torch.int32)
    dist.init_process_group("mooncake-cpu", rank=rank, world_size=world_size,
                            pg_options=pg.MooncakeBackendOptions(active))

When ranks fail, the survivors' ops go on over the rest. An op that cannot
complete raises :class:`PeerFailedError` (``.ranks``: the failed ranks, e.g. the
root of a ``broadcast`` that died); a rank the others left out (taken for failed)
gets :class:`LeftOutError` from its next op. Both are ``RuntimeError`` subclasses.
``MooncakeBackendOptions(..., auto_deactivate_on_failure=False)`` hands failures to
the application instead (:func:`sync_after_failure`, :func:`deactivate_ranks`).
"""

from __future__ import annotations

import ctypes
import math
import os
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from mooncake._checks import int_list, is_int, is_int64
from mooncake._loader import load_extension
from mooncake.errors import LeftOutError, PeerFailedError

_ext = load_extension()

MooncakeBackendOptions = _ext.MooncakeBackendOptions
MooncakeBackend = _ext.MooncakeBackend
TransferEngine = _ext.TransferEngine
#: What ``recover_ranks``/``activate_ranks``/``deactivate_ranks`` return: ``status``
#: (:class:`ProposalStatus`), ``new_epoch``, ``dropped_ranks``, ``reject_reason``.
ProposeViewUpdateResponse = _ext.ProposeViewUpdateResponse
ProposalStatus = _ext.ProposalStatus  # Rejected, Applied, AppliedWithDroppedRanks
ViewUpdateStatus = ProposalStatus  # upstream's earlier name
#: What ``sync_after_failure`` returns: ``status`` (:class:`SyncAfterFailureStatus`) and
#: ``reject_reason``.
SyncAfterFailureResponse = _ext.SyncAfterFailureResponse
SyncAfterFailureStatus = _ext.SyncAfterFailureStatus  # Reconciled, NoPending, Rejected

__all__ = [
    "MooncakeBackendOptions",
    "TransferEngine",
    "PeerFailedError",
    "LeftOutError",
    "ProposeViewUpdateResponse",
    "ProposalStatus",
    "ViewUpdateStatus",
    "SyncAfterFailureResponse",
    "SyncAfterFailureStatus",
    "createMooncakeBackend",
    "createMooncakeCpuBackend",
    "set_host_ip",
    "set_device_filter",
    "set_transfer_engine",
    "set_collective_timeout_us",
    "set_p2p_timeout_us",
    "set_fault_reconciliation_window_us",
    "get_preferred_hca",
    "get_active_ranks",
    "get_num_synced_ranks",
    "get_op_paths",
    "watch_loss_times",
    "get_current_epoch",
    "extend_group_size_to",
    "get_peer_state",
    "recover_ranks",
    "activate_ranks",
    "deactivate_ranks",
    "sync_after_failure",
    "get_failed_ranks_hint",
    "get_local_success",
    "join_group",
]

_engine: TransferEngine | None = None  # set_transfer_engine's
_own_engine: TransferEngine | None = None  # the module's, made on first use


def _default_engine() -> TransferEngine:
    global _own_engine
    if _engine is not None:
        return _engine
    if _own_engine is None:
        _own_engine = TransferEngine()
    return _own_engine


#: Where the kernel lists RDMA devices and PCI functions (a test points these elsewhere).
_SYSFS_IB = "/sys/class/infiniband"
_SYSFS_PCI = "/sys/bus/pci/devices"


def _rdma_devices() -> list[str]:
    return sorted(os.listdir(_SYSFS_IB)) if os.path.isdir(_SYSFS_IB) else []


def _pci_path(link: str) -> list[str]:
    """The chain of PCI functions from the root complex down to the device ``link``
    (a sysfs link) points at, e.g. ``["pci0000:00", "0000:00:01.0", "0000:01:00.0"]``."""
    parts = os.path.realpath(link).split(os.sep)
    return [p for p in parts if p.startswith("pci") or p.count(":") == 2]


def nearest_hca(gpu_path: list[str], hcas: dict[str, list[str]]) -> str:
    """The HCA whose PCI path shares the longest prefix with ``gpu_path`` (the same switch
    beats the same root complex, which beats another socket); ties go to the first name."""

    def shared(path: list[str]) -> int:
        n = 0
        for a, b in zip(gpu_path, path, strict=False):
            if a != b:
                break
            n += 1
        return n

    return min(sorted(hcas), key=lambda name: -shared(hcas[name]))


def _is_netdev(name: str) -> bool:
    """Whether ``name`` is a network interface here (UCX takes those too, e.g. for tcp)."""
    return os.path.isdir(os.path.join("/sys/class/net", name))


def set_host_ip(host_ip: str) -> None:
    """Sets the address the tcp transport publishes for this process.

    Call before ``init_process_group``. Peers on other hosts connect to it;
    peers on this host use shared memory regardless.

    Raises:
        ValueError: ``host_ip`` is not a non-empty string.
    """
    if not isinstance(host_ip, str) or not host_ip:
        raise ValueError(f"set_host_ip: host_ip must be a non-empty string, got {host_ip!r}")
    _default_engine().host_ip = host_ip


def set_device_filter(filters: list[str]) -> None:
    """Restricts which devices the ucx transport may use: HCAs (``"mlx5_0"``: each of its
    ports) or UCX device names (``"mlx5_0:1"``, ``"eth0"``).

    Call before ``init_process_group``. A warning says which of the named HCAs do not
    exist on this host, and that the filter has no effect when this build has no ucx
    transport (groups then move data with shared memory and tcp).

    Raises:
        ValueError: ``filters`` is not a list of strings.
    """
    if isinstance(filters, (str, bytes)) or not isinstance(filters, Iterable):
        raise ValueError(f"set_device_filter: filters must be a list of strings, got {filters!r}")
    filters = list(filters)
    if not all(isinstance(f, str) for f in filters):
        raise ValueError(f"set_device_filter: filters must be a list of strings, got {filters!r}")
    _default_engine().device_filter = filters
    present = _rdma_devices()
    missing = [f for f in filters if ":" not in f and f not in present and not _is_netdev(f)]
    problems = []
    if "ucx" not in TransferEngine.available_transports():
        problems.append(
            "it has no effect: this build has no ucx transport and moves data with shared "
            "memory and tcp"
        )
    if missing:
        problems.append(f"devices not present on this host: {missing}")
    if problems:
        warnings.warn("mooncake: set_device_filter: " + "; ".join(problems), RuntimeWarning, 2)


def set_transfer_engine(engine: TransferEngine | None) -> None:
    """Makes process groups created from now on use ``engine``; ``None`` goes back to
    the module's own engine (with what ``set_host_ip``/``set_device_filter`` set on it).

    Several groups may share one engine; it must outlive them.

    Raises:
        TypeError: ``engine`` is neither a ``mooncake.TransferEngine`` nor None.
    """
    if engine is not None and not isinstance(engine, TransferEngine):
        raise TypeError(
            f"set_transfer_engine: engine must be a mooncake.TransferEngine or None, got "
            f"{type(engine)}"
        )
    global _engine
    _engine = engine


def _microseconds(what: str, us, low: int) -> int:
    """``us`` (an int >= ``low``) in whole milliseconds, rounded up."""
    if not is_int(us) or not low <= us < 2**63:
        raise ValueError(f"{what}: us must be an int >= {low} (microseconds), got {us!r}")
    return math.ceil(us / 1000)


def set_collective_timeout_us(us: int) -> None:
    """Sets the collective-op timeout of process groups created from now on: a member
    that does not take part in an op within it is taken for failed. Rounded up to whole
    milliseconds; it wins over ``MOONCAKE_PG_TIMEOUT_MS`` and ``init_process_group``'s
    ``timeout`` (ranks that die are found at once, whatever it is).

    Raises:
        ValueError: ``us`` is not an int >= 1.
    """
    _ext.set_group_default(
        "collective_timeout_ms", _microseconds("set_collective_timeout_us", us, 1)
    )


def set_p2p_timeout_us(us: int) -> None:
    """Sets the timeout of ``send``/``recv`` (and their async forms) of process groups
    created from now on, rounded up to whole milliseconds (the default: the collective
    timeout).

    Raises:
        ValueError: ``us`` is not an int >= 1.
    """
    _ext.set_group_default("p2p_timeout_ms", _microseconds("set_p2p_timeout_us", us, 1))


def set_fault_reconciliation_window_us(us: int) -> None:
    """Sets, for process groups created from now on, how long members have to answer a
    recovery once the failed op's own deadline has passed before the survivors settle
    without them (default 500 ms, capped by the op's timeout), rounded up to whole
    milliseconds. A dead rank never costs this: it is found at once.

    Raises:
        ValueError: ``us`` is not an int >= 0.
    """
    _ext.set_group_default(
        "report_grace_ms", _microseconds("set_fault_reconciliation_window_us", us, 0)
    )


def _iter_backends(group: dist.ProcessGroup):
    """The group's mooncake backends, the CPU one first (a group made with both a
    ``mooncake-cpu`` and a ``mooncake`` backend has two; one serving both devices is
    given once)."""
    seen = None
    for device in ("cpu", "cuda"):
        try:
            b = group._get_backend(torch.device(device))
        except (RuntimeError, ValueError):
            continue
        if isinstance(b, MooncakeBackend) and b is not seen:
            seen = b
            yield b


def _backend_of(backend) -> MooncakeBackend:
    """Accepts a ProcessGroup (e.g. ``dist.group.WORLD``) or a mooncake backend."""
    if isinstance(backend, MooncakeBackend):
        return backend
    if backend is None:
        backend = dist.group.WORLD
    if isinstance(backend, dist.ProcessGroup):
        for b in _iter_backends(backend):
            return b
        raise ValueError("backend: this process group has no mooncake backend")
    raise ValueError(
        f"backend must be a ProcessGroup or a mooncake backend, got {type(backend).__name__}"
    )


def _view_version_reader(backend: MooncakeBackend) -> Callable[[], int]:
    """``backend.view_version`` as a function that reads the backend's word in place
    (ctypes), for callers that read it on every call; the function keeps the backend
    (and so the word) alive."""
    word = ctypes.c_int64.from_address(backend.view_version_address())

    def read(word=word, keep=backend) -> int:
        return word.value

    return read


def get_preferred_hca(backend, location: str) -> str:
    """The RDMA device (HCA) nearest to ``location``: for ``"cuda:N"`` the one closest to
    that GPU on the PCI tree (sysfs), for ``"cpu"`` the first. Only devices the device
    filter allows (``set_device_filter``) are considered.

    Raises:
        ValueError: ``location`` is not ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` of a visible
            GPU.
        RuntimeError: this host has no RDMA device (other hosts are then reached over
            tcp), or the device filter leaves none.
    """
    _backend_of(backend)
    if not isinstance(location, str):
        raise ValueError(f"get_preferred_hca: location must be a device string, got {location!r}")
    try:
        device = torch.device(location)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"get_preferred_hca: location must be 'cpu', 'cuda' or 'cuda:N', got {location!r}"
        )
    devices = _rdma_devices()
    allowed = [f.split(":")[0] for f in _default_engine().device_filter]
    if allowed:
        devices = [d for d in devices if d in allowed]
    if not devices:
        raise RuntimeError(
            f"get_preferred_hca({location!r}): no RDMA device on this host"
            + (f" among the device filter {allowed}" if allowed else f" ({_SYSFS_IB} is empty)")
            + "; other hosts are reached over tcp"
        )
    if device.type == "cpu":
        return devices[0]
    # is_available() first: current_device() on a host without a GPU raises torch's error.
    if not torch.cuda.is_available():
        raise ValueError(f"get_preferred_hca: location {location!r} names no visible GPU")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"get_preferred_hca: location {location!r} names no visible GPU")
    props = torch.cuda.get_device_properties(index)
    bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    gpu = _pci_path(os.path.join(_SYSFS_PCI, bus))
    hcas = {d: _pci_path(os.path.join(_SYSFS_IB, d, "device")) for d in devices}
    return nearest_hca(gpu, hcas)


def get_active_ranks(backend=None) -> torch.Tensor:
    """The backend's rank-health mask: int32 ``[max_world_size]``, 1 = active.

    It is the tensor passed as ``MooncakeBackendOptions.active_ranks`` when
    one was given: the backend updates it in place whenever the group's
    membership changes (a rank failed and was left out, or ranks were
    recovered). Every collective result covers exactly the ranks marked 1
    when it returned.
    """
    return _backend_of(backend).active_ranks()


def get_num_synced_ranks(backend=None) -> int:
    """How many ranks the backend's collectives currently run over.

    This is the number of active ranks (the 1s in :func:`get_active_ranks`):
    the members of the group's current view, which all agreed on it.
    """
    return _backend_of(backend).num_synced_ranks()


def get_op_paths(backend=None) -> dict[str, int]:
    """How the group's ops on CUDA tensors ran so far: ``{"device": n, "staged": m,
    "direct": k}``, ops on the device plane (kernels over the members' mapped GPU memory)
    and ops staged through host memory (a size or op the plane does not serve, or a peer
    it cannot reach); ``direct`` counts the device plane's ops that ran on the
    device-driven kernels (no host round; a captured one counts once, when captured; a
    coalesced call counts one device op and one direct op per tensor). With
    ``MOONCAKE_CUDA_MAPPED=1``, ``mapped`` and ``mapped_planed`` count the pieces of
    all_reduces past the device-driven bound that read the ranks' tensors in place, and
    those that ran on the plane instead (a tensor's first op, or a failure). With
    ``MOONCAKE_CUDA_P2P_BYTES`` set, ``p2p_device`` counts the sends and recvs that went
    device to device. Counted as the ops are issued, on this rank. Zeros for a
    ``mooncake-cpu`` group."""
    b = _backend_of(backend)
    if hasattr(b, "op_paths"):
        return b.op_paths()
    return {"device": 0, "staged": 0, "direct": 0, "mapped": 0, "mapped_planed": 0, "p2p_device": 0}


def watch_loss_times(backend=None):
    """Starts keeping when this process's transport tells of each peer's loss, for
    measuring where a failure's time goes (a peer's death, this process's news of it,
    the op that returns after it). Returns a ``LossTimes``: ``gone_at(rank)``, the last
    time ``rank`` was told gone (its process exited or its link closed), and
    ``silent_at(rank)``, told silent past ``MOONCAKE_HANG_MS``; each in
    ``time.monotonic()`` seconds, or None. Peers already gone are told at once, so
    watch before the faults you time. Local to this process; the watch ends when the
    object is dropped. Ranks are slots in ``[0, max_world_size)``."""
    b = _backend_of(backend)
    times = _ext.LossTimes(int(b.active_ranks().numel()))
    b.watch_peers(times.listener())
    return times


def extend_group_size_to(backend, size: int) -> None:
    """Makes ranks up to ``size`` joinable (they stay inactive until recovered).

    The slots themselves are reserved when the group is created, with
    ``MooncakeBackendOptions(..., max_world_size=N)``; this admits ranks in
    ``[world size, size)`` to :func:`recover_ranks`. Local to the calling
    process (call it on every healthy rank).

    Raises:
        ValueError: ``size`` is not an int, or is below the current size or above
            ``max_world_size``.
    """
    if not is_int64(size):
        raise ValueError(f"extend_group_size_to: size must be an int, got {size!r}")
    _backend_of(backend).extend_group_size_to(size)


def get_peer_state(backend, ranks: list[int]) -> list[bool]:
    """For each of ``ranks``, whether a new process waits to join as that rank.

    A process waits once it has created its process group with
    ``MooncakeBackendOptions(..., is_extension=True)`` (it has published its
    address). Collective among the current healthy ranks, which all get the
    same answer: call it on every one of them, in the same order as their
    other collectives.

    Raises:
        ValueError: ``ranks`` is not a list of ints, or a rank is outside
            ``[0, max_world_size)``.
    """
    return _backend_of(backend).get_peer_state(int_list("get_peer_state", "ranks", ranks))


def _is_world(group, b) -> bool:
    world = dist.group.WORLD
    return group is None or group is world or b is _backend_of(world)


def _mooncake_subgroups():
    """This process's mooncake subgroups, in creation order, with their rank maps."""
    world = dist.distributed_c10d._world
    for group, ranks in world.pg_group_ranks.items():
        if group is dist.group.WORLD:
            continue
        try:
            yield group, _backend_of(group), ranks
        except ValueError:
            continue  # not a mooncake group


def recover_ranks(backend, ranks: list[int]) -> ProposeViewUpdateResponse:
    """Admits the processes waiting to join as ``ranks`` into the group.

    Collective among the current healthy ranks. Afterwards the ranks are
    active (``get_active_ranks`` shows them) and take part in every
    collective; the joining processes return from :func:`join_group`.

    Called on the default group, it then recovers the same processes in every
    subgroup (``dist.new_group``) that holds them, in creation order; a joining
    process creates its subgroups, in the same order as the healthy ranks did,
    before it calls :func:`join_group`.

    Returns:
        The group's (the default group's) :class:`ProposeViewUpdateResponse`:
        ``Applied`` with the new epoch, or ``AppliedWithDroppedRanks`` with
        ``dropped_ranks`` the named ranks that died while being admitted and the
        members lost meanwhile.

    Raises:
        ValueError: on every healthy rank, when ``ranks`` is not a list of ints,
            or a rank is active, out of range, named twice, beyond the extended
            size, or has no process waiting (poll :func:`get_peer_state` first);
            the group stays usable.
    """
    ranks = int_list("recover_ranks", "ranks", ranks)
    b = _backend_of(backend)
    response = b.recover_ranks(ranks)
    if not _is_world(backend, b):
        return response
    for _, sub, rank_map in _mooncake_subgroups():
        sub_ranks = [rank_map[r] for r in ranks if r in rank_map]
        if sub_ranks:
            sub.recover_ranks(sub_ranks, wait=True)
    return response


def activate_ranks(backend, ranks: list[int]) -> ProposeViewUpdateResponse:
    """:func:`recover_ranks` under upstream's other name (the same call)."""
    return recover_ranks(backend, ranks)


def deactivate_ranks(backend, ranks: list[int]) -> ProposeViewUpdateResponse:
    """Removes ``ranks`` from the group's view, whether they are dead or alive.

    Collective among the ranks that stay: call it on each of them, in the same order
    relative to their other collectives, naming the same ranks. They agree on a view
    without ``ranks`` (the epoch goes up); a live rank removed this way gets
    :class:`LeftOutError` from its next op on the group, and can come back only as a new
    process (``is_extension=True``, :func:`recover_ranks`). Only this group changes, not
    its subgroups.

    Returns:
        A :class:`ProposeViewUpdateResponse`: ``Applied`` with the new epoch;
        ``AppliedWithDroppedRanks`` when more ranks left (a member that died or did not
        take part meanwhile: ``dropped_ranks``); ``Rejected`` when a named rank is not
        active (``reject_reason`` says which; nothing changes).

    Raises:
        ValueError: ``ranks`` is not a non-empty list of ints, or a rank is out of
            range, named twice, or this rank; nothing changes.
        LeftOutError: another rank named this one.
    """
    ranks = int_list("deactivate_ranks", "ranks", ranks)
    return _backend_of(backend).deactivate_ranks(ranks)


def sync_after_failure(backend) -> SyncAfterFailureResponse:
    """Settles the group's view after a failure an op met.

    When this rank holds a failure no view has settled yet (with
    ``auto_deactivate_on_failure=False`` or ``auto_sync_on_failure=False`` the op that
    met it raised instead), a member has failed, or the other ranks started settling:
    the surviving ranks agree on a view without the failed ones (collective among them:
    call it on each survivor) and it returns ``Reconciled``; ops then run among them.
    Otherwise it returns ``NoPending`` at once. A process still waiting in
    :func:`join_group` gets ``Rejected``.

    Raises:
        LeftOutError: the others left this rank out.
        TimeoutError: the survivors did not settle within the group's timeout.
    """
    return _backend_of(backend).sync_after_failure()


def get_current_epoch(backend=None) -> int:
    """The epoch of the group's view as :func:`get_active_ranks` shows it: 0 at creation,
    one more with every membership change (a failure settled, ranks recovered or
    deactivated)."""
    return _backend_of(backend).current_epoch()


def _work_arg(what: str, work):
    if not isinstance(work, dist.Work):
        raise TypeError(f"{what}: work must be a torch.distributed Work, got {type(work).__name__}")
    return work


def get_failed_ranks_hint(work) -> torch.Tensor:
    """Which peers failed during the op of ``work`` (an async op's Work of a mooncake
    group, p2p included): int32 ``[max_world_size]`` on the CPU, 1 = that rank failed
    (was left out during the op, or the op failed on it). Waits for the op to end first
    (bounded by its timeout); a Work of another backend gives an empty tensor.

    Raises:
        TypeError: ``work`` is not a ``torch.distributed`` Work.
    """
    return _ext.get_failed_ranks_hint(_work_arg("get_failed_ranks_hint", work))


def get_local_success(work) -> bool:
    """True iff the op of ``work`` ended without an error and no peer failed during it
    (see :func:`get_failed_ranks_hint`); False for a Work of another backend.

    Raises:
        TypeError: ``work`` is not a ``torch.distributed`` Work.
    """
    return _ext.get_local_success(_work_arg("get_local_success", work))


def join_group(backend=None) -> None:
    """Joining side: blocks until the healthy ranks recover this process.

    Call it after ``init_process_group(..., pg_options=MooncakeBackendOptions(
    active_ranks, is_extension=True, max_world_size=N))``. Returns once the
    healthy ranks have called :func:`recover_ranks` with this rank; from then
    on this process is a member like any other. Called on the default group,
    it then joins every subgroup this process created before (in creation
    order), as the healthy ranks recover it there.

    Raises:
        ValueError: the group was not created with ``is_extension=True``.
        TimeoutError: not recovered within the group's timeout.
        PeerFailedError: no process of the group runs any more (none can admit
            this one; a process on another host counts as running).
    """
    b = _backend_of(backend)
    b.join_group()
    if not _is_world(backend, b):
        return
    for _, sub, _ in _mooncake_subgroups():
        if sub.joining:
            sub.join_group()


def _joining_default_group() -> bool:
    """Whether this process's default group still waits in join_group."""
    default = dist.distributed_c10d._world.default_pg
    if default is None:
        return False
    try:
        return _backend_of(default).joining
    except ValueError:
        return False


def _create(dist_backend_opts, backend_options, cuda: bool):
    if backend_options is not None and not isinstance(backend_options, MooncakeBackendOptions):
        raise ValueError(
            f"pg_options must be mooncake.pg.MooncakeBackendOptions, got "
            f"{type(backend_options).__name__}"
        )
    if backend_options is None and _joining_default_group():
        # A subgroup created by a process that joins a running group joins
        # the subgroup as it runs on the healthy ranks (see join_group), with
        # the default group's failure handling.
        parent = _backend_of(dist.distributed_c10d._world.default_pg).options
        backend_options = MooncakeBackendOptions(
            torch.ones(dist_backend_opts.group_size, dtype=torch.int32),
            True,
            auto_deactivate_on_failure=parent.auto_deactivate_on_failure,
            auto_sync_on_failure=parent.auto_sync_on_failure,
        )
    if cuda and hasattr(_ext, "relax_library_threads"):
        # Before the engine's threads start (the first group makes it): none of the
        # library's threads may break a CUDA graph capture on the caller's thread.
        _ext.relax_library_threads()
    return _ext.create_backend(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
        backend_options,
        _default_engine(),
        cuda,
    )


def createMooncakeBackend(dist_backend_opts, backend_options):  # noqa: N802 - upstream's name
    """The creator ``torch.distributed`` calls for backend ``mooncake`` (CUDA and CPU
    tensors): ``dist_backend_opts`` is torch's ``_DistributedBackendOptions``,
    ``backend_options`` the ``pg_options`` (a :class:`MooncakeBackendOptions` or None).

    Raises:
        ValueError: ``backend_options`` is something else, or this build has no CUDA.
    """
    return _create(dist_backend_opts, backend_options, True)


def createMooncakeCpuBackend(dist_backend_opts, backend_options):  # noqa: N802
    """The creator ``torch.distributed`` calls for backend ``mooncake-cpu``; see
    :func:`createMooncakeBackend`."""
    return _create(dist_backend_opts, backend_options, False)


def _register() -> None:
    registered = dist.Backend.backend_list
    if "mooncake-cpu" not in registered:
        dist.Backend.register_backend(
            "mooncake-cpu", createMooncakeCpuBackend, extended_api=True, devices=["cpu"]
        )
    # "mooncake" serves CUDA tensors and CPU tensors with one backend object
    # (torch makes one when every device maps to the same backend name).
    if _ext.build_info()["cuda"] and "mooncake" not in registered:
        dist.Backend.register_backend(
            "mooncake", createMooncakeBackend, extended_api=True, devices=["cpu", "cuda"]
        )


_register()
