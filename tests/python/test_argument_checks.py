"""Every argument check of the public Python API, as one table, and one test per row.

:data:`ROWS` lists, for the process group (``mooncake.pg`` and ``torch.distributed`` on a
``mooncake-cpu`` group), the EP ``Buffer``, the elastic EP buffer and the high-throughput
``ElasticBuffer`` (``mooncake.mooncake_elastic_buffer``), each rule an
argument must follow: the function, the argument, the rule in plain words, the exception
and the words its message must contain, and the bad call itself. ``docs/argument-checks.md``
holds the same table (``python tests/python/test_argument_checks.py --markdown`` prints
it); :func:`test_doc_table_matches_the_rows` keeps the two in step.

Every row runs on both ranks of one world-2 launch (``launcher.py``): the bad call must
raise exactly the row's exception type (not a subclass, not another type) on every rank,
with each of the row's words in its message (case-insensitive, as whole tokens: ``ranks``
does not match inside ``recover_ranks``). Then the group or buffer must still be usable,
shown by a correct operation checked against a reference:

* PG: a small and a chunked ``all_reduce`` equal to ``reference.reduce_ref`` bit for bit
  (``test_errors.healthy``), and an exact ``all_reduce`` in the ``max_world_size=4``
  subgroup once it exists; after a rejected ``init_process_group``, no default group is
  left behind and a correct one is created first.
* EP: a dispatch + combine round of the launch's ``Buffer`` checked against the plain
  model of ``ep_cases`` (``ep_cases.good_round``).
* elastic EP: a dispatch + combine round of the launch's elastic buffer (capacity 4,
  slots 0 and 1 connected) checked against the same model (``elastic_round.play_round``),
  which also checks that the active slots are still exactly {0, 1}.
* ElasticBuffer: a fresh and a cached dispatch and their combines on the launch's
  ElasticBuffer, checked against the plain model of ``ht_model`` (``ht_cases.good_round``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ep_cases import (
    SMALL,
    Checks,
    Round,
    _other_buffer,
    _small_buffer,
    combine_args,
    dispatch_args,
    get_buffer,
    good_round,
    mode_flags,
)
from launcher import Case, Launch, check, parametrize
from test_errors import healthy

DOC = Path(__file__).resolve().parents[2] / "docs" / "argument-checks.md"

PG, EP, ELASTIC, HT = "PG", "EP", "elastic EP", "ElasticBuffer"

#: The elastic buffer of the launch: capacity, experts per slot.
CAPACITY, EPR = 4, 2


@dataclass(frozen=True)
class Row:
    """One argument rule and the call that breaks it."""

    id: str  # the case name, unique
    area: str  # PG | EP | elastic EP | ElasticBuffer
    function: str
    argument: str
    rule: str  # plain words
    exception: type[Exception]
    words: tuple[str, ...]  # the message contains each (case-insensitive, whole tokens)
    call: Callable  # call(ctx): the bad call, made on every rank


# --- what the rows call on: the launch's groups and buffers ------------------------------------

_state: dict = {}


def world(ctx):
    """The default group, created (correctly) when a row's init left none."""
    if not dist.is_initialized():
        ctx.init_pg()
    return dist.group.WORLD


def _drop_world() -> None:
    """Destroys the default group (and so every subgroup) for an init row."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.pop("ext", None)
    _state.pop("gloo", None)


def ext_group(ctx):
    """A mooncake subgroup of every rank with ``max_world_size=4`` (collective, once)."""
    from mooncake import pg

    world(ctx)
    if "ext" not in _state:
        active = torch.ones(4, dtype=torch.int32)
        opts = pg.MooncakeBackendOptions(active, False, 4)
        _state["ext"] = dist.new_group(list(range(ctx.world_size)), pg_options=opts)
    return _state["ext"]


def gloo_group(ctx):
    world(ctx)
    if "gloo" not in _state:
        _state["gloo"] = dist.new_group(list(range(ctx.world_size)), backend="gloo")
    return _state["gloo"]


def backend(ctx):
    """The mooncake backend object of the default group."""
    return world(ctx)._get_backend(torch.device("cpu"))


def ep_buffer(ctx):
    """The launch's EP Buffer (``ep_cases.get_buffer``) over the default group."""
    world(ctx)
    return get_buffer(ctx)


def dispatch_with(change: Callable) -> Callable:
    """A call of the launch Buffer's dispatch with correct arguments (``ep_cases.SMALL``),
    updated with ``change(args, ctx)``; ``args["buf"]`` replaces the Buffer."""

    def call(ctx):
        buf = ep_buffer(ctx)
        args = dispatch_args(Round(ctx, buf, SMALL, "bad"))
        args.update(change(args, ctx))
        buf = args.pop("buf", buf)
        buf.dispatch(**args)

    return call


def combine_with(change: Callable) -> Callable:
    """A finished dispatch, then its combine with correct arguments updated with
    ``change(args, ctx)``."""

    def call(ctx):
        buf = ep_buffer(ctx)
        r = Round(ctx, buf, SMALL, "bad")
        r.dispatch()
        args = combine_args(r, r.expert_outputs())
        args.update(change(args, ctx))
        buf.combine(**args)

    return call


def stale_handle(ctx):
    """The handle of a dispatch whose half two later dispatches have reused."""
    buf = ep_buffer(ctx)
    rounds = [Round(ctx, buf, SMALL, f"stale{i}") for i in range(3)]
    for r in rounds:
        r.dispatch()
    return rounds[0]


def combine_before_hook(ctx):
    """combine of a dispatch whose ``hook()`` has not run; the hook runs afterwards."""
    buf = ep_buffer(ctx)
    r = Round(ctx, buf, SMALL, "unfinished")
    ins = r.ins[ctx.rank]
    out = buf.dispatch(ins.x, ins.idx, None, SMALL.T, r.E, -1, False, **mode_flags("hook"))
    handle, hook = out[2], out[4]
    y = torch.zeros(SMALL.epr, ctx.world_size * SMALL.T, SMALL.H, dtype=torch.bfloat16)
    try:
        buf.combine(y, ins.idx, ins.w, None, -1, handle)
    finally:
        hook()


def combine_stale_zero_copy(ctx):
    r = stale_handle(ctx)
    ins = r.ins[ctx.rank]
    y = torch.zeros(SMALL.epr, ctx.world_size * SMALL.T, SMALL.H, dtype=torch.bfloat16)
    ep_buffer(ctx).combine(y, ins.idx, ins.w, None, -1, r.handle, zero_copy=True)


def members_changed(args, ctx):
    """update_ep_member between the dispatch and its combine (collective)."""
    ep_buffer(ctx).update_ep_member()
    return {}


def over_capacity(ctx):
    """T tokens that each select expert 0 twice: 2T rows for one expert's T slots."""
    T, R = SMALL.T, ctx.world_size
    x = torch.ones(T, SMALL.H, dtype=torch.bfloat16)
    idx = torch.zeros(T, 2, dtype=torch.int64)
    ep_buffer(ctx).dispatch(x, idx, None, T, SMALL.epr * R, -1, use_fp8=False)


def new_buffer(*args, **kwargs):
    from mooncake.mooncake_ep_buffer import Buffer

    return lambda ctx: Buffer(
        *[a(ctx) if callable(a) else a for a in args],
        **{k: v(ctx) if callable(v) else v for k, v in kwargs.items()},
    )


def size_hint(*args):
    from mooncake.mooncake_ep_buffer import Buffer

    return lambda ctx: Buffer.get_ep_buffer_size_hint(*args)


def elastic(ctx):
    """The launch's elastic buffer: slot ``ctx.rank`` of capacity 4, connected to every
    other rank of the launch and published (collective, once)."""
    from mooncake.mooncake_ep_buffer import Buffer

    if "elastic" not in _state:
        buf = Buffer.create_elastic(
            rank=ctx.rank,
            tcp_store_group=ctx.store,
            timeout_ms=20000,
            metadata_timeout_ms=60000,
            store_prefix="ep/",
        )
        buf.update_memory_buffers(num_ranks=CAPACITY, num_experts_per_rank=EPR)
        buf.connect_ranks([q for q in range(ctx.world_size) if q != ctx.rank], activate=True)
        _state["elastic"] = buf
    return _state["elastic"]


def create_elastic(**kw):
    """``Buffer.create_elastic`` with correct arguments updated with ``kw``."""
    from mooncake.mooncake_ep_buffer import Buffer

    def call(ctx):
        args = dict(rank=ctx.rank, tcp_store_group=ctx.store, store_prefix="fresh/")
        args.update(kw)
        Buffer.create_elastic(**args)

    return call


def fresh_elastic(ctx, slot: int | None = None, store=True, **kw):
    """A new elastic buffer of this process (its own store prefix), not allocated yet."""
    from mooncake.mooncake_ep_buffer import Buffer

    args = dict(rank=ctx.rank if slot is None else slot, store_prefix="fresh/")
    args.update(tcp_store_group=ctx.store if store else None, **kw)
    return Buffer.create_elastic(**args)


def destroyed_elastic(ctx):
    """A buffer of this process alone (its own store prefix), allocated and destroyed."""
    buf = fresh_elastic(ctx, explicitly_destroy=True, store_prefix=f"gone{ctx.rank}/")
    buf.update_memory_buffers(CAPACITY, EPR)
    buf.destroy()
    return buf


def upstream_dispatch(**kw):
    """The launch's elastic buffer's dispatch in upstream's elastic form (shape of
    ``elastic_ranks.bad_dispatch``), with ``kw`` added."""

    def call(ctx):
        x = torch.zeros(4, 128, dtype=torch.bfloat16)
        idx = torch.zeros(4, 1, dtype=torch.int64)
        elastic(ctx).dispatch(x, idx, 8, EPR * 2, use_fp8=False, **kw)

    return call


def upstream_combine(handle=None, **kw):
    """The launch's elastic buffer's combine in upstream's elastic form."""

    def call(ctx):
        y = torch.zeros(EPR, 2 * 8, 128, dtype=torch.bfloat16)
        idx = torch.zeros(4, 1, dtype=torch.int64)
        w = torch.ones(4, 1)
        h = handle if handle is not None else (torch.zeros(EPR, 16), torch.zeros(EPR, 2), 8, 128)
        elastic(ctx).combine(y, idx, w, h, **kw)

    return call


def peer(ctx) -> int:
    """Another slot of the launch that is connected and active."""
    return (ctx.rank + 1) % ctx.world_size


def disconnected_slot(ctx) -> int:
    return ctx.world_size  # the first slot no process holds


def elastic_dispatch(num_experts):
    from elastic_ranks import bad_dispatch

    return lambda ctx: bad_dispatch(elastic(ctx), num_experts)


def bad_dispatch_of(buf):
    from elastic_ranks import bad_dispatch

    return bad_dispatch(buf, EPR * 2)


def _p2p_batch(ctx):
    dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.zeros(3), ctx.world_size)])


def _opts(*args):
    from mooncake import pg

    return pg.MooncakeBackendOptions(*args)


