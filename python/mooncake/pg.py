"""The mooncake process-group backends and their helpers.

Importing this module registers two ``torch.distributed`` backends:

* ``mooncake-cpu`` for CPU tensors (shared memory between processes on one
  host, tcp between hosts);
* ``mooncake`` for CUDA tensors (only when this build has CUDA).

Use it like gloo::

    import torch.distributed as dist
    from mooncake import pg

    dist.init_process_group("mooncake-cpu", rank=rank, world_size=world_size)
    # or, with a rank-health mask the backend keeps up to date:
    active = torch.ones(world_size, dtype=torch.int32)
    dist.init_process_group("mooncake-cpu", rank=rank, world_size=world_size,
                            pg_options=pg.MooncakeBackendOptions(active))
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from mooncake._loader import load_extension

_ext = load_extension()

MooncakeBackendOptions = _ext.MooncakeBackendOptions
MooncakeBackend = _ext.MooncakeBackend
TransferEngine = _ext.TransferEngine

__all__ = [
    "MooncakeBackendOptions",
    "TransferEngine",
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


def _rdma_devices() -> list[str]:
    path = "/sys/class/infiniband"
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


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
    """Restricts which RDMA devices (HCAs) the backend may use.

    Call before ``init_process_group``. This build has no RDMA transport yet:
    the filter is recorded, and a warning says plainly that it has no effect
    (and which of the named devices do not exist on this host).

    Raises:
        ValueError: ``filters`` is not a list of strings.
    """
    if isinstance(filters, str) or not all(isinstance(f, str) for f in filters):
        raise ValueError(f"set_device_filter: filters must be a list of strings, got {filters!r}")
    filters = list(filters)
    _default_engine().device_filter = filters
    present = _rdma_devices()
    missing = [f for f in filters if f not in present]
    warnings.warn(
        "mooncake: set_device_filter has no effect: this build moves data with shared memory "
        "and tcp, not RDMA" + (f"; devices not present on this host: {missing}" if missing else ""),
        RuntimeWarning,
        stacklevel=2,
    )


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
    """The RDMA device nearest to ``location`` (a device string such as ``"cuda:0"``).

    Raises:
        RuntimeError: always in this build, which has no RDMA transport; the
            message lists the RDMA devices found on this host, if any.
    """
    _backend_of(backend)
    devices = _rdma_devices()
    raise RuntimeError(
        f"get_preferred_hca({location!r}): mooncake has no RDMA transport in this build; it moves "
        f"data with shared memory and tcp (RDMA devices on this host: {devices or 'none'})"
    )


def get_active_ranks(backend=None) -> torch.Tensor:
    """The backend's rank-health mask: int32 ``[max_world_size]``, 1 = active.

    It is the tensor passed as ``MooncakeBackendOptions.active_ranks`` when
    one was given (the backend updates it in place).
    """
    return _backend_of(backend).active_ranks()


def get_num_synced_ranks(backend=None) -> int:
    """How many ranks the backend's collectives currently run over.

    This is the number of active ranks: every collective result covers
    exactly these ranks.
    """
    return _backend_of(backend).num_synced_ranks()


def _not_yet(name: str):
    raise NotImplementedError(
        f"pg.{name}: elastic recovery (reserved slots, joining ranks) is not implemented yet"
    )


def extend_group_size_to(backend, size: int) -> None:
    """Reserves inactive rank slots up to ``size`` (not implemented yet)."""
    _not_yet("extend_group_size_to")


def get_peer_state(backend, ranks: list[int]) -> list[bool]:
    """Whether candidate ranks have published peer metadata (not implemented yet)."""
    _not_yet("get_peer_state")


def recover_ranks(backend, ranks: list[int]) -> None:
    """Activates ready joining ranks (not implemented yet)."""
    _not_yet("recover_ranks")


def join_group(backend) -> None:
    """Joiner side of the recovery protocol (not implemented yet)."""
    _not_yet("join_group")


def _create(cuda: bool):
    def creator(dist_opts, pg_options):
        if pg_options is not None and not isinstance(pg_options, MooncakeBackendOptions):
            raise ValueError(
                f"pg_options must be mooncake.pg.MooncakeBackendOptions, got "
                f"{type(pg_options).__name__}"
            )
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
    # The CUDA backend ("mooncake") is registered once its device data path
    # exists; until then CUDA tensors are rejected with a clear error.


_register()
