"""Expert-parallel dispatch and combine that know which ranks are healthy.

Upstream Mooncake's import path (``from mooncake.mooncake_ep_buffer import
Buffer``): the Buffer and its public types, re-exported from ``mooncake.ep``,
where they are implemented (``mooncake/ep/buffer.py``; ``mooncake/ep/__init__.py``
maps the modules there).
"""

from __future__ import annotations

from .ep.buffer import Buffer
from .ep.types import DispatchHandle, EventOverlap

__all__ = ["Buffer", "EventOverlap", "DispatchHandle"]
