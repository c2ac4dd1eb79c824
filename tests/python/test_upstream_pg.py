"""Upstream Mooncake 0.3.14's ``mooncake.pg``, as code written for it calls it.

:data:`FUNCTIONS` lists every function of upstream's ``mooncake.pg`` with its
parameters: ours (name, default) beside upstream's name (``ARG``: upstream leaves it
unnamed, ``argN``, so callers pass it by position). Ours must take every call upstream's
takes: the same positional parameters in the same order, upstream's names where it has
them, and defaults only where upstream callers need none. The rows pin our own names and
defaults too, so that any drift on either side fails. :data:`OPTIONS_CTORS` does the same
for ``MooncakeBackendOptions``' six constructors, read from the pybind overloads, and
:data:`ENUMS`/:data:`RESPONSES` for the responses of membership changes.

Each name is also called, in this process (a group of one, made with the creator
torch uses), and at work in groups of ``mooncake-cpu`` ranks that die, are removed or
join (``support/pg_upstream_ranks.py``): two launches, world 4 and world 3 + joiners,
a few seconds each.
"""

from __future__ import annotations

import inspect
import re
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ft_parent import env, launch, mark_dead, wait_key, wait_keys
from mooncake import pg
from pg_upstream_ranks import elastic_rank, modes_rank

_NONE = object()  # no default
ARG = None  # upstream's parameter is unnamed (pybind's argN)

#: name: [(our parameter, upstream's name or ARG, our default or _NONE)].
FUNCTIONS = {
    "createMooncakeBackend": [("dist_backend_opts", ARG, _NONE), ("backend_options", ARG, _NONE)],
    "createMooncakeCpuBackend": [
        ("dist_backend_opts", ARG, _NONE),
        ("backend_options", ARG, _NONE),
    ],
    "set_host_ip": [("host_ip", ARG, _NONE)],
    "set_collective_timeout_us": [("us", "us", _NONE)],
    "set_p2p_timeout_us": [("us", "us", _NONE)],
    "set_fault_reconciliation_window_us": [("us", "us", _NONE)],
    "set_device_filter": [("filters", ARG, _NONE)],
    "set_transfer_engine": [("engine", "engine", _NONE)],
    "get_active_ranks": [("backend", ARG, None)],
    "get_num_synced_ranks": [("backend", ARG, None)],
    "extend_group_size_to": [("backend", ARG, _NONE), ("size", ARG, _NONE)],
    "get_peer_state": [("backend", ARG, _NONE), ("ranks", ARG, _NONE)],
    "recover_ranks": [("backend", ARG, _NONE), ("ranks", ARG, _NONE)],
    "activate_ranks": [("backend", ARG, _NONE), ("ranks", ARG, _NONE)],
    "deactivate_ranks": [("backend", "backend", _NONE), ("ranks", "ranks", _NONE)],
    "join_group": [("backend", ARG, None)],
    "get_failed_ranks_hint": [("work", "work", _NONE)],
    "get_local_success": [("work", "work", _NONE)],
    "get_current_epoch": [("backend", "backend", None)],
    "sync_after_failure": [("backend", "backend", _NONE)],
}

#: Upstream's constructors of MooncakeBackendOptions (positional parameter names).
OPTIONS_CTORS = [
    ["active_ranks"],
    ["active_ranks", "is_extension"],
    ["active_ranks", "is_extension", "max_group_size"],
    ["max_group_size"],
    ["max_group_size", "is_extension"],
    ["max_group_size", "is_extension", "auto_deactivate_on_failure", "auto_sync_on_failure"],
]
#: Our overloads, in order: (name, default or _NONE, keyword-only).
OPTIONS_OVERLOADS = [
    [
        ("active_ranks", _NONE, False),
        ("is_extension", "False", False),
        ("max_group_size", "None", False),
        ("max_world_size", "None", True),
        ("auto_deactivate_on_failure", "True", True),
        ("auto_sync_on_failure", "None", True),
    ],
    [
        ("max_group_size", _NONE, False),
        ("is_extension", "False", False),
        ("auto_deactivate_on_failure", "True", False),
        ("auto_sync_on_failure", "None", False),
    ],
]
OPTIONS_ATTRIBUTES = [
    "active_ranks",
    "is_extension",
    "max_group_size",
    "max_world_size",
    "auto_deactivate_on_failure",
    "auto_sync_on_failure",
]