def init_with(options: Callable) -> Callable:
    """``init_process_group("mooncake-cpu", pg_options=options(ctx))`` after dropping the
    default group."""

    def call(ctx):
        _drop_world()
        ctx.init_pg(pg_options=options(ctx))

    return call


def _i32(*shape, **kw):
    return torch.ones(*shape, dtype=torch.int32, **kw)


def pg_options(*args):
    from mooncake import pg

    return pg.MooncakeBackendOptions(*args)


def pg_call(name: str, *args) -> Callable:
    """``mooncake.pg.<name>(*args)``; an arg that is a function of ctx is called first."""

    def call(ctx):
        from mooncake import pg

        world(ctx)
        getattr(pg, name)(*[a(ctx) if callable(a) else a for a in args])

    return call


def dist_call(fn: Callable) -> Callable:
    def call(ctx):
        world(ctx)
        fn(ctx)

    return call


def _root_list(ctx, n: int, size: int = 3):
    return [torch.zeros(size) for _ in range(n)] if ctx.rank == 0 else None


def _ext_then(fn: Callable) -> Callable:
    """Extends the subgroup to its max_world_size (4), then ``fn(group)``."""

    def call(ctx):
        from mooncake import pg

        g = ext_group(ctx)
        pg.extend_group_size_to(g, 4)
        fn(g)

    return call


def _ext(fn: Callable) -> Callable:
    return lambda ctx: fn(ext_group(ctx))


# --- the table -------------------------------------------------------------------------------

X3 = torch.zeros(3)


