"""Upstream Mooncake 0.3.14's public Python surface, as code written for it calls it.

Each row is a callable of upstream's ``mooncake.mooncake_ep_buffer`` with its
parameters as upstream declares them (name, default, or none). Ours must take every
call upstream's takes: the same positional parameters in the same order, the same
defaults, and anything of ours beyond them keyword-only with a default (or, past
upstream's, positional with a default). Static methods stay static. What each does
is checked in the ranks (``ep_cases.c_upstream_attributes``, the EP launches).

The rows cover the process group's Buffer; the elastic Buffer's methods, and the
elastic forms of ``dispatch`` and ``combine``, are ``test_upstream_elastic.py``'s, and
``mooncake.pg``'s names ``test_upstream_pg.py``'s. How engines drive the whole
(FP8 with hooks and events, scales' strides, a killed rank) is
``test_engine_pattern.py``.
"""

from __future__ import annotations

import inspect

import pytest

from mooncake.mooncake_ep_buffer import Buffer, EventOverlap

_NONE = object()  # upstream declares no default

#: (owner, name, static, [(parameter, default)]) from upstream 0.3.14's wheel.
UPSTREAM = [
    (EventOverlap, "__init__", False, [("event", None), ("extra_tensors", None)]),
    (
        Buffer,
        "__init__",
        False,
        [("group", _NONE), ("num_ep_buffer_bytes", _NONE), ("disable_p2p", False)],
    ),
    (Buffer, "capture", True, []),
    (Buffer, "connect", False, [("is_update", False)]),
    (Buffer, "update_ep_member", False, []),
    *[
        (
            Buffer,
            name,
            True,
            [
                ("num_max_dispatch_tokens_per_rank", _NONE),
                ("hidden", _NONE),
                ("num_ranks", _NONE),
                ("num_experts", _NONE),
            ],
        )
        for name in (
            "get_ep_buffer_size_hint",
            "get_low_latency_buffer_size_hint",
            "get_rdma_size_hint",
        )
    ],
    (
        Buffer,
        "dispatch",
        False,
        [
            ("x", _NONE),
            ("topk_idx", _NONE),
            ("active_ranks", _NONE),
            ("num_max_dispatch_tokens_per_rank", _NONE),
            ("num_experts", _NONE),
            ("timeout_us", _NONE),
            ("use_fp8", None),
            ("async_finish", False),
            ("return_recv_hook", False),
            ("topk_weights", None),
        ],
    ),
    (
        Buffer,
        "combine",
        False,
        [
            ("x", _NONE),
            ("topk_idx", _NONE),
            ("topk_weights", _NONE),
            ("active_ranks", _NONE),
            ("timeout_us", _NONE),
            ("handle", _NONE),
            ("zero_copy", False),
            ("async_finish", False),
            ("return_recv_hook", False),
            ("out", None),
        ],
    ),
    (Buffer, "get_next_combine_buffer", False, [("handle", _NONE)]),
]


def _positional(fn) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind in kinds]
    return params[1:] if params and params[0].name == "self" else params


@pytest.mark.parametrize("owner,name,static,upstream", UPSTREAM, ids=lambda v: str(v))
def test_takes_every_call_upstreams_takes(owner, name, static, upstream):
    fn = inspect.getattr_static(owner, name)
    assert isinstance(fn, staticmethod) == static, f"{name}: static is {not static} here"
    fn = getattr(owner, name)
    ours = _positional(fn)
    names = [p.name for p in ours]
    assert names[: len(upstream)] == [n for n, _ in upstream], (
        f"{owner.__name__}.{name}: positional parameters {names}, upstream's "
        f"{[n for n, _ in upstream]}"
    )
    for p, (n, default) in zip(ours, upstream, strict=False):
        if default is not _NONE:
            assert p.default == default, (
                f"{name}({n}=...): default {p.default!r}, upstream's {default!r}"
            )
    for p in ours[len(upstream) :]:
        assert p.default is not inspect.Parameter.empty, (
            f"{name}: extra positional {p.name} has no default"
        )
    for p in inspect.signature(fn).parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            assert p.default is not inspect.Parameter.empty, (
                f"{name}: keyword {p.name} has no default"
            )


def test_event_overlap_keeps_upstreams_attributes():
    event = EventOverlap()
    assert event.event is None and event.extra_tensors is None
    kept = (object(),)
    event = EventOverlap(None, kept)
    assert event.extra_tensors is kept
    event.current_stream_wait()  # nothing to wait for
    with event:
        pass
    # upstream's callers wrap what capture() returns: ours is an EventOverlap already
    calls = []
    inner = EventOverlap(None, kept, finish=lambda: calls.append(1))
    outer = EventOverlap(inner)
    assert outer.event is None and outer.extra_tensors is kept
    outer.current_stream_wait()
    assert calls == [1]


def test_size_hints_are_one_formula():
    args = (128, 7168, 8, 256)
    hint = Buffer.get_ep_buffer_size_hint(*args)
    assert Buffer.get_low_latency_buffer_size_hint(*args) == hint
    assert Buffer.get_rdma_size_hint(*args) == hint
    with pytest.raises(ValueError, match="num_experts"):
        Buffer.get_rdma_size_hint(128, 7168, 8, 255)