#: Upstream's enums, with their values.
ENUMS = {
    "ProposalStatus": {"Rejected": 0, "Applied": 1, "AppliedWithDroppedRanks": 2},
    "SyncAfterFailureStatus": {"Reconciled": 0, "NoPending": 1, "Rejected": 2},
}
RESPONSES = {
    "ProposeViewUpdateResponse": ["status", "new_epoch", "dropped_ranks", "reject_reason"],
    "SyncAfterFailureResponse": ["status", "reject_reason"],
}


# --- the table ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_takes_every_call_upstreams_takes(name):
    fn = getattr(pg, name)
    assert name in pg.__all__, f"{name} is not in mooncake.pg.__all__"
    params = list(inspect.signature(fn).parameters.values())
    row = FUNCTIONS[name]
    got = [(p.name, p.default if p.default is not p.empty else _NONE) for p in params]
    assert got == [(ours, default) for ours, _, default in row], f"{name}: {got}"
    for p, (_, upstream, _) in zip(params, row, strict=True):
        assert p.kind is p.POSITIONAL_OR_KEYWORD, f"{name}({p.name}) is not positional"
        assert upstream in (ARG, p.name), f"{name}: upstream names {p.name!r} {upstream!r}"


def _overloads() -> list[list[tuple[str, object, bool]]]:
    """MooncakeBackendOptions' overloads from pybind's docstring."""
    doc = pg.MooncakeBackendOptions.__init__.__doc__
    out = []
    for sig in re.findall(r"__init__\(self[^,]*, (.*)\) -> None", doc):
        params, kw_only = [], False
        for part in sig.split(", "):
            if part == "*":
                kw_only = True
                continue
            m = re.fullmatch(r"(\w+): [^=]+?(?: = (.+))?", part)
            assert m, part
            params.append((m.group(1), m.group(2) if m.group(2) else _NONE, kw_only))
        out.append(params)
    return out


def test_options_overloads_are_pinned():
    assert _overloads() == OPTIONS_OVERLOADS


@pytest.mark.parametrize("ctor", OPTIONS_CTORS, ids=lambda c: ",".join(c))
def test_options_take_every_upstream_constructor(ctor):
    def takes(overload):
        positional = [p for p in overload if not p[2]]
        names = [p[0] for p in positional]
        rest = [p for p in overload if p[0] not in ctor]
        return names[: len(ctor)] == ctor and all(p[1] is not _NONE for p in rest)

    assert any(takes(o) for o in _overloads()), ctor
    values = {
        "active_ranks": torch.ones(3, dtype=torch.int32),
        "is_extension": True,
        "max_group_size": 3,
        "auto_deactivate_on_failure": False,
        "auto_sync_on_failure": False,
    }
    for o in (
        pg.MooncakeBackendOptions(*[values[n] for n in ctor]),
        pg.MooncakeBackendOptions(**{n: values[n] for n in ctor}),
    ):
        for n in ctor:
            got, want = getattr(o, n), values[n]
            same = got is want if isinstance(want, torch.Tensor) else got == want
            assert same, (n, got, want)
        if "active_ranks" not in ctor:
            assert o.active_ranks is None  # the backend makes its own mask
        for n in set(values) - set(ctor) - {"active_ranks", "max_group_size"}:
            assert getattr(o, n) is (n != "is_extension"), (n, getattr(o, n))


