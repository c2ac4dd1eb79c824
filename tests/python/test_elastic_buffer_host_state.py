"""The ElasticBuffer device path's host-side mask state, without a GPU: the kernels'
mask is rebuilt only when the buffer's mask, the kernels' reports or the group's view
changed, and every such change reaches it (mooncake/ep/throughput_device.py caches to
keep host time per call down; these checks say the cache never hides a change).

The device path's extension is replaced by a stand-in that reports masked ranks, and
the group by one whose view version and present ranks the test sets."""

from types import SimpleNamespace

import pytest
import torch

from mooncake import pg
from mooncake.ep import throughput_device

R = 4


class Members:
    """The members of a 4-rank group whose present ranks the test sets."""

    def __init__(self):
        self.num_ranks, self.rank, self.group = R, 0, object()
        self.now = torch.ones(R, dtype=torch.bool)
        self.reads = 0
        self.masked: list[int] = []

    def present(self, n):
        self.reads += 1
        return self.now[:n].clone()

    def device_masked(self, r, why):
        self.masked.append(r)


class Ext:
    """The device path's extension: what its kernels masked since the last look."""

    def __init__(self):
        self.pending: list[tuple[int, int]] = []

    def take_masked(self):
        out, self.pending = self.pending, []
        return out


class Backend:
    def __init__(self):
        self.version = 1

    def view_version(self):
        return self.version


@pytest.fixture
def path(monkeypatch):
    backend = Backend()
    lookups = []

    def backend_of(group):
        lookups.append(group)
        if backend.version is None:
            raise ValueError("this process group has no mooncake backend")
        return backend

    monkeypatch.setattr(pg, "_backend_of", backend_of)
    monkeypatch.setattr(pg, "_view_version_reader", lambda b: b.view_version)
    # The CPU build has no device path, nor its constants.
    monkeypatch.setattr(pg._ext, "EP_HT_MIN_SLOTS", 2, raising=False)
    members, ext = Members(), Ext()
    dev = throughput_device.ThroughputDevice(members, torch.device("cpu"), ext, 1, 1)
    buf = SimpleNamespace(_active=torch.ones(R, dtype=torch.bool), _active_changes=0)
    return SimpleNamespace(dev=dev, buf=buf, members=members, ext=ext, backend=backend,
                           lookups=lookups)  # fmt: skip


def mask(p) -> list[int]:
    p.dev._settle(p.buf)
    return p.dev._mask(p.buf).tolist()


def test_an_unchanged_call_reuses_the_mask_and_the_lookups(path):
    assert mask(path) == [1, 1, 1, 1]
    first = path.dev._mask_dev
    for _ in range(3):
        assert mask(path) == [1, 1, 1, 1]
    assert path.dev._mask_dev is first
    assert len(path.lookups) == 1, "the group's backend is looked up once"
    assert path.members.reads == 1, "present ranks are read again only when the view changes"


def test_a_rank_the_kernels_masked_leaves_the_mask(path):
    assert mask(path) == [1, 1, 1, 1]
    path.ext.pending = [(2, 2)]
    assert mask(path) == [1, 1, 0, 1]
    assert path.members.masked == [2]
    assert mask(path) == [1, 1, 0, 1], "and stays out"


def test_a_view_change_reaches_the_mask(path):
    assert mask(path) == [1, 1, 1, 1]
    path.members.now[3] = False
    assert mask(path) == [1, 1, 1, 1], "the same view version: not read again"
    path.backend.version += 1
    assert mask(path) == [1, 1, 1, 0]
    assert path.members.reads == 2


def test_a_change_the_portable_path_made_reaches_the_mask(path):
    assert mask(path) == [1, 1, 1, 1]
    path.buf._active[1] = False  # as the portable path's exchange does, counting it
    path.buf._active_changes += 1
    assert mask(path) == [1, 0, 1, 1]


def test_a_new_mask_tensor_reaches_the_mask(path):
    assert mask(path) == [1, 1, 1, 1]
    path.buf._active = torch.tensor([True, True, False, True])  # a membership change
    assert mask(path) == [1, 1, 0, 1]


def test_a_group_without_view_versions_is_read_every_call(path):
    path.backend.version = None  # the lookup fails: no backend of ours to ask
    assert mask(path) == [1, 1, 1, 1]
    path.members.now[2] = False
    assert mask(path) == [1, 1, 0, 1]
    assert path.members.reads == 2
