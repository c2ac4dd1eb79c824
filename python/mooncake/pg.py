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
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist

from mooncake._checks import int_list, is_int64
from mooncake._loader import load_extension
from mooncake.errors import LeftOutError, PeerFailedError

_ext = load_extension()

MooncakeBackendOptions = _ext.MooncakeBackendOptions
MooncakeBackend = _ext.MooncakeBackend
TransferEngine = _ext.TransferEngine

__all__ = [
    "MooncakeBackendOptions",
    "TransferEngine",
    "PeerFailedError",
    "LeftOutError",
    "set_host_ip",
    "set_device_filter",
    "set_transfer_engine",
    "get_preferred_hca",
    "get_active_ranks",
    "get_num_synced_ranks",
    "extend_group_size_to",
    "get_peer_state",
    "recover_ranks",
    "join_group",
]

_engine: TransferEngine | None = None


def _default_engine() -> TransferEngine:
    global _engine
    if _engine is None:
        _engine = TransferEngine()
    return _engine


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


def set_transfer_engine(engine: TransferEngine) -> None:
    """Makes process groups created from now on use ``engine``.

    Several groups may share one engine; it must outlive them.

    Raises:
        TypeError: ``engine`` is not a ``mooncake.TransferEngine``.
    """
    if not isinstance(engine, TransferEngine):
        raise TypeError(
            f"set_transfer_engine: engine must be a mooncake.TransferEngine, got {type(engine)}"
        )
    global _engine
    _engine = engine


def _backend_of(backend) -> MooncakeBackend:
    """Accepts a ProcessGroup (e.g. ``dist.group.WORLD``) or a mooncake backend."""
    if isinstance(backend, MooncakeBackend):
        return backend
    if backend is None:
        backend = dist.group.WORLD
    if isinstance(backend, dist.ProcessGroup):
        for device in ("cpu", "cuda"):
            try:
                b = backend._get_backend(torch.device(device))
            except (RuntimeError, ValueError):
                continue
            if isinstance(b, MooncakeBackend):
                return b
        raise ValueError("backend: this process group has no mooncake backend")
    raise ValueError(
        f"backend must be a ProcessGroup or a mooncake backend, got {type(backend).__name__}"
    )


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


def recover_ranks(backend, ranks: list[int]) -> None:
    """Admits the processes waiting to join as ``ranks`` into the group.

    Collective among the current healthy ranks. Afterwards the ranks are
    active (``get_active_ranks`` shows them) and take part in every
    collective; the joining processes return from :func:`join_group`.

    Called on the default group, it then recovers the same processes in every
    subgroup (``dist.new_group``) that holds them, in creation order; a joining
    process creates its subgroups, in the same order as the healthy ranks did,
    before it calls :func:`join_group`.

    Raises:
        ValueError: on every healthy rank, when ``ranks`` is not a list of ints,
            or a rank is active, out of range, named twice, beyond the extended
            size, or has no process waiting (poll :func:`get_peer_state` first);
            the group stays usable.
    """
    ranks = int_list("recover_ranks", "ranks", ranks)
    b = _backend_of(backend)
    b.recover_ranks(ranks)
    if not _is_world(backend, b):
        return
    for _, sub, rank_map in _mooncake_subgroups():
        sub_ranks = [rank_map[r] for r in ranks if r in rank_map]
        if sub_ranks:
            sub.recover_ranks(sub_ranks, wait=True)


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


def _create(cuda: bool):
    def creator(dist_opts, pg_options):
        if pg_options is not None and not isinstance(pg_options, MooncakeBackendOptions):
            raise ValueError(
                f"pg_options must be mooncake.pg.MooncakeBackendOptions, got "
                f"{type(pg_options).__name__}"
            )
        if pg_options is None and _joining_default_group():
            # A subgroup created by a process that joins a running group joins
            # the subgroup as it runs on the healthy ranks (see join_group).
            active = torch.ones(dist_opts.group_size, dtype=torch.int32)
            pg_options = MooncakeBackendOptions(active, True)
        return _ext.create_backend(
            dist_opts.store,
            dist_opts.group_rank,
            dist_opts.group_size,
            dist_opts.timeout,
            pg_options,
            _default_engine(),
            cuda,
        )

    return creator


def _register() -> None:
    registered = dist.Backend.backend_list
    if "mooncake-cpu" not in registered:
        dist.Backend.register_backend(
            "mooncake-cpu", _create(False), extended_api=True, devices=["cpu"]
        )
    # "mooncake" serves CUDA tensors and CPU tensors with one backend object
    # (torch makes one when every device maps to the same backend name).
    if _ext.build_info()["cuda"] and "mooncake" not in registered:
        dist.Backend.register_backend(
            "mooncake", _create(True), extended_api=True, devices=["cpu", "cuda"]
        )


_register()
