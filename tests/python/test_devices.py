"""The device utilities: ``set_device_filter`` and ``get_preferred_hca``, against a sysfs
tree made by the test (this machine has no RDMA device), and their errors here."""

from __future__ import annotations

import os
import warnings

import pytest

from mooncake import pg


def _link(root, path: str, target: str) -> None:
    os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
    os.makedirs(os.path.join(root, target), exist_ok=True)
    os.symlink(os.path.join(root, target), os.path.join(root, path))


@pytest.fixture
def fake_sysfs(tmp_path, monkeypatch):
    """Two sockets: GPU 0 and mlx5_1 behind one switch of root complex 0, mlx5_0 on the
    same root complex but another port, mlx5_2 on root complex 1."""
    dev = "devices/pci0000:00/0000:00:01.0"
    _link(tmp_path, "pci/0000:18:00.0", f"{dev}/0000:17:00.0/0000:18:00.0")  # the GPU
    _link(tmp_path, "ib/mlx5_1/device", f"{dev}/0000:17:00.0/0000:19:00.0")
    _link(tmp_path, "ib/mlx5_0/device", "devices/pci0000:00/0000:00:02.0/0000:20:00.0")
    _link(tmp_path, "ib/mlx5_2/device", "devices/pci0000:80/0000:80:01.0/0000:81:00.0")
    monkeypatch.setattr(pg, "_SYSFS_IB", str(tmp_path / "ib"))
    monkeypatch.setattr(pg, "_SYSFS_PCI", str(tmp_path / "pci"))
    monkeypatch.setattr(pg._default_engine(), "device_filter", [])
    monkeypatch.setattr(pg, "_backend_of", lambda b: b)  # no group needed for these
    return tmp_path


def test_the_nearest_hca_shares_the_longest_pci_path(fake_sysfs):
    gpu = pg._pci_path(str(fake_sysfs / "pci/0000:18:00.0"))
    assert gpu == ["pci0000:00", "0000:00:01.0", "0000:17:00.0", "0000:18:00.0"]
    hcas = {d: pg._pci_path(str(fake_sysfs / "ib" / d / "device")) for d in pg._rdma_devices()}
    assert pg.nearest_hca(gpu, hcas) == "mlx5_1"  # the same switch
    del hcas["mlx5_1"]
    assert pg.nearest_hca(gpu, hcas) == "mlx5_0"  # the same root complex
    del hcas["mlx5_0"]
    assert pg.nearest_hca(gpu, hcas) == "mlx5_2"


def test_cpu_takes_the_first_allowed_device(fake_sysfs, monkeypatch):
    assert pg.get_preferred_hca(None, "cpu") == "mlx5_0"
    monkeypatch.setattr(pg._default_engine(), "device_filter", ["mlx5_2:1"])
    assert pg.get_preferred_hca(None, "cpu") == "mlx5_2"
    monkeypatch.setattr(pg._default_engine(), "device_filter", ["mlx9_9"])
    with pytest.raises(RuntimeError, match=r"no RDMA device .* among the device filter"):
        pg.get_preferred_hca(None, "cpu")


def test_bad_locations_are_value_errors(fake_sysfs, monkeypatch):
    for bad in ("tpu:0", "cuda:x", 3):
        with pytest.raises(ValueError, match="get_preferred_hca"):
            pg.get_preferred_hca(None, bad)
    # A host with RDMA devices and no GPU: "cuda" names none, ours to say, not torch's.
    monkeypatch.setattr(pg.torch.cuda, "is_available", lambda: False)
    for gpu in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="names no visible GPU"):
            pg.get_preferred_hca(None, gpu)


def test_without_rdma_devices_the_error_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(pg, "_SYSFS_IB", str(tmp_path / "none"))
    monkeypatch.setattr(pg._default_engine(), "device_filter", [])
    monkeypatch.setattr(pg, "_backend_of", lambda b: b)
    with pytest.raises(RuntimeError, match="no RDMA device on this host"):
        pg.get_preferred_hca(None, "cuda:0")


def test_the_device_filter_warns_only_about_what_is_wrong(fake_sysfs, monkeypatch):
    has_ucx = "ucx" in pg.TransferEngine.available_transports()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        pg.set_device_filter(["mlx5_0", "mlx5_2:1", "lo"])
    assert pg._default_engine().device_filter == ["mlx5_0", "mlx5_2:1", "lo"]
    text = " ".join(str(w.message) for w in got)
    assert ("no ucx transport" in text) == (not has_ucx), text
    assert "not present" not in text, text
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        pg.set_device_filter(["mlx9_9"])
    assert "devices not present on this host: ['mlx9_9']" in str(got[-1].message)
