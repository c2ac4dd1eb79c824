"""Upstream Mooncake 0.3.14's ``mooncake.mooncake_elastic_buffer``, as code written for it
calls it: every callable with its parameters as upstream declares them (name, default,
or none), pinned here so that the test needs no upstream wheel. Ours must take every
call upstream's takes, as ``test_upstream_surface.py`` checks for ``Buffer``: the same
positional parameters in the same order with the same defaults, anything of ours beyond
them keyword-only with a default (or positional past upstream's, with a default), and
static methods static. What each does among ranks is ``test_elastic_buffer.py``'s.
"""

from __future__ import annotations

import pytest
import torch

from mooncake import mooncake_elastic_buffer as meb
from mooncake.mooncake_elastic_buffer import ElasticBuffer, EPHandle, EventOverlap
from test_upstream_surface import _NONE
from test_upstream_surface import test_takes_every_call_upstreams_takes as takes_every_call

_HANDLE_FIELDS = [
    "do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms",
    "topk_idx", "num_recv_tokens_per_expert_list", "psum_num_recv_tokens_per_scaleup_rank",
    "psum_num_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx",
    "token_metadata_at_forward", "channel_linked_list",
]  # fmt: skip

#: (owner, name, static, [(parameter, default)]) from upstream 0.3.14's wheel.
UPSTREAM = [
    (EventOverlap, "__init__", False, [("event", None), ("extra_tensors", None)]),
    (
        EPHandle,
        "__init__",
        False,
        [(n, _NONE) for n in _HANDLE_FIELDS] + [("native_handle", None), ("generation", None)],
    ),
    (
        ElasticBuffer,
        "__init__",
        False,
        [
            ("group", _NONE),
            ("num_bytes", None),
            ("num_max_tokens_per_rank", 0),
            ("hidden", 0),
            ("num_topk", 0),
            ("use_fp8_dispatch", False),
            ("deterministic", False),
            ("allow_hybrid_mode", True),
            ("allow_multiple_reduction", True),
            ("prefer_overlap_with_compute", True),
            ("sl_idx", 3),
            ("num_allocated_qps", 0),
            ("num_cpu_timeout_secs", 300),
            ("num_gpu_timeout_secs", 100),
            ("explicitly_destroy", False),
            ("transport", "auto"),
        ],
    ),
    (ElasticBuffer, "update_ep_member", False, []),
    (ElasticBuffer, "destroy", False, []),
    (
        ElasticBuffer,
        "get_buffer_size_hint",
        True,
        [
            ("group", _NONE),
            ("num_max_tokens_per_rank", _NONE),
            ("hidden", _NONE),
            ("num_topk", 0),
            ("use_fp8_dispatch", False),
            ("allow_hybrid_mode", True),
            ("allow_multiple_reduction", True),
        ],
    ),
    (
        ElasticBuffer,
        "get_engram_storage_size_hint",
        True,
        [
            ("num_entries", _NONE),
            ("hidden", _NONE),
            ("num_max_tokens_per_rank", _NONE),
            ("dtype", torch.bfloat16),
        ],
    ),
    (
        ElasticBuffer,
        "get_pp_buffer_size_hint",
        True,
        [("num_max_tensor_bytes", _NONE), ("num_max_inflight_tensors", _NONE)],
    ),
    (
        ElasticBuffer,
        "get_agrs_buffer_size_hint",
        True,
        [("group", _NONE), ("num_max_session_bytes", _NONE)],
    ),
    (ElasticBuffer, "get_physical_domain_size", False, []),
    (ElasticBuffer, "get_logical_domain_size", False, []),
    (ElasticBuffer, "barrier", False, [("use_comm_stream", True), ("with_cpu_sync", False)]),
    (ElasticBuffer, "capture", True, []),
    (
        ElasticBuffer,
        "get_theoretical_num_sms",
        False,
        [("num_experts", _NONE), ("num_topk", _NONE)],
    ),
    (
        ElasticBuffer,
        "dispatch",
        False,
        [
            ("x", _NONE),
            ("topk_idx", None),
            ("topk_weights", None),
            ("num_experts", None),
            ("num_max_tokens_per_rank", None),
            ("expert_alignment", None),
            ("handle", None),
            ("do_expand", False),
            ("do_cpu_sync", None),
            ("num_sms", None),
            ("async_with_compute_stream", False),
        ],
    ),
    (
        ElasticBuffer,
        "combine",
        False,
        [
            ("x", _NONE),
            ("handle", _NONE),
            ("topk_weights", None),
            ("num_sms", None),
            ("async_with_compute_stream", False),
        ],
    ),
]


@pytest.mark.parametrize("owner,name,static,upstream", UPSTREAM, ids=lambda v: str(v))
def test_takes_every_call_upstreams_elastic_buffer_takes(owner, name, static, upstream):
    takes_every_call(owner, name, static, upstream)


def test_module_exports_upstreams_names():
    assert sorted(meb.__all__) == ["EPHandle", "ElasticBuffer", "EventOverlap"]
    from mooncake.mooncake_ep_buffer import EventOverlap as LowLatencyEvent

    assert EventOverlap is LowLatencyEvent  # one EventOverlap for both regimes, as upstream's


def test_handle_keeps_upstreams_fields():
    """A handle built as upstream's constructor takes it: every field, ``num_recv_tokens``
    from ``recv_src_metadata``'s rows, and the generation it was made in."""
    t = torch.zeros(3, 4, dtype=torch.int32)
    args = [False, 8, 1, 4, 0, torch.zeros(2, 2, dtype=torch.int64), [1, 2], t[0], t[1], t, t,
            None, None]  # fmt: skip
    h = EPHandle(*args, native_handle=None, generation=7)
    for name, v in zip(_HANDLE_FIELDS, args, strict=True):
        assert getattr(h, name) is v, name
    assert h.num_recv_tokens == 3 and h._generation == 7 and h.native_handle is None
    assert h.num_expanded_tokens == 0 and h.num_unaligned_recv_tokens_per_expert is None
