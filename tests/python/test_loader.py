"""The versioned-extension loader: the module built for this torch loads; under
another torch version the ImportError names both versions and the rebuild."""

import importlib

import pytest
import torch

import mooncake._loader as loader


def test_loads_module_for_running_torch():
    ext = loader.load_extension()
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert ext.build_info()["module"] == f"_pg_torch{major}_{minor}"
    assert ext.__name__ == f"mooncake._pg_torch{major}_{minor}"


def test_other_torch_version_names_both_and_the_fix(monkeypatch):
    fresh = importlib.reload(loader)
    monkeypatch.setattr(torch, "__version__", "2.99.1+cpu")
    with pytest.raises(ImportError) as info:
        fresh.load_extension()
    text = str(info.value)
    assert "torch==2.99.1+cpu" in text, text
    built = fresh.built_tags()  # from the extension files on disk
    assert built and all(f"torch=={t.replace('_', '.')}" in text for t in built), text
    assert "make build" in text, text
    importlib.reload(loader)
