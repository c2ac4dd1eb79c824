"""High-throughput expert-parallel dispatch and combine (prefill).

Upstream Mooncake's import path (``from mooncake.mooncake_elastic_buffer import
ElasticBuffer``): the buffer and its public types, re-exported from
``mooncake/ep/throughput.py``, where they are implemented (``docs/elastic-buffer.md``
describes them).
"""

from __future__ import annotations

from .ep.throughput import ElasticBuffer
from .ep.throughput_handle import EPHandle
from .ep.types import EventOverlap

__all__ = ["ElasticBuffer", "EPHandle", "EventOverlap"]