def test_options_keep_attributes_and_our_alias():
    o = pg.MooncakeBackendOptions(torch.ones(1, dtype=torch.int32), False)
    assert o.max_group_size is None and o.active_ranks.tolist() == [1]  # a tensor, not 1
    o = pg.MooncakeBackendOptions(torch.ones(4, dtype=torch.int32), max_world_size=4)
    assert (o.max_group_size, o.max_world_size) == (4, 4)
    for name in OPTIONS_ATTRIBUTES:
        assert isinstance(inspect.getattr_static(pg.MooncakeBackendOptions, name), property)
    o = pg.MooncakeBackendOptions(8, False, True, False)
    assert (o.auto_deactivate_on_failure, o.auto_sync_on_failure) == (True, False)
    o = pg.MooncakeBackendOptions(8, False, False)  # sync follows deactivate when not given
    assert (o.auto_deactivate_on_failure, o.auto_sync_on_failure) == (False, False)


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "words"),
    [
        ((8, False, False, True), {}, ValueError, ["auto_sync_on_failure", "auto_deactivate"]),
        ((0,), {}, ValueError, ["max_group_size", ">= 1"]),
        ((True,), {}, ValueError, ["max_group_size", "bool"]),
        ((2**40,), {}, ValueError, ["max_group_size", "fit"]),
        (
            (torch.ones(2, dtype=torch.int32), False, 2),
            {"max_world_size": 2},
            ValueError,
            ["max_group_size", "max_world_size", "not both"],
        ),
        ((torch.ones(2),), {}, ValueError, ["active_ranks", "int32"]),
        ((4.0,), {}, TypeError, ["incompatible", "max_group_size"]),
        (([1, 1],), {}, TypeError, ["incompatible", "active_ranks"]),
    ],
)
def test_options_refuse_bad_arguments(args, kwargs, exc, words):
    with pytest.raises(exc) as e:
        pg.MooncakeBackendOptions(*args, **kwargs)
    assert type(e.value) is exc
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_enums_have_upstreams_values(name):
    cls = getattr(pg, name)
    assert {k: int(v) for k, v in cls.__members__.items()} == ENUMS[name]
    assert pg.ViewUpdateStatus is pg.ProposalStatus


@pytest.mark.parametrize("name", sorted(RESPONSES))
def test_responses_have_upstreams_properties(name):
    cls = getattr(pg, name)
    props = [n for n, v in vars(cls).items() if isinstance(v, property)]
    assert sorted(props) == sorted(RESPONSES[name])


# --- every name called, in a group of one -------------------------------------------------


@pytest.fixture
def one():
    """A mooncake-cpu backend of one rank, made the way torch makes it; process-wide
    defaults put back afterwards."""
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.store = dist.HashStore()
    opts.group_rank, opts.group_size, opts.group_id = 0, 1, "one"
    opts.timeout = timedelta(seconds=5)
    backend = pg.createMooncakeCpuBackend(opts, None)
    yield backend, opts
    backend.shutdown()
    for knob in ("collective_timeout_ms", "p2p_timeout_ms", "report_grace_ms"):
        pg._ext.set_group_default(knob, -1)
    pg.set_transfer_engine(None)


