"""The EP Buffer's small types, shared by its paths (``mooncake_ep_buffer``
re-exports the public ones)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class EventOverlap:
    """Completion of an async ``dispatch``/``combine`` (``async_finish=True``), or an
    event of :meth:`Buffer.capture`.

    ``current_stream_wait()`` finishes the call: on CPU it waits for the
    exchange and fills the outputs; on CUDA it also makes the current stream
    wait for the exchange's stream. Cheap when there is nothing left to do,
    and safe to call twice. ``with event:`` calls it on exit.

    Upstream's constructor and attributes: ``EventOverlap(event=None,
    extra_tensors=None)``; ``event`` is the ``torch.cuda.Event`` waited for
    (None where there is none: CPU tensors, or a call on the current stream),
    ``extra_tensors`` the tensors kept alive with it.
    """

    def __init__(self, event=None, extra_tensors=None, *, finish: Callable[[], None] | None = None):
        if isinstance(event, EventOverlap):
            # Upstream's capture() returns a bare event handle that callers wrap in an
            # EventOverlap; ours returns an EventOverlap already: wrapping it again is the same.
            extra_tensors = event.extra_tensors if extra_tensors is None else extra_tensors
            finish = finish or event._finish
            event = event.event
        self.event = event
        self.extra_tensors = extra_tensors
        self._finish = finish

    def current_stream_wait(self) -> None:
        if self._finish is not None:
            self._finish()
        elif self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


@dataclass(slots=True, eq=False)
class HandleState:
    """What a Buffer keeps of one dispatch for its combine (private to the Buffer)."""

    buffer: int  # the id of the Buffer that dispatched
    seq: int  # the dispatch's number on that Buffer; its half of the workspace is seq % 2
    dtype: torch.dtype  # the dtype combine takes (bf16 after an FP8 dispatch)
    num_tokens: int  # N
    topk_idx: torch.Tensor  # the dispatch's (the portable path keeps a copy)
    finished: bool  # the receive half has run: combine takes the handle
    on_device: bool = False  # the device path ran it, so its combine runs there
    event: Any = None  # device path: the dispatch's CUDA event when it ran on its own stream
    exchange: Any = None  # portable path: what went where (``portable.Exchange``)
    members: int = 0  # the Buffer's membership (update_ep_member calls) at the dispatch


class DispatchHandle(NamedTuple):
    """What ``combine`` needs from its ``dispatch``; opaque to callers.

    As a sequence it is DeepEP's five: ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``, with ``src_info``
    int32 ``[E/R, R*T]`` (the source token index of every received row, -1 past
    ``recv_count``) and ``layout_range`` int64 ``[E/R, R]`` (``offset << 32 |
    count`` of each source rank's rows per local expert).

    The sixth field, ``state``, is the Buffer's private record of the call
    (:class:`HandleState`). ``len``, iteration, unpacking, indexing and slicing
    see only the first five, so code written for DeepEP's 5-tuple handle (``a, b,
    c, d, e = handle``, ``handle[2:]``) runs unchanged. A copy (``tuple(handle)``,
    ``copy.copy``, a pickle round trip) carries no state, and combine refuses it.
    """

    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    state: HandleState | None = None

    # The sequence protocol stops at DeepEP's five (the named fields read the
    # tuple directly, so the Buffer's own accesses pay nothing for this).
    def __len__(self) -> int:
        return 5

    def __iter__(self):
        return iter(tuple.__getitem__(self, slice(5)))

    def __getitem__(self, i):
        return tuple.__getitem__(self, slice(5))[i]


def NO_HOOK() -> None:
    """The ``hook`` of a call made without ``return_recv_hook``: nothing is left for it
    to do. Upstream returns a callable for every call, and code written for it calls
    the hook without looking."""


#: The EventOverlap of a call with nothing left to wait for: it holds no state, so every
#: such call returns this one (an allocation less per device-path call).
NO_WAIT = EventOverlap()


def stream_waiter(event) -> EventOverlap:
    """A device-path call's EventOverlap: ``current_stream_wait`` makes the current
    stream wait for ``event`` (None: the call ran on the current stream, NO_WAIT)."""
    if event is None:
        return NO_WAIT
    return EventOverlap(event)


def tensor_key(t) -> tuple | None:
    """What the argument checks look at in an optional tensor."""
    return None if t is None else (type(t), t.shape, t.dtype, t.device, t.is_contiguous())
