"""Upstream Mooncake 0.3.14's elastic Buffer (``Buffer.create_elastic``), as code written for
it calls it.

:data:`UPSTREAM` lists each elastic method of upstream's ``mooncake_ep_buffer.Buffer`` with
its parameters as upstream declares them (name, default, or none). Ours must take every
call upstream's takes: the same positional parameters in the same order, the same
defaults, and anything of ours beyond them keyword-only with a default (or, past
upstream's, positional with a default); a class method stays one. ``dispatch`` and
``combine`` serve two forms under one name (the process group's, which
``test_upstream_surface.py`` checks, and the elastic one): their elastic form is checked
on the function Python binds an elastic call to (``elastic_api.dispatch`` /
``elastic_api.combine``, past its ``buf``) and by calling ``Buffer.dispatch`` /
``Buffer.combine`` in that form, by position and by keyword, with the same results.

Every method is also called here, on buffers of this process (one slot alone, or a pair
through threads), with upstream's argument order. What they do among processes runs in
the ``upstream`` timeline (``support/upstream_elastic_ranks.py``): create by keyword
without a store, then ``set_tcp_store_group``; ``connect_ranks`` of every slot with the
default ``activate=True``; rounds in both forms; the same inputs through both, bit for
bit; ``clean_mask_buffer``; own rank in lists; ``destroy`` and a new buffer in the slot.
The other elastic timelines (``test_ep_elastic.py``) run upstream's form in two of the six
round styles (``elastic_round.STYLES``).
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from elastic_parent import SEED, Timeline, in_threads, raises, report
from elastic_round import SPEC
from mooncake.ep import elastic_api
from mooncake.mooncake_ep_buffer import Buffer

_NONE = object()  # upstream declares no default

#: (name, kind, [(parameter, default)]) from upstream 0.3.14 (mooncake_ep_buffer.py); kind
#: is "class" (a class method), "method", or "elastic" (the elastic form of a method whose
#: name serves two: checked on the elastic_api function of that name).
UPSTREAM = [
    (
        "create_elastic",
        "class",
        [
            ("disable_ll_nvlink", False),
            ("explicitly_destroy", False),
            ("rank", 0),
            ("tcp_store_group", None),
            ("timeout_ms", 30000),
            ("metadata_timeout_ms", 300000),
        ],
    ),
    (
        "update_memory_buffers",
        "method",
        [("num_ranks", _NONE), ("num_experts_per_rank", _NONE), ("num_rdma_bytes", _NONE)],
    ),
    ("set_tcp_store_group", "method", [("tcp_store_group", _NONE)]),
    ("connect_ranks", "method", [("remote_ranks", _NONE), ("activate", True)]),
    ("disconnect_ranks", "method", [("remote_ranks", _NONE)]),
    ("update_mask_buffer", "method", [("rank_to_mask", _NONE), ("mask", False)]),
    ("query_mask_buffer", "method", [("mask_status", _NONE)]),
    ("clean_mask_buffer", "method", []),
    ("barrier", "method", []),
    ("destroy", "method", []),
    ("get_comm_stream", "method", []),
    (
        "get_local_buffer_tensor",
        "method",
        [("dtype", _NONE), ("size", None), ("offset", 0), ("use_rdma_buffer", True)],
    ),
    (
        "dispatch",
        "elastic",
        [
            ("x", _NONE),
            ("topk_idx", _NONE),
            ("num_max_dispatch_tokens_per_rank", _NONE),
            ("num_experts", None),
            ("cumulative_local_expert_recv_stats", None),
            ("dispatch_wait_recv_cost_stats", None),
            ("use_fp8", True),
            ("round_scale", False),
            ("async_finish", False),
            ("return_recv_hook", False),
        ],
    ),
    (
        "combine",
        "elastic",
        [
            ("x", _NONE),
            ("topk_idx", _NONE),
            ("topk_weights", _NONE),
            ("handle", _NONE),
            ("use_logfmt", False),
            ("zero_copy", False),
            ("async_finish", False),
            ("return_recv_hook", False),
            ("out", None),
            ("combine_wait_recv_cost_stats", None),
        ],
    ),
]

#: The attributes upstream's create_elastic sets, and their values before allocation.
ATTRIBUTES = dict(
    group_size=0,
    backend=None,
    group=None,
    device_type="cuda",
    runtime=None,
    disable_ll_nvlink=False,
    explicitly_destroy=True,
    timeout_ms=30000,
    metadata_timeout_ms=300000,
    num_rdma_bytes=None,
    rank=0,
)


def _positional(fn, drop: int) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in inspect.signature(fn).parameters.values() if p.kind in kinds][drop:]


@pytest.mark.parametrize(("name", "kind", "upstream"), UPSTREAM, ids=[r[0] for r in UPSTREAM])
def test_takes_every_call_upstreams_takes(name, kind, upstream):
    if kind == "elastic":
        fn, drop = getattr(elastic_api, name), 1  # past its buf
        assert name in elastic_api.__all__
    else:
        static = inspect.getattr_static(Buffer, name)
        assert isinstance(static, classmethod) == (kind == "class"), f"{name}: {type(static)}"
        fn, drop = getattr(Buffer, name), 0 if kind == "class" else 1  # past self
    ours = _positional(fn, drop)
    names = [p.name for p in ours]
    assert names[: len(upstream)] == [n for n, _ in upstream], (
        f"{name}: positional parameters {names}, upstream's {[n for n, _ in upstream]}"
    )
    for p, (n, default) in zip(ours, upstream, strict=False):
        if default is not _NONE:
            assert p.default is not inspect.Parameter.empty and p.default == default, (
                f"{name}({n}=...): default {p.default!r}, upstream's {default!r}"
            )
    for p in ours[len(upstream) :]:
        assert p.default is not inspect.Parameter.empty, f"{name}: extra {p.name} has no default"
    for p in inspect.signature(fn).parameters.values():
        assert p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD), f"{name}: takes *{p.name}"
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            assert p.default is not inspect.Parameter.empty, f"{name}: keyword {p.name}"


def test_the_table_covers_upstreams_elastic_methods():
    """Every public method upstream's elastic Buffer adds is a row (or, for the two
    calls Buffer already had, checked in test_upstream_surface.py)."""
    rows = {r[0] for r in UPSTREAM}
    assert rows == {
        "create_elastic", "update_memory_buffers", "set_tcp_store_group", "connect_ranks",
        "disconnect_ranks", "update_mask_buffer", "query_mask_buffer", "clean_mask_buffer",
        "barrier", "destroy", "get_comm_stream", "get_local_buffer_tensor", "dispatch",
        "combine",
    }  # fmt: skip
    for name in rows:
        assert callable(getattr(Buffer, name)), name


# --- calling each, in upstream's order ----------------------------------------------------

_prefixes = itertools.count()


def _prefix() -> str:
    return f"up{next(_prefixes)}/"


def test_create_elastic_in_upstreams_order_and_its_attributes(store):
    """Positionally in upstream's order, and by keyword with no store (given later by
    set_tcp_store_group, which update_memory_buffers needs): upstream's attributes, with
    runtime None until allocation and num_rdma_bytes set by it."""
    buf = Buffer.create_elastic(False, True, 0, None, 30000, 300000, store_prefix=_prefix())
    assert {k: getattr(buf, k) for k in ATTRIBUTES} == ATTRIBUTES
    assert buf.tcp_store_group is None
    raises(RuntimeError, lambda: buf.update_memory_buffers(2, 2, 0), "set_tcp_store_group")
    buf.set_tcp_store_group(store)
    assert buf.tcp_store_group is store
    buf.update_memory_buffers(2, 2, 4096)
    assert (buf.group_size, buf.num_rdma_bytes) == (2, 4096) and buf.runtime is not None
    assert buf.runtime.ibgda_disabled() is True
    buf.set_tcp_store_group(store)  # the same store: nothing changes
    raises(RuntimeError, lambda: buf.set_tcp_store_group(None), "tcp_store_group", "fixed")
    kw = Buffer.create_elastic(rank=1, tcp_store_group=store, store_prefix=_prefix())
    assert (kw.rank, kw.tcp_store_group, kw.explicitly_destroy) == (1, store, False)


def _alone(store, **kw):
    buf = Buffer.create_elastic(rank=0, tcp_store_group=store, store_prefix=_prefix(), **kw)
    buf.update_memory_buffers(2, SPEC.epr, 0)
    return buf


def test_slot_methods_in_upstreams_order(store):
    """Each slot method, by position and by keyword, on a slot alone (capacity 2): its own
    rank in a list is skipped; the mask reads [0, 1]; clean_mask_buffer has nothing to
    publish; barrier returns [0]; get_comm_stream and get_local_buffer_tensor answer as
    this machine allows; destroy releases it."""
    buf = _alone(store, explicitly_destroy=True)
    buf.connect_ranks([0])
    buf.connect_ranks(remote_ranks=[0], activate=True)
    buf.update_mask_buffer(0, False)
    buf.update_mask_buffer(rank_to_mask=0, mask=False)
    buf.disconnect_ranks([0])
    buf.disconnect_ranks(remote_ranks=[0])
    for call in (buf.query_mask_buffer, lambda t: buf.query_mask_buffer(mask_status=t)):
        mask = torch.full((2,), 7, dtype=torch.int32)
        call(mask)
        assert mask.tolist() == [0, 1]
    buf.clean_mask_buffer()
    assert buf.barrier() == [0] and buf.active_slots == [0]
    if torch.cuda.is_available():
        assert isinstance(buf.get_comm_stream(), torch.cuda.Stream)
    else:
        raises(RuntimeError, buf.get_comm_stream, "get_comm_stream", "CUDA")
    for call in (
        lambda: buf.get_local_buffer_tensor(torch.int32, None, 0, True),
        lambda: buf.get_local_buffer_tensor(
            dtype=torch.int32, size=torch.Size([4]), offset=0, use_rdma_buffer=True
        ),
    ):  # no workspace: num_rdma_bytes=0
        raises(RuntimeError, call, "get_local_buffer_tensor", "workspace", "num_rdma_bytes")
    buf.destroy()
    assert buf.runtime is None
    for call in (buf.destroy, buf.barrier, lambda: buf.connect_ranks([1])):
        raises(RuntimeError, call, "destroyed")


def test_destroy_needs_explicitly_destroy(store):
    buf = _alone(store)
    raises(RuntimeError, buf.destroy, "destroy", "explicitly_destroy")
    assert buf.barrier() == [0]  # still usable


def test_connect_ranks_activates_by_default(store):
    """Both sides of a pair call connect_ranks([peer]) with upstream's default: both are
    active at once and a round is exact; then a list of both slots on each side
    (disconnect, connect) works the same."""
    from elastic_parent import verified_rounds

    prefix = _prefix()
    b0, b1 = (
        Buffer.create_elastic(rank=r, tcp_store_group=store, store_prefix=prefix) for r in (0, 1)
    )
    for b in (b0, b1):
        b.update_memory_buffers(2, SPEC.epr)
    assert in_threads(lambda: b0.connect_ranks([1]), lambda: b1.connect_ranks([0])) == [None] * 2
    assert (b0.active_slots, b1.active_slots) == ([0, 1], [0, 1])
    assert verified_rounds([b0, b1], [0, 1], "default", n=3) == []
    b0.disconnect_ranks([0, 1])
    b1.disconnect_ranks([1, 0])
    assert (b0.active_slots, b1.active_slots) == ([0], [1])
    assert (
        in_threads(lambda: b0.connect_ranks([0, 1]), lambda: b1.connect_ranks([0, 1])) == [None] * 2
    )
    assert verified_rounds([b0, b1], [0, 1], "both", n=3) == []


def _tokens(n=5, K=2, E=2 * SPEC.epr):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randint(-8, 9, (n, SPEC.H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    w = torch.rand(n, K, generator=g)
    return x, idx, w


def test_elastic_forms_by_position_and_keyword_agree(store):
    """On a slot alone (capacity 2, rank bound 1): upstream's elastic dispatch by position
    (all ten arguments), by keyword, and with num_experts left out (the rank bound's
    experts) give what our form gives, bit for bit; the handle is a plain 4-tuple
    (src_info, layout_range, T, H) that combine takes by position, by keyword and as a
    copy, as does get_next_combine_buffer; the two forms' results agree."""
    buf = _alone(store)
    x, idx, w = _tokens(E=SPEC.epr)  # rank bound 1: experts of slot 0 only
    T, E = SPEC.T, SPEC.epr
    stats = torch.zeros(SPEC.epr, dtype=torch.int32)
    ours = buf.dispatch(x, idx, None, T, E, -1, False)
    calls = {
        "position": lambda: buf.dispatch(x, idx, T, E, stats, None, False, False, False, False),
        "keyword": lambda: buf.dispatch(
            x=x, topk_idx=idx, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False
        ),
        "default E": lambda: buf.dispatch(x, idx, T, use_fp8=False),
    }
    y = (ours[0].float() * 3).to(torch.bfloat16)
    want, _, _ = buf.combine(y, idx, w, None, -1, ours[2])
    for how, call in calls.items():
        recv_x, count, h4, event, hook = call()
        assert type(h4) is tuple and len(h4) == 4 and h4[2:] == (T, SPEC.H), (how, h4)
        assert torch.equal(count, ours[1]), how
        for j, c in enumerate(count.tolist()):
            assert torch.equal(recv_x[j, :c], ours[0][j, :c]), how
            assert torch.equal(h4[0][j, :c], ours[2].src_info[j, :c]), how
        assert torch.equal(h4[1], ours[2].layout_range), how
        event.current_stream_wait()
        hook()
        y = (recv_x.float() * 3).to(torch.bfloat16)
        for args, kw in (
            ((y, idx, w, h4, False, False, False, False, None, None), {}),
            ((), dict(x=y, topk_idx=idx, topk_weights=w, handle=tuple(list(h4)))),
            ((y, idx, w, None, -1, h4), {}),  # our form takes it too
        ):
            got, _, _ = buf.combine(*args, **kw)
            assert torch.equal(got, want), how
        zbuf = buf.get_next_combine_buffer(list(h4))
        zbuf.copy_(y)
        got, _, _ = buf.combine(zbuf, idx, w, h4, zero_copy=True)
        assert torch.equal(got, want), how
    assert stats.tolist() == ours[1].tolist()  # the positional call's stats