def test_every_name_is_callable(one):
    b, opts = one
    assert dist.Backend._plugins["MOONCAKE-CPU"].creator_fn is pg.createMooncakeCpuBackend
    assert pg.get_active_ranks(b).tolist() == [1] and pg.get_num_synced_ranks(b) == 1
    assert pg.get_current_epoch(b) == 0
    sync = pg.sync_after_failure(b)
    assert (sync.status, sync.reject_reason) == (pg.SyncAfterFailureStatus.NoPending, "")
    pg.extend_group_size_to(b, 1)
    assert pg.get_peer_state(b, [0]) == [False]
    for call in (pg.recover_ranks, pg.activate_ranks):
        with pytest.raises(ValueError, match="is active"):
            call(b, [0])
    with pytest.raises(ValueError, match="this rank"):
        pg.deactivate_ranks(b, [0])
    with pytest.raises(ValueError, match="is_extension"):
        pg.join_group(b)
    work = b.allreduce([torch.ones(3)])
    hint = pg.get_failed_ranks_hint(work)
    assert (hint.tolist(), hint.dtype, pg.get_local_success(work)) == ([0], torch.int32, True)
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    other = gloo.allreduce([torch.ones(2)])
    other.wait()
    # Another backend's Work: upstream's answers (an undefined tensor is None in Python).
    assert pg.get_failed_ranks_hint(other) is None and pg.get_local_success(other) is False
    # The options torch passes in become the group's.
    opts.group_id = "manual"
    manual = pg.createMooncakeCpuBackend(opts, pg.MooncakeBackendOptions(1, False, False, False))
    assert manual.options.auto_deactivate_on_failure is False
    assert manual.active_ranks().tolist() == [1]  # its own mask
    manual.shutdown()
    if not pg._ext.build_info()["cuda"]:
        with pytest.raises(ValueError, match="needs CUDA"):
            pg.createMooncakeBackend(opts, None)
    with pytest.raises(ValueError, match="pg_options"):
        pg.createMooncakeCpuBackend(opts, {"timeout": 1})
    own = pg._default_engine()
    host_ip = own.host_ip
    pg.set_host_ip("127.0.0.1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a build without ucx says so
        pg.set_device_filter([])
    engine = pg.TransferEngine()
    pg.set_transfer_engine(engine)
    assert pg._default_engine() is engine
    pg.set_transfer_engine(None)
    assert pg._default_engine() is own and own.host_ip == "127.0.0.1"
    own.host_ip = host_ip
    before = b._timeouts_ms()
    pg.set_collective_timeout_us(1_500_001)
    pg.set_p2p_timeout_us(2_000)
    pg.set_fault_reconciliation_window_us(0)
    opts.group_id = "later"
    later = pg.createMooncakeCpuBackend(opts, None)
    assert later._timeouts_ms() == (1501, 2, 0) and b._timeouts_ms() == before
    later.shutdown()


@pytest.mark.parametrize(
    ("deactivate", "sync", "want"),
    [
        (None, None, (True, True)),
        ("0", None, (False, False)),
        ("1", "0", (True, False)),
        ("0", "1", "MOONCAKE_PG_AUTO_SYNC_ON_FAILURE=1 requires"),
        ("2", None, "MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE must be 0 or 1"),
    ],
)
def test_groups_without_options_read_upstreams_variables(one, monkeypatch, deactivate, sync, want):
    _, opts = one
    for name, value in (
        ("MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE", deactivate),
        ("MOONCAKE_PG_AUTO_SYNC_ON_FAILURE", sync),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    opts.group_id = f"env-{deactivate}-{sync}"
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            pg.createMooncakeCpuBackend(opts, None)
        return
    b = pg.createMooncakeCpuBackend(opts, None)
    assert (b.options.auto_deactivate_on_failure, b.options.auto_sync_on_failure) == want
    b.shutdown()
    # Options given win over the variables; a subgroup's copy keeps them.
    copy = pg.MooncakeBackendOptions(4, False, False, False).__deepcopy__({})
    assert (copy.auto_deactivate_on_failure, copy.auto_sync_on_failure) == (False, False)
    assert copy.max_group_size is None and copy.active_ranks is None


@pytest.mark.parametrize(
    ("call", "arg", "words"),
    [
        (pg.set_collective_timeout_us, 0, ["us", ">= 1"]),
        (pg.set_collective_timeout_us, 1.5, ["us", "int"]),
        (pg.set_p2p_timeout_us, -1, ["us", ">= 1"]),
        (pg.set_p2p_timeout_us, True, ["us", "int"]),
        (pg.set_fault_reconciliation_window_us, -1, ["us", ">= 0"]),
        (pg.set_fault_reconciliation_window_us, 2**63, ["us", "int"]),
    ],
)
def test_timeouts_refuse_bad_arguments(call, arg, words):
    with pytest.raises(ValueError) as e:
        call(arg)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_set_transfer_engine_refuses_other_objects():
    with pytest.raises(TypeError, match="engine"):
        pg.set_transfer_engine("engine")


# --- at work: failures handed to the application, removals, joins -------------------------


def _conduct_modes(group, extra):
    wait_key(group, "dying", 120, extra)
    mark_dead(group, "2")
    group.store.set("dead", "1")


@pytest.fixture(scope="module")
def modes():
    out = launch(4, modes_rank, {"timeout_s": 10.0}, env(), _conduct_modes, timeout_s=150)
    return out.get()


SURVIVORS = ("0", "1", "3")
PEER_FAILED_2 = "PeerFailedError ranks=[2]:"


@pytest.mark.timeout(200)
def test_options_without_a_mask_and_healthy_works(modes):
    """The group made with ``MooncakeBackendOptions(4, False, False, False)`` has its own
    int32 mask; a healthy op's (and a p2p op's) Work reports no failed peer."""
    for r, res in modes.items():
        assert res["options"] == (4, False, False, False, True), r
        assert res["view0"] == ([1, 1, 1, 1], 0) and res["mask_dtype"] == "torch.int32", r
        assert res["healthy"] == (([0, 0, 0, 0], "torch.int32", True), 15), r
    for r in ("0", "1"):
        assert modes[r]["p2p_healthy"] == ([0, 0, 0, 0], "torch.int32", True), r


@pytest.mark.timeout(200)
def test_bad_arguments_raise_and_the_group_stays_usable(modes):
    want = {
        "deactivate_range": "ValueError: deactivate_ranks: ranks must be in [0, max_world_size=4)",
        "deactivate_negative": "ValueError: deactivate_ranks: ranks must be in",
        "deactivate_twice": "is named twice",
        "deactivate_self": "is this rank",
        "deactivate_empty": "ranks is empty",
        "deactivate_not_a_list": "ranks must be a list of ints",
        "activate_active": "ValueError: recover_ranks: rank 0 is active",
        "hint_not_a_work": "TypeError: get_failed_ranks_hint: work must be",
        "success_not_a_work": "TypeError: get_local_success: work must be",
    }
    for r, res in modes.items():
        for name, (outcome, after) in res["bad"].items():
            assert after == ("ok", 15), (r, name, after)
            if name == "sync_nothing":
                assert outcome == ("ok", ("NoPending", "")), (r, outcome)
            else:
                assert outcome[0] == "err" and want[name] in outcome[1], (r, name, outcome)
        assert res["view_after_bad"] == ([1, 1, 1, 1], 0), r


@pytest.mark.timeout(200)
def test_timeouts_reach_only_later_groups(modes):
    for r, res in modes.items():
        assert res["timeouts"] == ((2500, 300, 101), (10000, 10000, 500)), r
    err, seconds, report = modes["0"]["p2p_timeout"]
    assert err[0] == "err" and err[1].startswith("TimeoutError"), err
    assert 0.25 < seconds < 3.0, seconds
    assert report == ([0, 1, 0, 0], "torch.int32", False)


@pytest.mark.timeout(200)
def test_deactivate_a_live_rank(modes):
    """Ranks 0-2 remove live rank 3: each gets Applied at epoch 1 (rank 2 dies later and
    reports nothing); rank 3's next ops raise LeftOutError saying so; asking again is
    Rejected."""
    for r in ("0", "1"):
        res = modes[r]
        assert res["deactivate_live"] == ("Applied", 1, [], ""), (r, res["deactivate_live"])
        assert res["D_after"] == (7, [1, 1, 1, 0], 1), r
        status, epoch, dropped, reason = res["deactivate_again"]
        assert (status, epoch, dropped) == ("Rejected", 1, []) and "not active" in reason, r
    for outcome in modes["3"]["left_out"]:
        assert outcome[0] == "err" and outcome[1].startswith("LeftOutError ranks=[3]:"), outcome
        assert "deactivate_ranks" in outcome[1], outcome


@pytest.mark.timeout(200)
def test_failures_left_to_the_application(modes):
    """auto_deactivate_on_failure=False: the op that meets dead rank 2 raises, its Work
    names rank 2, the view keeps it; later ops raise at once until sync_after_failure,
    which settles the view; then ops run among the survivors."""
    for r in SURVIVORS:
        res = modes[r]
        err, report, before = res["W_failed"]
        assert err[0] == "err" and err[1].startswith(PEER_FAILED_2), (r, err)
        assert report == ([0, 0, 1, 0], "torch.int32", False), (r, report)
        assert before == ([1, 1, 1, 1], 0), r
        again, seconds, still = res["W_again"]
        assert again[0] == "err" and again[1].startswith(PEER_FAILED_2), (r, again)
        assert "sync_after_failure" in again[1] and seconds < 1.0 and still == before, r
        assert res["W_sync"] == (("Reconciled", ""), ([1, 1, 0, 1], 1)), r
        assert res["W_after"] == ("ok", 11), r
        assert res["W_sync_again"] == ("NoPending", ""), r


@pytest.mark.timeout(200)
def test_auto_sync_off_settles_at_the_next_op(modes):
    for r in SURVIVORS:
        res = modes[r]
        err, _ = res["S_failed"]
        assert err[0] == "err" and err[1].startswith(PEER_FAILED_2), (r, err)
        # The failed op's view is the old one, unless the others settled it first.
        assert res["S_next"] == (
            ("ok", True),
            11,
            ([0, 0, 0, 0], "torch.int32", True),
            ([1, 1, 0, 1], 1),
        ), (r, res["S_next"])


@pytest.mark.timeout(200)
def test_auto_mode_reports_the_failure_in_the_work(modes):
    for r in SURVIVORS:
        res = modes[r]
        assert res["A_op"] == (
            ("ok", True),
            11,
            ([0, 0, 1, 0], "torch.int32", False),
            ([1, 1, 0, 1], 1),
        ), (r, res["A_op"])
    err, report = modes["0"]["A_p2p"]
    assert err[0] == "err" and err[1].startswith(PEER_FAILED_2), err
    assert report == ([0, 0, 1, 0], "torch.int32", False)


@pytest.mark.timeout(200)
def test_deactivate_a_dead_rank(modes):
    for r in SURVIVORS:
        res = modes[r]
        assert res["K_deactivate"] == ("Applied", 1, [], ""), (r, res["K_deactivate"])
        assert res["K_after"] == (("ok", 11), ([1, 1, 0, 1], 1)), r


ELASTIC = {"timeout_s": 10.0, "role": "member"}


def _conduct_elastic(group, extra):
    wait_keys(group, [f"ready/{r}" for r in range(3)], 120, extra)
    group.start(elastic_rank, ranks=[3], args=(dict(ELASTIC, role="joiner"),))
    wait_key(group, "dying", 120, extra)
    mark_dead(group, "1")
    group.store.set("dead", "1")
    wait_key(group, "spawn-doomed", 120, extra)
    (key,) = group.start(elastic_rank, ranks=[1], args=(dict(ELASTIC, role="doomed"),))
    mark_dead(group, key, 60)
    group.store.set("doomed-gone", "1")
    wait_key(group, "spawn-replacement", 120, extra)
    group.start(elastic_rank, ranks=[1], args=(dict(ELASTIC, role="replacement"),))


@pytest.fixture(scope="module")
def elastic():
    return launch(3, elastic_rank, ELASTIC, env(), _conduct_elastic, timeout_s=200).get()


@pytest.mark.timeout(250)
def test_activate_and_recover_responses(elastic):
    """activate_ranks admits rank 3 (Applied, epoch 1); rank 1 dies (epoch 2); a
    replacement that dies before joining is admitted and dropped
    (AppliedWithDroppedRanks [1], epoch 4); the next is admitted (Applied, epoch 5)."""
    assert sorted(elastic) == ["0", "1.2", "2", "3"], sorted(elastic)
    for r in ("0", "2"):
        res = elastic[r]
        assert res["mask_is_the_given_one"] and res["view0"] == ([1, 1, 1, 0], 0), r
        assert res["activate"] == ("Applied", 1, [], ""), r
    for r in ("0", "2", "3"):
        res = elastic[r]
        assert res["mask4"] == (("ok", 15), ([1, 1, 1, 1], 1)), r
        assert res["mask3"] == (("ok", 13), ([1, 0, 1, 1], 2)), r
        assert res["recover_doomed"] == ("AppliedWithDroppedRanks", 4, [1], ""), r
        assert res["after_doomed"] == (("ok", 13), ([1, 0, 1, 1], 4)), r
        assert res["recover"] == ("Applied", 5, [], ""), r
        assert res["after"] == (("ok", 15), ([1, 1, 1, 1], 5)), r
        # The word read in place is the backend's view_version, and moves with the view.
        versions = res["versions"]
        assert all(a == b for a, b in versions), (r, versions)
        assert versions[0][0] < versions[1][0] < versions[2][0], (r, versions)
    assert elastic["3"]["joined"] == ([1, 1, 1, 1], 1)
    assert elastic["1.2"]["joined"] == ([1, 1, 1, 1], 5)
    for r in ("3", "1.2"):
        assert elastic[r]["sync_after_join"] == ("NoPending", ""), r
    assert elastic["1.2"]["after"] == (("ok", 15), ([1, 1, 1, 1], 5))
