"""The EP Buffer's small types, shared by its two paths (``mooncake_ep_buffer``
re-exports the public ones)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class EventOverlap:
    """Completion of an async ``dispatch``/``combine`` (``async_finish=True``).

    ``current_stream_wait()`` finishes the call: on CPU it waits for the
    exchange and fills the outputs; on CUDA it also makes the current stream
    wait for the exchange's stream. Cheap when there is nothing left to do,
    and safe to call twice. ``with event:`` calls it on exit.
    """

    def __init__(self, finish: Callable[[], None] | None = None):
        self._finish = finish

    def current_stream_wait(self) -> None:
        if self._finish is not None:
            self._finish()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


class DispatchHandle(tuple):
    """What ``combine`` needs from its ``dispatch``; opaque to callers.

    As a tuple it is ``(src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts)`` as in DeepEP: ``src_info`` int32 ``[E/R, R*T]`` (the
    source token index of every received row, -1 past ``recv_count``) and
    ``layout_range`` int64 ``[E/R, R]`` (``offset << 32 | count`` of each source
    rank's rows per local expert).
    """

    def __new__(cls, src_info, layout_range, max_tokens, hidden, num_experts):
        return super().__new__(cls, (src_info, layout_range, max_tokens, hidden, num_experts))

    src_info = property(lambda self: self[0])
    layout_range = property(lambda self: self[1])
    num_max_dispatch_tokens_per_rank = property(lambda self: self[2])
    hidden = property(lambda self: self[3])
    num_experts = property(lambda self: self[4])


def stream_waiter(event) -> Callable[[], None] | None:
    """What ``EventOverlap.current_stream_wait`` does for a device-path call: make the
    current stream wait for ``event`` (None: the call ran on the current stream)."""
    if event is None:
        return None
    return lambda: torch.cuda.current_stream().wait_event(event)


def tensor_key(t) -> tuple | None:
    """What the argument checks look at in an optional tensor."""
    return None if t is None else (type(t), t.shape, t.dtype, t.device, t.is_contiguous())
