"""``torch.distributed`` with every tensor argument moved to a device (rank side).

The collective cases of test_collectives.py build CPU tensors and check them
against CPU references. To run the same cases on the ``mooncake`` backend with
CUDA tensors, a case runs with its module's ``dist`` swapped for a
:class:`DeviceDist`: each op gets device copies of its tensors (with the same
strides and storage offsets, and one device storage per host storage, so views
of one buffer stay views of one buffer), and after the op every host storage is
overwritten with its device copy. So a result, and every element an op must
leave alone, is checked on what the device holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: The ops whose tensors move (everything else is torch.distributed's own).
OPS = frozenset(
    {
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
        "send",
        "recv",
        "isend",
        "irecv",
    }
)


class _Mirror:
    """Device copies of the host storages behind one op's tensors."""

    def __init__(self, device: torch.device):
        self.device = device
        self.storages: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def move(self, value):
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self.move(v) for v in value)
        return value

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return torch.empty(t.shape, dtype=t.dtype, device=self.device)
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self.storages:
            host = torch.empty(0, dtype=torch.uint8).set_(storage)
            self.storages[key] = (host, host.to(self.device))
        dev_bytes = self.storages[key][1]
        return torch.empty(0, dtype=t.dtype, device=self.device).set_(
            dev_bytes.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )

    def back(self) -> None:
        for host, dev in self.storages.values():
            host.copy_(dev)


class _Work:
    """An async op's Work: its tensors come back to the host when it is waited for."""

    def __init__(self, work, mirror: _Mirror):
        self._work, self._mirror = work, mirror

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._mirror.back()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class DeviceDist:
    """Stands in for the ``torch.distributed`` module inside a case."""

    def __init__(self, device: str | torch.device = "cuda"):
        self._device = torch.device(device)

    def __getattr__(self, name):
        fn = getattr(dist, name)
        if name not in OPS:
            return fn

        def call(*args, **kwargs):
            mirror = _Mirror(self._device)
            work = fn(*mirror.move(args), **mirror.move(kwargs))
            if work is None or isinstance(work, int):  # sync ops; recv returns the source
                mirror.back()
                return work
            return _Work(work, mirror)

        return call
