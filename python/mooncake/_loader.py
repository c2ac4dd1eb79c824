"""Loads the compiled extension built for the running torch.

The module's name carries the torch version it was compiled against
(``_pg_torch2_13`` for torch 2.13): C++ ABI of torch changes between
releases, so loading a module built for another torch would crash or
misbehave. When no matching module exists we say which torch the installed
ones were built for and how to rebuild.
"""

from __future__ import annotations

import glob
import importlib
import os
import re

_REBUILD = "rebuild with `make build` (or `pip install --no-build-isolation .`)"


def torch_tag() -> str:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"{major}_{minor}"


def built_tags() -> list[str]:
    here = os.path.dirname(__file__)
    tags = set()
    for path in glob.glob(os.path.join(here, "_pg_torch*.so")):
        m = re.match(r"_pg_torch(\d+_\d+)", os.path.basename(path))
        if m:
            tags.add(m.group(1))
    return sorted(tags)


_ext = None


def load_extension():
    """Returns the extension module for the running torch, or raises ImportError."""
    global _ext
    if _ext is not None:
        return _ext
    import torch

    tag = torch_tag()
    try:
        _ext = importlib.import_module(f"mooncake._pg_torch{tag}")
    except ModuleNotFoundError as e:
        if e.name != f"mooncake._pg_torch{tag}":
            raise
        others = built_tags()
        running = torch.__version__
        if others:
            built = ", ".join("torch==" + t.replace("_", ".") for t in others)
            raise ImportError(
                f"mooncake was built against {built}, but torch=={running} is running; {_REBUILD}"
            ) from None
        raise ImportError(
            f"mooncake's extension is not built (looked for _pg_torch{tag} for "
            f"torch=={running}); {_REBUILD}"
        ) from None
    return _ext