def _pg_rows() -> list[Row]:
    from mooncake import pg

    R = PG
    V, T = ValueError, TypeError
    return [
        # init_process_group: these come first (they drop the default group).
        Row("pg/init/active_ranks-length", R, "dist.init_process_group", "pg_options.active_ranks",
            "must have max_world_size entries (the world size without one)", V,
            ("active_ranks", "entries"), init_with(lambda c: _opts(_i32(c.world_size + 1)))),
        Row("pg/init/active_ranks-device", R, "dist.init_process_group", "pg_options.active_ranks",
            "must be on the CPU for mooncake-cpu", V, ("active_ranks", "cpu"),
            init_with(lambda c: _opts(_i32(c.world_size, device="meta")))),
        Row("pg/init/active_ranks-contiguous", R, "dist.init_process_group",
            "pg_options.active_ranks", "must be contiguous", V, ("active_ranks", "contiguous"),
            init_with(lambda c: _opts(_i32(2 * c.world_size)[::2]))),
        Row("pg/init/max_world_size-below-world", R, "dist.init_process_group",
            "pg_options.max_world_size", "must be >= the world size", V,
            ("max_world_size", "world size"),
            init_with(lambda c: _opts(_i32(c.world_size), False, c.world_size - 1))),
        Row("pg/init/pg_options-type", R, "dist.init_process_group", "pg_options",
            "must be a mooncake.pg.MooncakeBackendOptions", V,
            ("pg_options", "MooncakeBackendOptions"), init_with(lambda c: {"timeout": 1})),
        Row("pg/new_group/active_ranks-length", R, "dist.new_group", "pg_options.active_ranks",
            "must have max_world_size entries (the group size without one)", V,
            ("active_ranks", "entries"),
            dist_call(lambda c: dist.new_group(pg_options=_opts(_i32(c.world_size + 2))))),
        # MooncakeBackendOptions
        Row("pg/options/active_ranks-dtype", R, "pg.MooncakeBackendOptions", "active_ranks",
            "must be a torch.int32 tensor", V, ("active_ranks", "int32"),
            lambda c: _opts(torch.ones(c.world_size))),
        Row("pg/options/active_ranks-1d", R, "pg.MooncakeBackendOptions", "active_ranks",
            "must be 1-D", V, ("active_ranks", "1-D"), lambda c: _opts(_i32(1, c.world_size))),
        Row("pg/options/active_ranks-type", R, "pg.MooncakeBackendOptions", "active_ranks",
            "must be a torch.Tensor (the binding's signature)", T,
            ("active_ranks", "incompatible"), lambda c: _opts([1] * c.world_size)),
        Row("pg/options/max_world_size-0", R, "pg.MooncakeBackendOptions", "max_world_size",
            "must be >= 1", V, ("max_world_size", ">= 1"),
            lambda c: _opts(_i32(c.world_size), False, 0)),
        # mooncake.pg helpers
        Row("pg/set_host_ip/empty", R, "pg.set_host_ip", "host_ip", "must be a non-empty string",
            V, ("host_ip", "non-empty string"), pg_call("set_host_ip", "")),
        Row("pg/set_device_filter/str", R, "pg.set_device_filter", "filters",
            "must be a list of strings (not one string)", V, ("filters", "list of strings"),
            pg_call("set_device_filter", "mlx5_0")),
        Row("pg/set_device_filter/none", R, "pg.set_device_filter", "filters",
            "must be an iterable of strings (not None)", V, ("filters", "list of strings"),
            pg_call("set_device_filter", None)),
        Row("pg/set_collective_timeout_us/zero", R, "pg.set_collective_timeout_us", "us",
            "must be an int >= 1 (microseconds)", V, ("us", ">= 1"),
            pg_call("set_collective_timeout_us", 0)),
        Row("pg/set_p2p_timeout_us/float", R, "pg.set_p2p_timeout_us", "us",
            "must be an int (not a float)", V, ("us", "1.5"), pg_call("set_p2p_timeout_us", 1.5)),
        Row("pg/set_fault_reconciliation_window_us/negative", R,
            "pg.set_fault_reconciliation_window_us", "us", "must be an int >= 0", V,
            ("us", ">= 0"), pg_call("set_fault_reconciliation_window_us", -1)),
        Row("pg/options/auto_sync-without-deactivate", R, "pg.MooncakeBackendOptions",
            "auto_sync_on_failure", "True needs auto_deactivate_on_failure=True", V,
            ("auto_sync_on_failure", "auto_deactivate_on_failure"),
            lambda c: pg_options(c.world_size, False, False, True)),
        Row("pg/options/max_group_size-bool", R, "pg.MooncakeBackendOptions", "max_group_size",
            "must be an int (not a bool)", V, ("max_group_size", "bool"),
            lambda c: pg_options(True)),
        Row("pg/deactivate_ranks/self", R, "pg.deactivate_ranks", "ranks",
            "must not name this rank (the ranks that stay call it)", V, ("ranks", "this rank"),
            pg_call("deactivate_ranks", lambda c: dist.group.WORLD, lambda c: [c.rank])),
        Row("pg/deactivate_ranks/range", R, "pg.deactivate_ranks", "ranks",
            "must be in [0, max_world_size)", V, ("ranks", "[0, max_world_size"),
            pg_call("deactivate_ranks", lambda c: dist.group.WORLD, lambda c: [c.world_size + 5])),
        Row("pg/get_failed_ranks_hint/work-type", R, "pg.get_failed_ranks_hint", "work",
            "must be a torch.distributed Work", T, ("work", "Work"),
            pg_call("get_failed_ranks_hint", "not a work")),
        Row("pg/set_transfer_engine/type", R, "pg.set_transfer_engine", "engine",
            "must be a mooncake.TransferEngine", T, ("engine", "TransferEngine"),
            pg_call("set_transfer_engine", "engine")),
        Row("pg/get_preferred_hca/backend", R, "pg.get_preferred_hca", "backend",
            "must be a ProcessGroup or a mooncake backend", V, ("backend", "ProcessGroup"),
            pg_call("get_preferred_hca", "world", "cuda:0")),
        Row("pg/get_active_ranks/backend-type", R, "pg.get_active_ranks", "backend",
            "must be a ProcessGroup or a mooncake backend", V, ("backend", "ProcessGroup"),
            pg_call("get_active_ranks", 42)),
        Row("pg/get_active_ranks/backend-gloo", R, "pg.get_active_ranks", "backend",
            "the group must have a mooncake backend", V, ("backend", "no mooncake backend"),
            pg_call("get_active_ranks", gloo_group)),
        Row("pg/get_num_synced_ranks/backend", R, "pg.get_num_synced_ranks", "backend",
            "must be a ProcessGroup or a mooncake backend", V, ("backend", "ProcessGroup"),
            pg_call("get_num_synced_ranks", "world")),
        Row("pg/join_group/not-extension", R, "pg.join_group", "backend",
            "its group must have been created with is_extension=True", V,
            ("join_group", "is_extension"), pg_call("join_group", lambda c: dist.group.WORLD)),
        Row("pg/transport_of/peer", R, "MooncakeBackend.transport_of", "peer",
            "must be in [0, world size)", V, ("peer", "[0, 2)"),
            lambda c: backend(c).transport_of(c.world_size)),
        # the extension API, on a subgroup with max_world_size 4 (world size 2)
        Row("pg/extend_group_size_to/size-type", R, "pg.extend_group_size_to", "size",
            "must be an int (not a bool or float)", V, ("size", "int"),
            _ext(lambda g: pg.extend_group_size_to(g, 3.0))),
        Row("pg/extend_group_size_to/size-above-max", R, "pg.extend_group_size_to", "size",
            "must be <= max_world_size", V, ("size", "max_world_size=4"),
            _ext(lambda g: pg.extend_group_size_to(g, 5))),
        Row("pg/extend_group_size_to/size-below-world", R, "pg.extend_group_size_to", "size",
            "must be >= the current (extended) size", V, ("size", "[2, max_world_size=4]"),
            _ext(lambda g: pg.extend_group_size_to(g, 1))),
        Row("pg/extend_group_size_to/size-huge", R, "pg.extend_group_size_to", "size",
            "must fit an int64", V, ("size", "int"),
            _ext(lambda g: pg.extend_group_size_to(g, 2**70))),
        Row("pg/watch_loss_times/peer-range", R, "LossTimes.gone_at", "peer",
            "must be in [0, max_world_size)", V, ("peer", "[0, 4)"),
            _ext(lambda g: pg.watch_loss_times(g).gone_at(4))),
        Row("pg/watch_loss_times/peer-negative", R, "LossTimes.silent_at", "peer",
            "must be in [0, max_world_size)", V, ("peer", "[0, 4)"),
            _ext(lambda g: pg.watch_loss_times(g).silent_at(-1))),
        Row("pg/get_peer_state/ranks-type", R, "pg.get_peer_state", "ranks",
            "must be a list of ints", V, ("ranks", "list of ints"),
            _ext(lambda g: pg.get_peer_state(g, 3))),
        Row("pg/get_peer_state/ranks-none", R, "pg.get_peer_state", "ranks",
            "must be a list of ints (not None)", V, ("ranks", "list of ints"),
            _ext(lambda g: pg.get_peer_state(g, None))),
        Row("pg/get_peer_state/ranks-range", R, "pg.get_peer_state", "ranks",
            "each must be in [0, max_world_size)", V, ("ranks", "max_world_size=4"),
            _ext(lambda g: pg.get_peer_state(g, [4]))),
        Row("pg/recover_ranks/ranks-type", R, "pg.recover_ranks", "ranks",
            "must be a list of ints (not bools)", V, ("ranks", "list of ints"),
            _ext(lambda g: pg.recover_ranks(g, [True]))),
        Row("pg/recover_ranks/ranks-empty", R, "pg.recover_ranks", "ranks",
            "must not be empty", V, ("ranks", "empty"), _ext(lambda g: pg.recover_ranks(g, []))),
        Row("pg/recover_ranks/ranks-range", R, "pg.recover_ranks", "ranks",
            "each must be in [0, max_world_size)", V, ("ranks", "max_world_size=4"),
            _ext(lambda g: pg.recover_ranks(g, [-1]))),
        Row("pg/recover_ranks/ranks-active", R, "pg.recover_ranks", "ranks",
            "must not name an active rank", V, ("rank 0", "is active"),
            _ext(lambda g: pg.recover_ranks(g, [0]))),
        # before any row extends the subgroup
        Row("pg/recover_ranks/ranks-not-extended", R, "pg.recover_ranks", "ranks",
            "each must be below the size extend_group_size_to admitted", V,
            ("rank 3", "extend_group_size_to"), _ext(lambda g: pg.recover_ranks(g, [3]))),
        Row("pg/recover_ranks/ranks-twice", R, "pg.recover_ranks", "ranks",
            "must not name a rank twice", V, ("rank 2", "named twice"),
            _ext_then(lambda g: pg.recover_ranks(g, [2, 2]))),
        Row("pg/recover_ranks/ranks-nobody-waits", R, "pg.recover_ranks", "ranks",
            "a process must wait to join as each rank (poll get_peer_state)", V,
            ("rank 3", "no process waits"), _ext_then(lambda g: pg.recover_ranks(g, [3]))),
        # collectives and p2p through torch.distributed
        Row("pg/broadcast/src", R, "dist.broadcast", "src", "must be in [0, world size) (the extended size after extend_group_size_to)", V,
            ("src", "[0, 2)"), dist_call(lambda c: dist.broadcast(X3.clone(), src=c.world_size))),
        Row("pg/reduce/dst", R, "dist.reduce", "dst", "must be in [0, world size) (the extended size after extend_group_size_to)", V,
            ("dst", "[0, 2)"), dist_call(lambda c: dist.reduce(X3.clone(), dst=c.world_size))),
        Row("pg/gather/dst", R, "dist.gather", "dst", "must be in [0, world size) (the extended size after extend_group_size_to)", V,
            ("dst", "[0, 2)"), dist_call(lambda c: dist.gather(X3.clone(), None, c.world_size))),
        Row("pg/gather/gather_list-length", R, "dist.gather", "gather_list",
            "must have world-size entries (or as many as the extended size) on the destination", V,
            ("gather_list", "entries"),
            dist_call(lambda c: dist.gather(X3.clone(), _root_list(c, c.world_size + 1), 0))),
        Row("pg/scatter/src", R, "dist.scatter", "src", "must be in [0, world size) (the extended size after extend_group_size_to)", V,
            ("src", "[0, 2)"), dist_call(lambda c: dist.scatter(X3.clone(), None, -1))),
        Row("pg/scatter/scatter_list-size", R, "dist.scatter", "scatter_list",
            "every tensor must match the output tensor", V, ("scatter_list", "must match"),
            dist_call(lambda c: dist.scatter(X3.clone(), _root_list(c, c.world_size, 4), 0))),
        Row("pg/send/dst", R, "dist.send", "dst", "must be in [0, world size) (the extended size after extend_group_size_to)", V,
            ("dst", "[0, 2)"), dist_call(lambda c: dist.send(X3.clone(), dst=c.world_size))),
        Row("pg/recv/src", R, "dist.recv", "src", "must be in [0, world size) (the extended size after extend_group_size_to) (or any source)",
            V, ("src", "[0, 2)"), dist_call(lambda c: dist.recv(X3.clone(), src=c.world_size))),
        Row("pg/isend/dst", R, "dist.isend", "dst", "must be in [0, world size) (the extended size after extend_group_size_to)", V,
            ("dst", "[0, 2)"), dist_call(lambda c: dist.isend(X3.clone(), dst=c.world_size + 3))),
        Row("pg/irecv/src", R, "dist.irecv", "src", "must be in [0, world size) (the extended size after extend_group_size_to) (or any source)",
            V, ("src", "[0, 2)"), dist_call(lambda c: dist.irecv(X3.clone(), src=-5))),
        Row("pg/all_reduce/op-dtype", R, "dist.all_reduce", "op",
            "must be defined for the dtype (no bitwise ops on floats)", V,
            ("op", "BAND", "float32"),
            dist_call(lambda c: dist.all_reduce(X3.clone(), op=dist.ReduceOp.BAND))),
        Row("pg/all_reduce/op-avg-bool", R, "dist.all_reduce", "op",
            "AVG needs a floating-point tensor", V, ("op", "AVG", "bool"),
            dist_call(lambda c: dist.all_reduce(torch.zeros(3, dtype=torch.bool),
                                                op=dist.ReduceOp.AVG))),
        Row("pg/all_reduce/op-premul_sum", R, "dist.all_reduce", "op",
            "must be SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR", V, ("op", "PREMUL_SUM"),
            dist_call(lambda c: dist.all_reduce(torch.ones(3),
                                                op=dist._make_nccl_premul_sum(2.0)))),
        Row("pg/all_reduce/tensor-dtype", R, "dist.all_reduce", "tensor",
            "must have a dtype mooncake moves (not float8)", V, ("tensor", "float8_e4m3fn"),
            dist_call(lambda c: dist.all_reduce(torch.zeros(3, dtype=torch.float8_e4m3fn)))),
        Row("pg/all_reduce/tensor-layout", R, "dist.all_reduce", "tensor",
            "must be a dense (strided) tensor, not sparse", V, ("tensor", "dense"),
            dist_call(lambda c: dist.all_reduce(torch.zeros(3).to_sparse()))),
        Row("pg/all_gather/tensor_list-length", R, "dist.all_gather", "tensor_list",
            "must have world-size entries (or as many as the extended size)", V, ("tensor_list", "entries"),
            dist_call(lambda c: dist.all_gather([torch.zeros(3)] * (c.world_size + 1), X3))),
        Row("pg/all_gather/tensor_list-size", R, "dist.all_gather", "tensor_list",
            "every tensor must match the input tensor", V, ("tensor_list", "must match"),
            dist_call(lambda c: dist.all_gather([torch.zeros(4)] * c.world_size, X3))),
        Row("pg/all_gather_into_tensor/output_tensor-size", R, "dist.all_gather_into_tensor",
            "output_tensor", "must have world size * input numel elements", V,
            ("output_tensor", "world_size * input numel"),
            dist_call(lambda c: dist.all_gather_into_tensor(torch.zeros(3 * c.world_size + 1),
                                                            X3))),
        Row("pg/all_gather_into_tensor/output_tensor-dtype", R, "dist.all_gather_into_tensor",
            "output_tensor", "must have the input tensor's dtype", V,
            ("output_tensor", "float64"),
            dist_call(lambda c: dist.all_gather_into_tensor(torch.zeros(3 * c.world_size),
                                                            X3.double()))),
        Row("pg/reduce_scatter_tensor/input-size", R, "dist.reduce_scatter_tensor", "input",
            "must have world size * output numel elements", V,
            ("input", "world_size * output numel"),
            dist_call(lambda c: dist.reduce_scatter_tensor(torch.zeros(3), torch.zeros(4)))),
        Row("pg/reduce_scatter/input_list-length", R, "dist.reduce_scatter", "input_list",
            "must have world-size entries (or as many as the extended size)", V, ("input_list", "entries"),
            dist_call(lambda c: dist.reduce_scatter(X3.clone(),
                                                    [torch.zeros(3)] * (c.world_size + 1)))),
        Row("pg/all_to_all_single/input_split_sizes-sum", R, "dist.all_to_all_single",
            "input_split_sizes", "must sum to the input's dim 0", V,
            ("input_split_sizes", "sum to"),
            dist_call(lambda c: dist.all_to_all_single(
                torch.zeros(c.world_size), torch.zeros(c.world_size),
                [1] * c.world_size, [2] * c.world_size))),
        Row("pg/all_to_all_single/input_split_sizes-negative", R, "dist.all_to_all_single",
            "input_split_sizes", "every entry must be >= 0", V, ("input_split_sizes", ">= 0"),
            dist_call(lambda c: dist.all_to_all_single(
                torch.zeros(2), torch.zeros(2), [1] * 2, [3, -1]))),
        Row("pg/all_to_all_single/output_split_sizes-length", R, "dist.all_to_all_single",
            "output_split_sizes", "must have world-size entries (or as many as the extended size)", V,
            ("output_split_sizes", "entries"),
            dist_call(lambda c: dist.all_to_all_single(
                torch.zeros(2), torch.zeros(2), [1, 1, 0], [1, 1]))),
        Row("pg/all_to_all_single/input-divisible", R, "dist.all_to_all_single", "input",
            "without splits, dim 0 must be divisible by the world size", V,
            ("input", "dim 0", "divisible"),
            dist_call(lambda c: dist.all_to_all_single(torch.zeros(3), torch.zeros(3)))),
        Row("pg/all_to_all/output_tensor_list-length", R, "dist.all_to_all",
            "output_tensor_list", "must have world-size entries (or as many as the extended size)", V,
            ("output_tensor_list", "entries"),
            dist_call(lambda c: dist.all_to_all([torch.zeros(3)] * (c.world_size + 1),
                                                [torch.zeros(3)] * c.world_size))),
        Row("pg/batch_isend_irecv/peer", R, "dist.batch_isend_irecv", "P2POp.peer (dst)",
            "must be in [0, world size) (the extended size after extend_group_size_to); the batch posts nothing", V, ("dst", "[0, 2)"),
            dist_call(_p2p_batch)),
    ]  # fmt: skip