def test_elastic_form_options_not_implemented(store):
    """round_scale=True, use_logfmt=True and the wait-cost statistics raise
    NotImplementedError naming what to pass instead; the buffer then works."""
    buf = _alone(store)
    x, idx, w = _tokens(E=SPEC.epr)
    T = SPEC.T
    for call, words in [
        (lambda: buf.dispatch(x, idx, T, round_scale=True), ("round_scale", "False")),
        (
            lambda: buf.dispatch(x, idx, T, dispatch_wait_recv_cost_stats=torch.zeros(2)),
            ("dispatch_wait_recv_cost_stats", "None"),
        ),
    ]:
        raises(NotImplementedError, call, *words)
    recv_x, _, h4, _, _ = buf.dispatch(x, idx, T, use_fp8=False)
    for call, words in [
        (lambda: buf.combine(recv_x, idx, w, h4, use_logfmt=True), ("use_logfmt", "False")),
        (
            lambda: buf.combine(recv_x, idx, w, h4, combine_wait_recv_cost_stats=torch.zeros(2)),
            ("combine_wait_recv_cost_stats", "None"),
        ),
    ]:
        raises(NotImplementedError, call, *words)
    out, _, _ = buf.combine(recv_x, idx, w, h4)
    assert out.shape == (x.shape[0], SPEC.H)