def _ep_rows() -> list[Row]:
    R = EP
    V = ValueError
    D = "Buffer.dispatch"
    C = "Buffer.combine"
    H = "Buffer.get_ep_buffer_size_hint"
    meta = torch.device("meta")
    return [
        # Buffer(group, num_ep_buffer_bytes)
        Row("ep/buffer/group-type", R, "Buffer", "group",
            "must be a torch.distributed ProcessGroup", V, ("group", "ProcessGroup"),
            new_buffer("world")),
        Row("ep/buffer/num_ep_buffer_bytes-negative", R, "Buffer", "num_ep_buffer_bytes",
            "must be an int >= 0", V, ("num_ep_buffer_bytes", "-1"),
            new_buffer(lambda c: world(c), -1)),
        Row("ep/buffer/num_ep_buffer_bytes-float", R, "Buffer", "num_ep_buffer_bytes",
            "must be an int (not a float or bool)", V, ("num_ep_buffer_bytes", "1.5"),
            new_buffer(lambda c: world(c), 1.5)),
        Row("ep/buffer/num_ep_buffer_bytes-huge", R, "Buffer", "num_ep_buffer_bytes",
            "must be below 2**63", V, ("num_ep_buffer_bytes", "2**63"),
            new_buffer(lambda c: world(c), 2**70)),
        Row("ep/buffer/num_ep_buffer_bytes-disagree", R, "Buffer", "num_ep_buffer_bytes",
            "must be the same on every rank", V, ("num_ep_buffer_bytes", "disagree"),
            new_buffer(lambda c: world(c), lambda c: c.rank << 20)),
        Row("ep/buffer/disable_p2p-type", R, "Buffer", "disable_p2p", "must be a bool", V,
            ("disable_p2p", "bool"), new_buffer(lambda c: world(c), 0, "yes")),
        Row("ep/buffer/device-cpu", R, "Buffer", "device", "must be a CUDA device", V,
            ("device", "CUDA device"), new_buffer(lambda c: world(c), 0, device="cpu")),
        Row("ep/buffer/device-unknown", R, "Buffer", "device", "must name a device", V,
            ("device", "CUDA device"), new_buffer(lambda c: world(c), 0, device="no-such-device")),
        # get_ep_buffer_size_hint
        Row("ep/size_hint/T-below-1", R, H, "num_max_dispatch_tokens_per_rank", "must be >= 1",
            V, ("num_max_dispatch_tokens_per_rank", ">= 1"), size_hint(0, 128, 2, 4)),
        Row("ep/size_hint/hidden-type", R, H, "hidden", "must be an int", V, ("hidden", "int"),
            size_hint(8, "128", 2, 4)),
        Row("ep/size_hint/num_ranks-bool", R, H, "num_ranks", "must be an int (not a bool)", V,
            ("num_ranks", "int"), size_hint(8, 128, True, 4)),
        Row("ep/size_hint/num_experts-divisible", R, H, "num_experts",
            "must be divisible by num_ranks", V, ("num_experts", "divisible"),
            size_hint(8, 128, 4, 6)),
        Row("ep/size_hint/T-huge", R, H, "num_max_dispatch_tokens_per_rank",
            "must be below 2**31", V, ("num_max_dispatch_tokens_per_rank", "2**31"),
            size_hint(2**40, 128, 2, 4)),
        Row("ep/size_hint/shape-too-large", R, H, "(all four)",
            "the workspace must stay below 2**50 bytes", V, ("get_ep_buffer_size_hint", "2^50"),
            size_hint(2**20, 2**20, 1, 2**20)),
        # dispatch
        Row("ep/dispatch/x-dtype", R, D, "x", "must be bfloat16, float16 or float32", V,
            ("x", "int32"), dispatch_with(lambda a, c: {"x": a["x"].to(torch.int32)})),
        Row("ep/dispatch/x-type", R, D, "x", "must be a torch.Tensor", V, ("x", "Tensor"),
            dispatch_with(lambda a, c: {"x": a["x"].tolist()})),
        Row("ep/dispatch/x-ndim", R, D, "x", "must be 2-D [num_tokens, hidden]", V,
            ("x", "2 dimensions"), dispatch_with(lambda a, c: {"x": a["x"][0]})),
        Row("ep/dispatch/x-hidden-0", R, D, "x", "hidden must be >= 1", V, ("x", "hidden size"),
            dispatch_with(lambda a, c: {"x": a["x"][:, :0]})),
        Row("ep/dispatch/x-device", R, D, "x",
            "must be on a device the group has a mooncake backend for", V, ("x", "meta"),
            dispatch_with(lambda a, c: {"x": a["x"].to(meta), "topk_idx": a["topk_idx"].to(meta)})),
        Row("ep/dispatch/x-tokens-over-T", R, D, "x",
            "num_tokens must be <= num_max_dispatch_tokens_per_rank", V,
            ("x", "num_max_dispatch_tokens_per_rank"),
            dispatch_with(lambda a, c: {"num_max_dispatch_tokens_per_rank": 2})),
        Row("ep/dispatch/x-fp8-hidden", R, D, "x",
            "hidden must be a multiple of 128 with use_fp8=True", V, ("x", "128", "use_fp8"),
            dispatch_with(lambda a, c: {"x": a["x"][:, :100].contiguous(), "use_fp8": True})),
        Row("ep/dispatch/topk_idx-dtype", R, D, "topk_idx", "must be int64 or int32", V,
            ("topk_idx", "float32"),
            dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"].float()})),
        Row("ep/dispatch/topk_idx-rows", R, D, "topk_idx",
            "must have one row per token of x, shape [num_tokens, num_topk]", V,
            ("topk_idx", "one row per token"),
            dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"][:-1]})),
        Row("ep/dispatch/topk_idx-ndim", R, D, "topk_idx", "must be 2-D", V,
            ("topk_idx", "2 dimensions"),
            dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"][None]})),
        Row("ep/dispatch/topk_idx-device", R, D, "topk_idx", "must be on x's device", V,
            ("topk_idx", "cpu"), dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"].to(meta)})),
        Row("ep/dispatch/topk_idx-above-E", R, D, "topk_idx",
            "expert ids must be in [0, num_experts) or -1", V, ("topk_idx", "[0, 4)"),
            dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"].clone().fill_(4)})),
        Row("ep/dispatch/topk_idx-below-minus-1", R, D, "topk_idx",
            "expert ids must be >= -1", V, ("topk_idx", "-2"),
            dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"].clone().fill_(-2)})),
        Row("ep/dispatch/topk_idx-over-capacity", R, D, "topk_idx",
            "at most num_max_dispatch_tokens_per_rank rows per expert (a token selects it once)",
            V, ("topk_idx", "twice"), over_capacity),
        Row("ep/dispatch/active_ranks-dtype", R, D, "active_ranks", "must be int32", V,
            ("active_ranks", "int64"),
            dispatch_with(lambda a, c: {"active_ranks": torch.ones(c.world_size,
                                                                   dtype=torch.int64)})),
        Row("ep/dispatch/active_ranks-shape", R, D, "active_ranks", "must have shape [num_ranks]",
            V, ("active_ranks", "shape"),
            dispatch_with(lambda a, c: {"active_ranks": _i32(c.world_size + 1)})),
        Row("ep/dispatch/active_ranks-device", R, D, "active_ranks", "must be on x's device", V,
            ("active_ranks", "cpu"),
            dispatch_with(lambda a, c: {"active_ranks": _i32(c.world_size, device=meta)})),
        Row("ep/dispatch/T-type", R, D, "num_max_dispatch_tokens_per_rank",
            "must be an int >= 1", V, ("num_max_dispatch_tokens_per_rank", "8.0"),
            dispatch_with(lambda a, c: {"num_max_dispatch_tokens_per_rank": 8.0})),
        Row("ep/dispatch/T-huge", R, D, "num_max_dispatch_tokens_per_rank",
            "must be below 2**31", V, ("num_max_dispatch_tokens_per_rank", "2**31"),
            dispatch_with(lambda a, c: {"num_max_dispatch_tokens_per_rank": 2**40})),
        Row("ep/dispatch/num_experts-divisible", R, D, "num_experts",
            "must be divisible by the number of ranks", V, ("num_experts", "divisible"),
            dispatch_with(lambda a, c: {"num_experts": a["num_experts"] + 1})),
        Row("ep/dispatch/num_experts-0", R, D, "num_experts", "must be an int >= 1", V,
            ("num_experts", "got 0"), dispatch_with(lambda a, c: {"num_experts": 0})),
        Row("ep/dispatch/num_experts-huge", R, D, "num_experts", "must be below 2**31", V,
            ("num_experts", "2**31"), dispatch_with(lambda a, c: {"num_experts": 2**40})),
        Row("ep/dispatch/timeout_us-0", R, D, "timeout_us", "must be -1 or an int >= 1", V,
            ("timeout_us", "got 0"), dispatch_with(lambda a, c: {"timeout_us": 0})),
        Row("ep/dispatch/timeout_us-float", R, D, "timeout_us", "must be an int", V,
            ("timeout_us", "1500000.0"), dispatch_with(lambda a, c: {"timeout_us": 1.5e6})),
        Row("ep/dispatch/timeout_us-huge", R, D, "timeout_us",
            "must be at most 2**50 (about 35 years)", V, ("timeout_us", "2**50"),
            dispatch_with(lambda a, c: {"timeout_us": 2**70})),
        Row("ep/dispatch/use_fp8-type", R, D, "use_fp8", "must be a bool", V,
            ("use_fp8", "bool"), dispatch_with(lambda a, c: {"use_fp8": 1})),
        Row("ep/dispatch/async_finish-type", R, D, "async_finish", "must be a bool", V,
            ("async_finish", "bool"), dispatch_with(lambda a, c: {"async_finish": 1})),
        Row("ep/dispatch/async_finish-and-hook", R, D, "async_finish, return_recv_hook",
            "are exclusive", V, ("async_finish", "return_recv_hook", "exclusive"),
            dispatch_with(lambda a, c: {"async_finish": True, "return_recv_hook": True})),
        Row("ep/dispatch/stats-dtype", R, D, "cumulative_local_expert_recv_stats",
            "must be int32", V, ("cumulative_local_expert_recv_stats", "int64"),
            dispatch_with(lambda a, c: {"cumulative_local_expert_recv_stats":
                                        torch.zeros(SMALL.epr, dtype=torch.int64)})),
        Row("ep/dispatch/stats-shape", R, D, "cumulative_local_expert_recv_stats",
            "must have shape [num_experts / num_ranks]", V,
            ("cumulative_local_expert_recv_stats", "shape"),
            dispatch_with(lambda a, c: {"cumulative_local_expert_recv_stats":
                                        _i32(SMALL.epr + 1)})),
        Row("ep/dispatch/workspace-too-small", R, D, "num_max_dispatch_tokens_per_rank",
            "the shape must fit the Buffer's num_ep_buffer_bytes", V,
            ("num_max_dispatch_tokens_per_rank", "num_ep_buffer_bytes", "get_ep_buffer_size_hint"),
            dispatch_with(lambda a, c: {"buf": _small_buffer(c)["small"],
                                        "num_max_dispatch_tokens_per_rank": SMALL.T + 1})),
        # combine
        Row("ep/combine/x-shape", R, C, "x", "must have shape [E/R, R*T, hidden]", V,
            ("x", "shape"), combine_with(lambda a, c: {"x": a["x"][:, :, :-1]})),
        Row("ep/combine/x-dtype", R, C, "x", "must have the dispatch's dtype", V,
            ("x", "bfloat16"), combine_with(lambda a, c: {"x": a["x"].float()})),
        Row("ep/combine/topk_idx-differs", R, C, "topk_idx",
            "must be the one the handle's dispatch routed", V, ("topk_idx", "differs"),
            combine_with(lambda a, c: {"topk_idx": (a["topk_idx"] + 1) % (SMALL.epr * 2)})),
        Row("ep/combine/topk_idx-dtype", R, C, "topk_idx", "must be int64 or int32", V,
            ("topk_idx", "float32"),
            combine_with(lambda a, c: {"topk_idx": a["topk_idx"].float()})),
        Row("ep/combine/topk_weights-dtype", R, C, "topk_weights",
            "must be float32, bfloat16 or float16", V, ("topk_weights", "int64"),
            combine_with(lambda a, c: {"topk_weights": a["topk_weights"].long()})),
        Row("ep/combine/topk_weights-shape", R, C, "topk_weights",
            "must have shape [num_tokens, num_topk]", V, ("topk_weights", "shape"),
            combine_with(lambda a, c: {"topk_weights": a["topk_weights"][:, :1]})),
        Row("ep/combine/topk_weights-device", R, C, "topk_weights", "must be on x's device", V,
            ("topk_weights", "cpu"),
            combine_with(lambda a, c: {"topk_weights": a["topk_weights"].to(meta)})),
        Row("ep/combine/active_ranks-dtype", R, C, "active_ranks", "must be int32", V,
            ("active_ranks", "int64"),
            combine_with(lambda a, c: {"active_ranks": torch.ones(c.world_size,
                                                                  dtype=torch.int64)})),
        Row("ep/combine/active_ranks-shape", R, C, "active_ranks", "must have shape [num_ranks]",
            V, ("active_ranks", "shape"),
            combine_with(lambda a, c: {"active_ranks": _i32(c.world_size + 2)})),
        Row("ep/combine/timeout_us-negative", R, C, "timeout_us", "must be -1 or an int >= 1",
            V, ("timeout_us", "-5"), combine_with(lambda a, c: {"timeout_us": -5})),
        Row("ep/combine/timeout_us-huge", R, C, "timeout_us",
            "must be at most 2**50 (about 35 years)", V, ("timeout_us", "2**50"),
            combine_with(lambda a, c: {"timeout_us": 2**70})),
        Row("ep/combine/handle-none", R, C, "handle", "must be a DispatchHandle", V,
            ("handle", "DispatchHandle"), combine_with(lambda a, c: {"handle": None})),
        Row("ep/combine/handle-tuple", R, C, "handle",
            "must be the DispatchHandle a dispatch returned, or a copy of its items", V,
            ("handle", "tuple"),
            combine_with(lambda a, c: {"handle": (a["handle"][0].clone(), *a["handle"][1:])})),
        Row("ep/combine/handle-other-buffer", R, C, "handle", "must come from this Buffer", V,
            ("handle", "another Buffer"),
            combine_with(lambda a, c: {"handle": _other_buffer(c)["handle"]})),
        Row("ep/combine/handle-unfinished", R, C, "handle",
            "its dispatch must have finished (hook() or event)", V, ("handle", "hook"),
            combine_before_hook),
        Row("ep/combine/handle-stale-zero_copy", R, C, "handle",
            "with zero_copy, its half must not have been reused by two later dispatches", V,
            ("handle", "reused"), combine_stale_zero_copy),
        Row("ep/combine/handle-before-update", R, C, "handle",
            "must come from a dispatch after the latest update_ep_member", V,
            ("handle", "update_ep_member"), combine_with(members_changed)),
        Row("ep/combine/zero_copy-type", R, C, "zero_copy", "must be a bool", V,
            ("zero_copy", "bool"), combine_with(lambda a, c: {"zero_copy": 1})),
        Row("ep/combine/zero_copy-x", R, C, "x",
            "with zero_copy=True, must be get_next_combine_buffer(handle)", V,
            ("x", "zero_copy", "get_next_combine_buffer"),
            combine_with(lambda a, c: {"x": a["x"].clone(), "zero_copy": True})),
        Row("ep/combine/return_recv_hook-type", R, C, "return_recv_hook", "must be a bool", V,
            ("return_recv_hook", "bool"), combine_with(lambda a, c: {"return_recv_hook": "x"})),
        Row("ep/combine/async_finish-and-hook", R, C, "async_finish, return_recv_hook",
            "are exclusive", V, ("async_finish", "return_recv_hook", "exclusive"),
            combine_with(lambda a, c: {"async_finish": True, "return_recv_hook": True})),
        Row("ep/combine/out-shape", R, C, "out", "must have shape [num_tokens, hidden]", V,
            ("out", "shape"),
            combine_with(lambda a, c: {"out": torch.empty(2, SMALL.H, dtype=torch.bfloat16)})),
        Row("ep/combine/out-dtype", R, C, "out", "must have x's dtype", V, ("out", "float32"),
            combine_with(lambda a, c: {"out": torch.empty(3, SMALL.H)})),
        Row("ep/combine/out-device", R, C, "out", "must be on x's device", V, ("out", "cpu"),
            combine_with(lambda a, c: {"out": torch.empty(3, SMALL.H, dtype=torch.bfloat16,
                                                          device=meta)})),
        # get_next_combine_buffer
        Row("ep/next_combine_buffer/handle-none", R, "Buffer.get_next_combine_buffer",
            "handle", "must be a DispatchHandle", V, ("handle", "DispatchHandle"),
            lambda c: ep_buffer(c).get_next_combine_buffer(None)),
        Row("ep/next_combine_buffer/handle-stale", R, "Buffer.get_next_combine_buffer",
            "handle", "its half must not have been reused by two later dispatches", V,
            ("handle", "reused"),
            lambda c: ep_buffer(c).get_next_combine_buffer(stale_handle(c).handle)),
    ]  # fmt: skip


def _elastic_rows() -> list[Row]:
    R = ELASTIC
    V, RE, NI = ValueError, RuntimeError, NotImplementedError
    CE = "Buffer.create_elastic"
    UM = "update_memory_buffers"
    CR, UMB, DR = "connect_ranks", "update_mask_buffer", "disconnect_ranks"
    rows = [
        # create_elastic
        Row("elastic/create/rank-negative", R, CE, "rank", "must be an int >= 0", V,
            ("rank", "got -1"), create_elastic(rank=-1)),
        Row("elastic/create/rank-huge", R, CE, "rank", "must be below 2**31", V,
            ("rank", "2**31"), create_elastic(rank=2**40)),
        Row("elastic/create/tcp_store_group-type", R, CE, "tcp_store_group",
            "must be a torch.distributed.Store or None", V, ("tcp_store_group", "Store"),
            create_elastic(tcp_store_group="127.0.0.1:29500")),
        Row("elastic/create/disable_ll_nvlink-type", R, CE, "disable_ll_nvlink",
            "must be a bool (upstream's first parameter: pass rank= by keyword)", V,
            ("disable_ll_nvlink", "bool", "keyword"), create_elastic(disable_ll_nvlink=0)),
        Row("elastic/create/explicitly_destroy-type", R, CE, "explicitly_destroy",
            "must be a bool", V, ("explicitly_destroy", "bool"),
            create_elastic(explicitly_destroy="yes")),
        Row("elastic/create/timeout_ms-0", R, CE, "timeout_ms", "must be -1 or an int >= 1", V,
            ("timeout_ms", "got 0"), create_elastic(timeout_ms=0)),
        Row("elastic/create/timeout_ms-huge", R, CE, "timeout_ms", "must be below 2**40", V,
            ("timeout_ms", "2**40"), create_elastic(timeout_ms=2**70)),
        Row("elastic/create/metadata_timeout_ms-0", R, CE, "metadata_timeout_ms",
            "must be an int >= 1", V, ("metadata_timeout_ms", "got 0"),
            create_elastic(metadata_timeout_ms=0)),
        Row("elastic/create/metadata_timeout_ms-huge", R, CE, "metadata_timeout_ms",
            "must be below 2**40", V, ("metadata_timeout_ms", "2**40"),
            create_elastic(metadata_timeout_ms=2**70)),
        Row("elastic/create/store_prefix-empty", R, CE, "store_prefix", "must be a non-empty str",
            V, ("store_prefix", "non-empty"), create_elastic(store_prefix="")),
        # set_tcp_store_group
        Row("elastic/set_tcp_store_group/type", R, "set_tcp_store_group", "tcp_store_group",
            "must be a torch.distributed.Store or None", V, ("tcp_store_group", "Store"),
            lambda c: fresh_elastic(c).set_tcp_store_group("127.0.0.1:29500")),
        Row("elastic/set_tcp_store_group/after-allocation", R, "set_tcp_store_group",
            "tcp_store_group", "must stay the same once update_memory_buffers ran", RE,
            ("tcp_store_group", "fixed"),
            lambda c: elastic(c).set_tcp_store_group(dist.HashStore())),
        # update_memory_buffers
        Row("elastic/update_memory_buffers/num_ranks-0", R, UM, "num_ranks",
            "must be an int >= 1", V, ("num_ranks", "got 0"),
            lambda c: fresh_elastic(c).update_memory_buffers(0, EPR)),
        Row("elastic/update_memory_buffers/num_ranks-rank", R, UM, "num_ranks",
            "must be above this buffer's rank", V, ("num_ranks", "rank"),
            lambda c: fresh_elastic(c, 2 + c.rank).update_memory_buffers(2, EPR)),
        Row("elastic/update_memory_buffers/num_ranks-huge", R, UM, "num_ranks",
            "must be below 2**31", V, ("num_ranks", "2**31"),
            lambda c: fresh_elastic(c).update_memory_buffers(2**31, EPR)),
        Row("elastic/update_memory_buffers/num_ranks-grow", R, UM, "num_ranks",
            "must not exceed the allocated capacity (a larger one needs a new Buffer)", V,
            ("num_ranks", "new Buffer"),
            lambda c: elastic(c).update_memory_buffers(CAPACITY + 1, EPR)),
        Row("elastic/update_memory_buffers/num_experts_per_rank-0", R, UM,
            "num_experts_per_rank", "must be an int >= 1", V, ("num_experts_per_rank", "got 0"),
            lambda c: fresh_elastic(c).update_memory_buffers(CAPACITY, 0)),
        Row("elastic/update_memory_buffers/num_experts_per_rank-change", R, UM,
            "num_experts_per_rank", "must stay the allocated one (another needs a new Buffer)",
            V, ("num_experts_per_rank", "new Buffer"),
            lambda c: elastic(c).update_memory_buffers(CAPACITY, EPR + 1)),
        Row("elastic/update_memory_buffers/num_rdma_bytes-negative", R, UM, "num_rdma_bytes",
            "must be an int >= 0", V, ("num_rdma_bytes", "got -1"),
            lambda c: fresh_elastic(c).update_memory_buffers(CAPACITY, EPR, -1)),
        Row("elastic/update_memory_buffers/no-store", R, UM, "tcp_store_group",
            "must have been given (create_elastic or set_tcp_store_group)", RE,
            ("update_memory_buffers", "tcp_store_group"),
            lambda c: fresh_elastic(c, store=False).update_memory_buffers(CAPACITY, EPR)),
        # connect_ranks
        Row("elastic/connect_ranks/before-allocation", R, CR, "(call order)",
            "update_memory_buffers must come first", RE, ("connect_ranks", UM),
            lambda c: fresh_elastic(c).connect_ranks([peer(c)])),
        Row("elastic/connect_ranks/remote_ranks-type", R, CR, "remote_ranks",
            "must be a list of ints", V, ("remote_ranks", "list of ints"),
            lambda c: elastic(c).connect_ranks("1")),
        Row("elastic/connect_ranks/remote_ranks-range", R, CR, "remote_ranks",
            "each must be in [0, capacity)", V, ("rank 4", "capacity"),
            lambda c: elastic(c).connect_ranks([CAPACITY])),
        Row("elastic/connect_ranks/remote_ranks-huge", R, CR, "remote_ranks",
            "each must be in [0, capacity) (also beyond the C int range)", V,
            ("rank 1099511627776", "capacity"), lambda c: elastic(c).connect_ranks([2**40])),
        Row("elastic/connect_ranks/remote_ranks-twice", R, CR, "remote_ranks",
            "must not list a slot twice",
            V, ("rank 2", "twice"),
            lambda c: elastic(c).connect_ranks([disconnected_slot(c)] * 2)),
        Row("elastic/connect_ranks/remote_ranks-connected", R, CR, "remote_ranks",
            "must not be connected already", V, ("rank", "already"),
            lambda c: elastic(c).connect_ranks([peer(c)])),
        Row("elastic/connect_ranks/activate-type", R, CR, "activate", "must be a bool", V,
            ("activate", "bool"),
            lambda c: elastic(c).connect_ranks([disconnected_slot(c)], activate=1)),
        # update_mask_buffer
        Row("elastic/update_mask_buffer/rank_to_mask-type", R, UMB, "rank_to_mask",
            "must be an int", V, ("rank_to_mask", "int"),
            lambda c: elastic(c).update_mask_buffer("1")),
        Row("elastic/update_mask_buffer/rank_to_mask-self", R, UMB, "rank_to_mask",
            "must not be this rank with mask=True", V, ("rank_to_mask", "itself"),
            lambda c: elastic(c).update_mask_buffer(c.rank, mask=True)),
        Row("elastic/update_mask_buffer/rank_to_mask-disconnected", R, UMB, "rank_to_mask",
            "must be a connected slot", V, ("rank 2", "not connected"),
            lambda c: elastic(c).update_mask_buffer(disconnected_slot(c))),
        Row("elastic/update_mask_buffer/rank_to_mask-huge", R, UMB, "rank_to_mask",
            "must be in [0, capacity) (also beyond the C int range)", V, ("rank", "capacity"),
            lambda c: elastic(c).update_mask_buffer(2**40, mask=True)),
        Row("elastic/update_mask_buffer/mask-type", R, UMB, "mask", "must be a bool", V,
            ("mask", "bool"), lambda c: elastic(c).update_mask_buffer(peer(c), mask=0)),
        # disconnect_ranks
        Row("elastic/disconnect_ranks/remote_ranks-type", R, DR, "remote_ranks",
            "must be a list of ints", V, ("remote_ranks", "list of ints"),
            lambda c: elastic(c).disconnect_ranks(peer(c))),
        Row("elastic/disconnect_ranks/remote_ranks-disconnected", R, DR, "remote_ranks",
            "each must be connected", V, ("rank 2", "not connected"),
            lambda c: elastic(c).disconnect_ranks([disconnected_slot(c)])),
        # query_mask_buffer, barrier, slot_state, transport_of
        Row("elastic/query_mask_buffer/mask_status-dtype", R, "query_mask_buffer",
            "mask_status",
            "must be int32", V, ("mask_status", "int64"),
            lambda c: elastic(c).query_mask_buffer(torch.zeros(CAPACITY, dtype=torch.int64))),
        Row("elastic/query_mask_buffer/mask_status-shape", R, "query_mask_buffer",
            "mask_status",
            "must have shape [capacity]", V, ("mask_status", "shape", "[4]"),
            lambda c: elastic(c).query_mask_buffer(_i32(CAPACITY - 1))),
        Row("elastic/query_mask_buffer/mask_status-contiguous", R, "query_mask_buffer",
            "mask_status",
            "must be contiguous", V, ("mask_status", "contiguous"),
            lambda c: elastic(c).query_mask_buffer(_i32(2 * CAPACITY)[::2])),
        Row("elastic/query_mask_buffer/mask_status-device", R, "query_mask_buffer",
            "mask_status",
            "must be a CPU or CUDA tensor", V, ("mask_status", "meta"),
            lambda c: elastic(c).query_mask_buffer(_i32(CAPACITY, device="meta"))),
        Row("elastic/query_mask_buffer/mask_status-type", R, "query_mask_buffer",
            "mask_status",
            "must be a torch.Tensor", V, ("mask_status", "Tensor"),
            lambda c: elastic(c).query_mask_buffer([0] * CAPACITY)),
        Row("elastic/barrier/timeout_ms-0", R, "barrier", "timeout_ms",
            "must be None or an int >= 1", V, ("timeout_ms", "got 0"),
            lambda c: elastic(c).barrier(timeout_ms=0)),
        Row("elastic/barrier/timeout_ms-huge", R, "barrier", "timeout_ms", "must be below 2**40",
            V, ("timeout_ms", "2**40"), lambda c: elastic(c).barrier(timeout_ms=2**70)),
        Row("elastic/slot_state/slot-range", R, "slot_state", "slot",
            "must be an int in [0, capacity)", V, ("slot", "[0, 4)"),
            lambda c: elastic(c).slot_state(CAPACITY)),
        Row("elastic/transport_of/peer-range", R, "transport_of", "peer",
            "must be an int in [0, capacity)", V, ("peer", "[0, 4)"),
            lambda c: elastic(c).transport_of(-1)),
        # dispatch on the elastic buffer (the portable path's rows hold too)
        Row("elastic/dispatch/num_experts-below-bound", R, "Buffer.dispatch (elastic)",
            "num_experts", "must be num_experts_per_rank * R with rank bound <= R <= capacity",
            V, ("num_experts", "rank bound"), elastic_dispatch(EPR * 1)),
        Row("elastic/dispatch/num_experts-multiple", R, "Buffer.dispatch (elastic)",
            "num_experts", "must be a multiple of num_experts_per_rank", V,
            ("num_experts", "num_experts_per_rank"), elastic_dispatch(EPR * 2 + 1)),
        Row("elastic/dispatch/x-device", R, "Buffer.dispatch (elastic)", "x",
            "must be a CPU or CUDA tensor", V, ("x", "meta"),
            lambda c: elastic(c).dispatch(torch.zeros(2, 128, device="meta"),
                                          torch.zeros(2, 1, dtype=torch.int64, device="meta"),
                                          None, 8, EPR * 2, -1, use_fp8=False)),
        # upstream's elastic forms of dispatch and combine
        Row("elastic/dispatch/round_scale-type", R, "Buffer.dispatch (elastic form)",
            "round_scale", "must be a bool", V, ("round_scale", "bool"),
            upstream_dispatch(round_scale=1)),
        Row("elastic/dispatch/round_scale", R, "Buffer.dispatch (elastic form)", "round_scale",
            "True is not implemented (power-of-two scales)", NI, ("round_scale", "False"),
            upstream_dispatch(round_scale=True)),
        Row("elastic/dispatch/dispatch_wait_recv_cost_stats", R,
            "Buffer.dispatch (elastic form)", "dispatch_wait_recv_cost_stats",
            "a tensor is not implemented (pass None)", NI,
            ("dispatch_wait_recv_cost_stats", "None"),
            upstream_dispatch(dispatch_wait_recv_cost_stats=torch.zeros(CAPACITY,
                                                                        dtype=torch.int64))),
        Row("elastic/combine/use_logfmt", R, "Buffer.combine (elastic form)", "use_logfmt",
            "True is not implemented (LogFMT)", NI, ("use_logfmt", "False"),
            upstream_combine(use_logfmt=True)),
        Row("elastic/combine/combine_wait_recv_cost_stats", R, "Buffer.combine (elastic form)",
            "combine_wait_recv_cost_stats", "a tensor is not implemented (pass None)", NI,
            ("combine_wait_recv_cost_stats", "None"),
            upstream_combine(combine_wait_recv_cost_stats=torch.zeros(CAPACITY,
                                                                      dtype=torch.int64))),
        Row("elastic/combine/handle-four", R, "Buffer.combine (elastic form)", "handle",
            "must be the 4-tuple an elastic dispatch returned (or a copy)", V,
            ("handle", "tuple"), upstream_combine()),
        # destroy, and what follows it
        Row("elastic/destroy/explicitly_destroy", R, "destroy", "explicitly_destroy",
            "create_elastic must have had explicitly_destroy=True", RE,
            ("destroy", "explicitly_destroy"), lambda c: elastic(c).destroy()),
        Row("elastic/destroy/twice", R, "destroy", "(call order)", "only once", RE,
            ("destroy", "destroyed"), lambda c: destroyed_elastic(c).destroy()),
        Row("elastic/destroy/then-dispatch", R, "Buffer.dispatch (elastic)", "(call order)",
            "not after destroy", RE, ("dispatch", "destroyed"),
            lambda c: bad_dispatch_of(destroyed_elastic(c))),
        # get_local_buffer_tensor
        Row("elastic/get_local_buffer_tensor/dtype", R, "get_local_buffer_tensor", "dtype",
            "must be a torch.dtype", V, ("dtype", "torch.dtype"),
            lambda c: elastic(c).get_local_buffer_tensor("float32")),
        Row("elastic/get_local_buffer_tensor/use_rdma_buffer", R, "get_local_buffer_tensor",
            "use_rdma_buffer", "must be True (the workspace is the only buffer)", V,
            ("use_rdma_buffer", "True"),
            lambda c: elastic(c).get_local_buffer_tensor(torch.int32, use_rdma_buffer=False)),
        Row("elastic/get_local_buffer_tensor/offset", R, "get_local_buffer_tensor", "offset",
            "must be an int >= 0 and a multiple of the dtype's size", V, ("offset", "multiple"),
            lambda c: elastic(c).get_local_buffer_tensor(torch.int32, offset=2)),
        Row("elastic/get_local_buffer_tensor/size", R, "get_local_buffer_tensor", "size",
            "must be None or a sequence of ints >= 0", V, ("size", "ints"),
            lambda c: elastic(c).get_local_buffer_tensor(torch.int32, size=[2, -1])),
        Row("elastic/get_local_buffer_tensor/no-workspace", R, "get_local_buffer_tensor",
            "num_rdma_bytes", "a device workspace must exist (num_rdma_bytes > 0 with CUDA)", RE,
            ("get_local_buffer_tensor", "workspace", "num_rdma_bytes"),
            lambda c: elastic(c).get_local_buffer_tensor(torch.int32)),
    ]  # fmt: skip
    # The elastic buffer's methods, as Buffer's.
    return [
        r if r.function.startswith("Buffer.") else replace(r, function=f"Buffer.{r.function}")
        for r in rows
    ]


# --- the ElasticBuffer (mooncake.mooncake_elastic_buffer) ----------------------------------------


def ebuf(ctx, **kw):
    """The launch's ElasticBuffer (``ht_cases.get_ebuf``) over the default group."""
    from ht_cases import get_ebuf

    world(ctx)
    return get_ebuf(ctx, **kw)


def new_ebuf(*args, **kwargs):
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    return lambda ctx: ElasticBuffer(
        *[a(ctx) if callable(a) else a for a in args],
        **{k: v(ctx) if callable(v) else v for k, v in kwargs.items()},
    )


def ht_dispatch_with(change: Callable) -> Callable:
    """The launch ElasticBuffer's fresh dispatch with correct arguments (``ht_cases._args``)
    updated with ``change(args, ctx)``."""

    def call(ctx):
        from ht_cases import _args

        buf = ebuf(ctx)
        args = _args(ctx)
        args.update(change(args, ctx))
        buf.dispatch(**args)

    return call


def ht_cached_with(change: Callable) -> Callable:
    """A fresh dispatch, then a cached one along its handle, with ``change`` applied."""

    def call(ctx):
        from ht_cases import _args

        buf = ebuf(ctx)
        args = _args(ctx)
        _, _, _, h, _ = buf.dispatch(**args)
        cached = dict(x=args["x"], topk_weights=args["topk_weights"], handle=h)
        cached.update(change(dict(args, handle=h), ctx))
        buf.dispatch(**cached)

    return call


def ht_combine_with(change: Callable) -> Callable:
    """A fresh dispatch, then its combine with correct arguments updated with ``change``."""

    def call(ctx):
        from ht_cases import _args

        buf = ebuf(ctx)
        recv, _, w, h, _ = buf.dispatch(**_args(ctx))
        args = dict(x=torch.zeros(recv.shape[0], recv.shape[1], dtype=torch.bfloat16), handle=h,
                    topk_weights=w)  # fmt: skip
        args.update(change(args, ctx))
        buf.combine(**args)

    return call


def other_ebuf_handle(ctx):
    """A handle of another ElasticBuffer's dispatch (collective)."""
    from ht_cases import _args

    return ebuf(ctx, deterministic=True).dispatch(**_args(ctx))[3]


def ht_stale_handle(ctx):
    """A cached dispatch along a handle from before update_ep_member (collective)."""
    from ht_cases import _args

    buf = ebuf(ctx)
    args = _args(ctx)
    _, _, _, h, _ = buf.dispatch(**args)
    buf.update_ep_member()
    buf.dispatch(args["x"], handle=h)


def ht_destroyed_dispatch(ctx):
    from ht_cases import _args
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    buf = ElasticBuffer(world(ctx))
    buf.destroy()
    buf.dispatch(**_args(ctx))


def ht_size_hint(*args):
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    return lambda ctx: ElasticBuffer.get_buffer_size_hint(
        *[a(ctx) if callable(a) else a for a in args]
    )


def _i64(*rows):
    return torch.tensor(rows, dtype=torch.int64)


def _ht_rows() -> list[Row]:
    R = HT
    V, RE = ValueError, RuntimeError
    B, D, C = "ElasticBuffer", "ElasticBuffer.dispatch", "ElasticBuffer.combine"
    H = "ElasticBuffer.get_buffer_size_hint"
    meta = torch.device("meta")
    W = lambda c: world(c)  # noqa: E731 - the default group, as the rows call it
    return [
        # ElasticBuffer(group, ...)
        Row("ht/buffer/group-type", R, B, "group", "must be a torch.distributed ProcessGroup",
            V, ("group", "ProcessGroup"), new_ebuf("world")),
        Row("ht/buffer/num_bytes-negative", R, B, "num_bytes", "must be None or an int >= 0", V,
            ("num_bytes", "-1"), new_ebuf(W, -1)),
        Row("ht/buffer/num_max_tokens_per_rank-float", R, B, "num_max_tokens_per_rank",
            "must be an int >= 0", V, ("num_max_tokens_per_rank", "1.5"),
            new_ebuf(W, num_max_tokens_per_rank=1.5)),
        Row("ht/buffer/num_topk-above-32", R, B, "num_topk", "must be an int in [0, 32]", V,
            ("num_topk", "33"), new_ebuf(W, num_topk=33)),
        Row("ht/buffer/sl_idx-range", R, B, "sl_idx", "must be an int in [0, 16)", V,
            ("sl_idx", "2**4"), new_ebuf(W, sl_idx=16)),
        Row("ht/buffer/num_cpu_timeout_secs-zero", R, B, "num_cpu_timeout_secs",
            "must be an int >= 1", V, ("num_cpu_timeout_secs", ">= 1"),
            new_ebuf(W, num_cpu_timeout_secs=0)),
        Row("ht/buffer/deterministic-type", R, B, "deterministic", "must be a bool", V,
            ("deterministic", "bool"), new_ebuf(W, deterministic="yes")),
        Row("ht/buffer/transport-ibgda", R, B, "transport",
            "ibgda cannot be served here; the message names what can", V,
            ("transport", "ibgda", "pg"), new_ebuf(W, transport="ibgda")),
        Row("ht/buffer/transport-nccl", R, B, "transport",
            "nccl cannot be served here; the message names what can", V,
            ("transport", "nccl", "pg"), new_ebuf(W, transport="nccl")),
        Row("ht/buffer/transport-unknown", R, B, "transport",
            "must be auto or pg (upstream's ibgda and nccl are named)", V,
            ("transport", "bogus"), new_ebuf(W, transport="bogus")),
        Row("ht/buffer/transport-type", R, B, "transport", "must be a str", V,
            ("transport", "str"), new_ebuf(W, transport=3)),
        # get_buffer_size_hint
        Row("ht/size_hint/group-type", R, H, "group", "must be a torch.distributed ProcessGroup",
            V, ("group", "ProcessGroup"), ht_size_hint(None, 8, 128)),
        Row("ht/size_hint/T-below-1", R, H, "num_max_tokens_per_rank", "must be an int >= 1", V,
            ("num_max_tokens_per_rank", ">= 1"), ht_size_hint(W, 0, 128)),
        Row("ht/size_hint/hidden-type", R, H, "hidden", "must be an int >= 1", V,
            ("hidden", "int"), ht_size_hint(W, 8, "128")),
        Row("ht/size_hint/num_topk-above-32", R, H, "num_topk", "must be an int in [0, 32]", V,
            ("num_topk", "33"), ht_size_hint(W, 8, 128, 33)),
        # dispatch
        Row("ht/dispatch/x-dtype", R, D, "x",
            "must be bfloat16, float16 or float32 (or a pair (data, scales))", V, ("x", "int32"),
            ht_dispatch_with(lambda a, c: {"x": a["x"].to(torch.int32)})),
        Row("ht/dispatch/x-three-items", R, D, "x", "a tuple must be the pair (data, scales)", V,
            ("x", "pair"), ht_dispatch_with(lambda a, c: {"x": (a["x"],) * 3})),
        Row("ht/dispatch/x-data-dtype", R, D, "x", "a pair's data must be float8", V,
            ("x", "data", "bfloat16"),
            ht_dispatch_with(lambda a, c: {"x": (a["x"], torch.ones(len(a["x"]), 1))})),
        Row("ht/dispatch/x-scales-dtype", R, D, "x", "a pair's scales must be float32 or int32",
            V, ("x", "scales", "float16"),
            ht_dispatch_with(lambda a, c: {"x": (a["x"].to(torch.float8_e4m3fn),
                                                 torch.ones(len(a["x"]), 1).half())})),
        Row("ht/dispatch/x-scales-rows", R, D, "x",
            "a pair's scales must have one row per token of its data", V,
            ("x", "scales", "one row per token"),
            ht_dispatch_with(lambda a, c: {"x": (a["x"].to(torch.float8_e4m3fn),
                                                 torch.ones(len(a["x"]) + 1, 1))})),
        Row("ht/dispatch/x-device", R, D, "x", "must be on cpu or cuda", V, ("x", "meta"),
            ht_dispatch_with(lambda a, c: {"x": a["x"].to(meta)})),
        Row("ht/dispatch/topk_idx-missing", R, D, "topk_idx",
            "must be a tensor without a cached handle", V, ("topk_idx", "Tensor"),
            ht_dispatch_with(lambda a, c: {"topk_idx": None})),
        Row("ht/dispatch/topk_idx-dtype", R, D, "topk_idx", "must be int64 or int32", V,
            ("topk_idx", "float32"),
            ht_dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"].float()})),
        Row("ht/dispatch/topk_idx-rows", R, D, "topk_idx", "must have one row per token of x", V,
            ("topk_idx", "one row per token"),
            ht_dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"][:-1]})),
        Row("ht/dispatch/topk_idx-columns", R, D, "topk_idx", "must have 1 to 32 columns", V,
            ("topk_idx", "32"),
            ht_dispatch_with(lambda a, c: {"topk_idx": torch.full((len(a["x"]), 33), -1)})),
        Row("ht/dispatch/topk_idx-above-E", R, D, "topk_idx",
            "expert ids must be in [0, num_experts) or -1", V, ("topk_idx", "[0, 4)"),
            ht_dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"].clone().fill_(4)})),
        Row("ht/dispatch/topk_idx-twice", R, D, "topk_idx",
            "a token selects each expert at most once", V, ("topk_idx", "twice"),
            ht_dispatch_with(lambda a, c: {"topk_idx": a["topk_idx"].clone().fill_(1)})),
        Row("ht/dispatch/topk_weights-dtype", R, D, "topk_weights", "must be float32", V,
            ("topk_weights", "float16"),
            ht_dispatch_with(lambda a, c: {"topk_weights": a["topk_weights"].half()})),
        Row("ht/dispatch/topk_weights-shape", R, D, "topk_weights",
            "must have topk_idx's shape [num_tokens, num_topk]", V, ("topk_weights", "shape"),
            ht_dispatch_with(lambda a, c: {"topk_weights": a["topk_weights"][:, :1]})),
        Row("ht/dispatch/num_experts-divisible", R, D, "num_experts",
            "must be divisible by the number of ranks", V, ("num_experts", "divisible"),
            ht_dispatch_with(lambda a, c: {"num_experts": 5})),
        Row("ht/dispatch/num_experts-zero", R, D, "num_experts", "must be an int >= 1", V,
            ("num_experts", "[1, 2**31)"), ht_dispatch_with(lambda a, c: {"num_experts": 0})),
        Row("ht/dispatch/T-below-tokens", R, D, "num_max_tokens_per_rank",
            "must be >= x's number of tokens", V, ("x", "num_max_tokens_per_rank"),
            ht_dispatch_with(lambda a, c: {"num_max_tokens_per_rank": 2})),
        Row("ht/dispatch/expert_alignment-zero", R, D, "expert_alignment",
            "must be None or an int >= 1", V, ("expert_alignment", "[1, 2**31)"),
            ht_dispatch_with(lambda a, c: {"expert_alignment": 0})),
        Row("ht/dispatch/do_expand-type", R, D, "do_expand", "must be a bool", V,
            ("do_expand", "bool"), ht_dispatch_with(lambda a, c: {"do_expand": 1})),
        Row("ht/dispatch/do_cpu_sync-type", R, D, "do_cpu_sync", "must be None or a bool", V,
            ("do_cpu_sync", "bool"), ht_dispatch_with(lambda a, c: {"do_cpu_sync": "yes"})),
        Row("ht/dispatch/num_sms-negative", R, D, "num_sms", "must be None or an int >= 0", V,
            ("num_sms", "-1"), ht_dispatch_with(lambda a, c: {"num_sms": -1})),
        Row("ht/dispatch/async-type", R, D, "async_with_compute_stream", "must be a bool", V,
            ("async_with_compute_stream", "bool"),
            ht_dispatch_with(lambda a, c: {"async_with_compute_stream": None})),
        Row("ht/dispatch/handle-type", R, D, "handle",
            "must be None or the EPHandle a dispatch returned", V, ("handle", "EPHandle"),
            ht_dispatch_with(lambda a, c: {"topk_idx": None, "handle": (1, 2)})),
        Row("ht/dispatch/handle-with-topk_idx", R, D, "topk_idx",
            "must be None with a cached handle", V, ("topk_idx", "cached"),
            ht_cached_with(lambda a, c: {"topk_idx": a["topk_idx"]})),
        Row("ht/dispatch/handle-with-cpu-sync", R, D, "do_cpu_sync",
            "must not be True with a cached handle", V, ("do_cpu_sync", "cached"),
            ht_cached_with(lambda a, c: {"do_cpu_sync": True})),
        Row("ht/dispatch/handle-with-expand", R, D, "do_expand",
            "must be False with a cached handle", V, ("do_expand", "cached"),
            ht_cached_with(lambda a, c: {"do_expand": True})),
        Row("ht/dispatch/handle-other-num_experts", R, D, "num_experts",
            "must be None or the cached handle's", V, ("num_experts", "cached"),
            ht_cached_with(lambda a, c: {"num_experts": 2 * a["num_experts"]})),
        Row("ht/dispatch/handle-other-tokens", R, D, "x",
            "must have the cached handle's number of tokens", V, ("x", "cached"),
            ht_cached_with(lambda a, c: {"x": a["x"][:-1], "topk_weights": None})),
        Row("ht/dispatch/handle-stale", R, D, "handle",
            "must be of the current membership generation (not before update_ep_member)", V,
            ("handle", "generation", "update_ep_member"), ht_stale_handle),
        Row("ht/dispatch/after-destroy", R, D, "(call order)", "not after destroy", RE,
            ("dispatch", "destroyed"), ht_destroyed_dispatch),
        # combine
        Row("ht/combine/x-rows", R, C, "x",
            "must have shape [rows, hidden], at most the handle's rows (its received or "
            "expanded rows)", V, ("x", "shape"),
            ht_combine_with(lambda a, c: {"x": torch.cat([a["x"], a["x"][:1]])})),
        Row("ht/combine/x-short", R, C, "x",
            "must have at least the dispatch's valid rows (it may be trimmed to them)", V,
            ("x", "valid rows"),
            ht_combine_with(lambda a, c: {"x": a["x"][:-1], "topk_weights": a["topk_weights"][:-1]})),
        Row("ht/combine/x-dtype", R, C, "x", "must be bfloat16, float16 or float32", V,
            ("x", "int32"), ht_combine_with(lambda a, c: {"x": a["x"].to(torch.int32)})),
        Row("ht/combine/x-device", R, C, "x", "must be on the dispatch's device", V,
            ("x", "meta"), ht_combine_with(lambda a, c: {"x": a["x"].to(meta)})),
        Row("ht/combine/handle-type", R, C, "handle", "must be the EPHandle a dispatch returned",
            V, ("handle", "EPHandle"), ht_combine_with(lambda a, c: {"handle": None})),
        Row("ht/combine/handle-other-buffer", R, C, "handle",
            "must come from this ElasticBuffer's dispatch", V, ("handle", "another"),
            ht_combine_with(lambda a, c: {"handle": other_ebuf_handle(c)})),
        Row("ht/combine/topk_weights-shape", R, C, "topk_weights",
            "must be None or float32 [x's rows, num_topk]", V, ("topk_weights", "shape"),
            ht_combine_with(lambda a, c: {"topk_weights": a["topk_weights"][:, :1]})),
        Row("ht/combine/num_sms-type", R, C, "num_sms", "must be None or an int >= 0", V,
            ("num_sms", "1.5"), ht_combine_with(lambda a, c: {"num_sms": 1.5})),
        # the other methods
        Row("ht/barrier/with_cpu_sync-type", R, "ElasticBuffer.barrier", "with_cpu_sync",
            "must be a bool", V, ("with_cpu_sync", "bool"),
            lambda c: ebuf(c).barrier(with_cpu_sync="yes")),
        Row("ht/get_theoretical_num_sms/num_experts", R, "ElasticBuffer.get_theoretical_num_sms",
            "num_experts", "must be an int >= 1", V, ("num_experts", ">= 1"),
            lambda c: ebuf(c).get_theoretical_num_sms(0, 2)),
    ]  # fmt: skip


ROWS: list[Row] = _pg_rows() + _ep_rows() + _elastic_rows() + _ht_rows()

_INIT = "dist.init_process_group"
assert len({r.id for r in ROWS}) == len(ROWS), "duplicate row ids"
# init rows drop the default group: they must run before anything built on it.
assert all(r.function == _INIT for r in ROWS[: sum(r.function == _INIT for r in ROWS)])


# --- running a row -------------------------------------------------------------------------


def _has(text: str, word: str) -> bool:
    """``word`` in ``text`` as a whole token (case-insensitive)."""
    pattern = r"(?<![A-Za-z0-9_])" + re.escape(word) + r"(?![A-Za-z0-9_])"
    return re.search(pattern, text, re.IGNORECASE) is not None


def _usable(ctx, row: Row, index: int) -> None:
    if row.area == PG:
        if row.function == _INIT:
            ctx.expect(not dist.is_initialized(), "a default group exists after init failed")
        world(ctx)
        healthy(ctx)
        if "ext" in _state:
            n = ctx.world_size
            x = torch.full((5,), float(ctx.rank + 1))
            dist.all_reduce(x, group=_state["ext"])
            ctx.expect_equal(x, torch.full((5,), n * (n + 1) / 2), "all_reduce in the subgroup")
    elif row.area == EP:
        ep_buffer(ctx)
        good_round(ctx, "after")
    elif row.area == HT:
        from ht_cases import good_round as ht_good_round

        ebuf(ctx)
        ht_good_round(ctx, "after")
    else:
        from elastic_round import play_round

        buf = elastic(ctx)
        chk = Checks(ctx.rank, buf.num_ranks, ctx.case)
        _, rec = play_round(chk, buf, 7, ctx.case, index, list(range(ctx.world_size)))
        for f in rec["failures"]:
            ctx.fail(f"elastic round after the error: {f}")


def run_row(ctx, row: Row, index: int) -> None:
    """The bad call raises exactly ``row.exception`` naming ``row.words``; then the group
    or buffer still works."""
    try:
        row.call(ctx)
    except Exception as e:  # noqa: BLE001 - compared with the row below
        text = f"{type(e).__name__}: {e}"
        if type(e) is not row.exception:
            ctx.fail(f"expected {row.exception.__name__} {row.words}, got {text}")
        else:
            missing = [w for w in row.words if not _has(str(e), w)]
            if missing:
                ctx.fail(f"the message does not name {missing}: {text}")
    else:
        ctx.fail(f"expected {row.exception.__name__} {row.words}, nothing was raised")
    _usable(ctx, row, index)


def argument_cases(world_size: int) -> list[Case]:
    return [
        Case(row.id, lambda ctx, row=row, i=i: run_row(ctx, row, i)) for i, row in enumerate(ROWS)
    ]


LAUNCH = Launch(argument_cases, 2, "w2", init_pg=False, op_timeout_s=20.0, timeout_s=240.0)


@pytest.mark.parametrize(("launch", "case"), parametrize([LAUNCH]))
def test_argument_check(launch, case):
    """One row of ROWS on both ranks (``<teardown>``: every rank ended cleanly)."""
    check(launch, case)


# --- the table in the docs -------------------------------------------------------------------

COLUMNS = ("area", "function", "argument", "rule", "exception", "message names", "test id")


def _cells(row: Row) -> tuple[str, ...]:
    cells = (
        row.area,
        f"`{row.function}`",
        f"`{row.argument}`",
        row.rule,
        row.exception.__name__,
        ", ".join(f"`{w}`" for w in row.words),
        f"`{row.id}`",
    )
    assert not any("|" in c for c in cells), row.id
    return cells


def markdown_table() -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in ROWS]
    return "\n".join(lines)


def _doc_rows(text: str) -> list[tuple[str, ...]]:
    """The cells of every row of the table headed by COLUMNS in ``text``."""
    head = "| " + " | ".join(COLUMNS) + " |"
    lines = text.splitlines()
    start = lines.index(head) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(tuple(c.strip() for c in line.strip().strip("|").split(" | ")))
    return rows


def test_doc_table_matches_the_rows():
    """docs/argument-checks.md has exactly ROWS, in order, cell for cell."""
    text = DOC.read_text()
    doc = _doc_rows(text)
    want = [_cells(r) for r in ROWS]
    for i, (got, exp) in enumerate(zip(doc, want, strict=False)):
        assert got == exp, f"row {i + 1} of {DOC.name}:\n  doc:   {got}\n  tests: {exp}"
    assert len(doc) == len(want), f"{DOC.name} has {len(doc)} rows, the tests {len(want)}"


#: Rows whose message does not carry the argument's name, and why.
NOT_NAMED = {
    "pg/join_group/not-extension": "the message names the process group and is_extension",
    "ep/size_hint/shape-too-large": "no single argument is at fault: the four together",
    "elastic/connect_ranks/before-allocation": "a call-order rule, naming the call to make",
    "elastic/destroy/twice": "a call-order rule, naming the call",
    "elastic/destroy/then-dispatch": "a call-order rule, naming the call",
    "ht/dispatch/after-destroy": "a call-order rule, naming the call",
}


def _names_argument(row: Row) -> bool:
    """A word is the argument's name (or part of it); for a list of slots or ranks, the
    message may instead name the element at fault ("rank 3")."""
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", row.argument))
    if names & set(row.words):
        return True
    element = re.compile(r"rank( -?\d+)?")
    lists = {"ranks", "peers", "peer", "remote_ranks", "rank_to_mask"}
    return bool(names & lists) and any(element.fullmatch(w) for w in row.words)


def test_rows_cover_every_area_and_name_their_argument():
    """At least 45 rows, every area has ten or more, each raises ValueError, TypeError or
    RuntimeError (NotImplementedError for upstream options not implemented), and each
    message names the argument (except the rows of NOT_NAMED)."""
    areas = {a: sum(r.area == a for r in ROWS) for a in (PG, EP, ELASTIC, HT)}
    assert len(ROWS) >= 45 and all(n >= 10 for n in areas.values()), areas
    kinds = (ValueError, TypeError, RuntimeError, NotImplementedError)
    assert all(r.exception in kinds for r in ROWS)
    unnamed = {r.id for r in ROWS if not _names_argument(r)}
    assert unnamed == set(NOT_NAMED), unnamed ^ set(NOT_NAMED)


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python tests/python/test_argument_checks.py --markdown")
    print(markdown_table())