def test_process_group_buffer_keeps_its_form():
    """A process group's Buffer has no elastic form: its slot methods raise RuntimeError
    naming create_elastic (test_upstream_surface.py checks its dispatch and combine)."""
    buf = Buffer.__new__(Buffer)
    buf._members = object()  # not Slots: what the slot methods look at
    for call in (buf.clean_mask_buffer, buf.get_comm_stream, buf.destroy):
        raises(RuntimeError, call, "create_elastic")


# --- the upstream timeline ----------------------------------------------------------------

UPSTREAM_TL = {"capacity": 4, "rounds": 6, "timeout_ms": 10000, "seed": SEED}


@pytest.fixture(scope="module")
def timeline():
    return Timeline("upstream", UPSTREAM_TL, [0, 1, 2], timeout_s=170).run()


PHASES = ["create", "connect", "forms", "clean", "reconnect", "local", "destroy"]


@pytest.mark.timeout(300)
def test_upstream_timeline(timeline):
    """Every phase of the upstream scenario, on every slot, with every round and check
    correct; slot 2's destroy is seen by the others' barrier well within timeout_ms."""
    n = UPSTREAM_TL["rounds"]
    problems = timeline.problems(PHASES, slots=[0, 1, 2])
    for phase in ("connect", "clean", "reconnect", "destroy"):
        problems += timeline.problems([phase], slots=[0, 1, 2], rounds=n)
    problems += timeline.troubles()
    assert not problems, report(problems, timeline)
    forms = {r["style"].get("form", "ours") for _, r in timeline.records(event="round")}
    assert forms == {"ours", "upstream-kw", "upstream-pos"}, forms
    for slot, rec in timeline.checks("destroy", "masked").items():
        assert rec["detect_s"] < UPSTREAM_TL["timeout_ms"] / 1000, (slot, rec)
