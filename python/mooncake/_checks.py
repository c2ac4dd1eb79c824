"""Argument rules of mooncake's Python API, written once for every caller.

The process-group helpers (``pg``), the EP Buffer's constructors and both of
its paths (portable and device), and the high-throughput ElasticBuffer, check
their arguments here, so that a rule and its message exist in one place
(``docs/argument-checks.md`` lists them with their tests).

Two kinds of function: ``*_error`` returns the message of the first rule
broken (None when there is none), for callers that must do something before
they raise (a portable-path rank that rejects its call still takes part in the
exchange); ``*_arg`` / ``int_list`` raise ValueError themselves. Messages do
not carry the calling method's name; the caller puts it in front.

Rules that read tensor *values* (the expert ids in ``topk_idx``, whether
combine's ``topk_idx`` is the dispatch's) copy them to the host, which waits
for the device: ``dispatch_error``/``combine_error`` skip them with
``values=False``, as the device path does (its kernels check the ids, and the
rank's next call raises what they found).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import torch

from ._loader import load_extension
from .ep.types import DispatchHandle

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int64, torch.int32)
#: Bound of the arguments the C++ core takes as C ints (slots, capacities, shapes ``T`` and
#: ``E``).
MAX_INT = 2**31
#: The longest EP deadline in microseconds (about 35 years; ``-1`` means none): a longer
#: one would overflow the nanosecond clocks the exchanges compute deadlines with.
MAX_TIMEOUT_US = 2**50
#: The same bound for the elastic Buffer's deadlines, in milliseconds.
MAX_TIMEOUT_MS = 2**40


# --- scalars and lists ------------------------------------------------------------------


def is_int(v) -> bool:
    """An integer that is not a bool: Python's, or any other that registers as
    ``numbers.Integral`` (numpy's, which engines read out of configs and arrays), as
    upstream's bindings take them."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def plain(v):
    """``v`` as a Python int where it is another kind of integer (numpy's); else ``v``
    itself, for the rules to judge. Entry points pass their int arguments through it,
    so that what they keep and hand on is a plain int."""
    return v if type(v) is int or not is_int(v) else int(v)


def is_int64(v) -> bool:
    """An int (not a bool) that fits the backend's int64 arguments."""
    return is_int(v) and -(2**63) <= v < 2**63


def int_arg(what: str, name: str, v, low: int, high: int = MAX_INT) -> int:
    """``v`` when it is an int in ``[low, high)``; else ValueError naming ``name``."""
    if not is_int(v) or not low <= v < high:
        raise ValueError(
            f"{what}: {name} must be an int >= {low} and below 2**{high.bit_length() - 1}, "
            f"got {v!r}"
        )
    return int(v)


def int_list(what: str, name: str, v) -> list[int]:
    """``v`` as a list of ints that fit an int64: a list, a tuple, a tensor or any other
    iterable but a string; else ValueError naming ``name``."""
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        raise ValueError(f"{what}: {name} must be a list of ints, got {v!r}")
    v = list(v)
    if not all(is_int64(r) for r in v):
        raise ValueError(f"{what}: {name} must be a list of ints, got {v!r}")
    return [int(r) for r in v]


def timeout_error(timeout_us) -> str | None:
    """The rule of an EP call's ``timeout_us``."""
    if is_int(timeout_us) and (timeout_us == -1 or 0 < timeout_us <= MAX_TIMEOUT_US):
        return None
    return f"timeout_us must be -1 (no deadline) or an int in [1, 2**50], got {timeout_us!r}"


def flags_error(**flags) -> str | None:
    """The first of ``flags`` (name=value) that is not a bool, or None."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            return f"{name} must be a bool, got {v!r}"
    return None


def _shape_error(name: str, v) -> str | None:
    """The rule of a shape argument (``T``, ``E``) that the core takes as a C int."""
    if is_int(v) and 1 <= v < MAX_INT:
        return None
    return f"{name} must be an int in [1, 2**31), got {v!r}"


def _exclusive_error(async_finish, return_recv_hook) -> str | None:
    if async_finish and return_recv_hook:
        return "async_finish and return_recv_hook are exclusive: set one of them"
    return None


# --- tensors ----------------------------------------------------------------------------


def tensor_error(name, t, dtypes, ndim, device=None, shape=None) -> str | None:
    """The first rule a tensor argument breaks, or None."""
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        return f"{name} must be {want}, got {str(t.dtype).replace('torch.', '')}"
    if t.dim() != ndim:
        return f"{name} must have {ndim} dimensions, got shape {list(t.shape)}"
    if shape is not None and list(t.shape) != list(shape):
        return f"{name} must have shape {list(shape)}, got {list(t.shape)}"
    if device is not None and t.device != device:
        return f"{name} must be on {device} (where x is), got {t.device}"
    return None


def _active_ranks_error(active_ranks, device, num_ranks: int) -> str | None:
    """The rule of an EP call's ``active_ranks`` (None: the members' own view)."""
    if active_ranks is None:
        return None
    return tensor_error("active_ranks", active_ranks, (torch.int32,), 1, device, [num_ranks])


# --- the EP Buffer ----------------------------------------------------------------------


def size_hint_args(**shape) -> None:
    """The rules of ``Buffer.get_ep_buffer_size_hint``'s arguments that the layout does
    not check itself (it takes C ints)."""
    for name, v in shape.items():
        if not is_int(v):
            raise ValueError(f"get_ep_buffer_size_hint: {name} must be an int, got {v!r}")
        if not -MAX_INT < v < MAX_INT:
            raise ValueError(f"get_ep_buffer_size_hint: {name} must be below 2**31, got {v}")


def _workspace_error(have: int, max_tokens: int, hidden: int, R: int, E: int) -> str | None:
    """Whether a dispatch of this shape fits ``have`` workspace bytes (0: no workspace,
    nothing to fit)."""
    if not have:
        return None
    need = load_extension().ep_layout(max_tokens, hidden, R, E)["total_bytes"]
    if need <= have:
        return None
    return (
        f"num_max_dispatch_tokens_per_rank={max_tokens}, hidden={hidden}, "
        f"num_experts={E} need {need} workspace bytes, but this Buffer has "
        f"num_ep_buffer_bytes={have} (see Buffer.get_ep_buffer_size_hint)"
    )


def dispatch_error(
    members,
    workspace_bytes: int,
    x,
    topk_idx,
    active_ranks,
    max_tokens,
    num_experts,
    timeout_us,
    use_fp8,
    stats,
    async_finish,
    return_recv_hook,
    *,
    values: bool,
    path_device: torch.device | None = None,
) -> str | None:
    """The first rule a dispatch's arguments break, or None.

    ``members`` says how many ranks the call covers and which devices and expert
    counts they take (``ep.group.GroupMembers`` or ``ep.elastic.Slots``); ``x`` on
    ``path_device`` is moved by the calling path itself (the device path's
    workspace device), not by the members' exchange. ``values=False`` skips the
    rules on ``topk_idx``'s values.
    """
    R = members.call_ranks(num_experts)
    err = tensor_error("x", x, FLOAT_DTYPES, 2)
    if err:
        return err
    n, h = x.shape
    err = (
        (None if x.device == path_device else members.device_error(x.device))
        or tensor_error("topk_idx", topk_idx, INDEX_DTYPES, 2, x.device)
        or _shape_error("num_max_dispatch_tokens_per_rank", max_tokens)
        or _shape_error("num_experts", num_experts)
        or timeout_error(timeout_us)
        or flags_error(
            use_fp8=use_fp8, async_finish=async_finish, return_recv_hook=return_recv_hook
        )
        or _exclusive_error(async_finish, return_recv_hook)
        or _active_ranks_error(active_ranks, x.device, R)
    )
    if err:
        return err
    if topk_idx.shape[0] != n:
        return f"topk_idx must have one row per token of x ({n}), got shape {list(topk_idx.shape)}"
    err = members.experts_error(num_experts)
    if err:
        return err
    if n > max_tokens:
        return f"x has {n} tokens, more than num_max_dispatch_tokens_per_rank ({max_tokens})"
    if h < 1:
        return f"x must have a hidden size >= 1, got {h}"
    if use_fp8 and h % 128:
        return f"x's hidden size ({h}) must be a multiple of 128 with use_fp8=True"
    if values and topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            return f"topk_idx holds expert {bad}; ids must be in [0, {num_experts}) or -1"
        # Each expert's rows from one source must fit its T slots.
        per_expert = torch.bincount(topk_idx[topk_idx >= 0].long(), minlength=num_experts)
        most = int(per_expert.max()) if per_expert.numel() else 0
        if most > max_tokens:
            e = int(per_expert.argmax())
            return (
                f"topk_idx sends {most} tokens to expert {e}, more than "
                f"num_max_dispatch_tokens_per_rank ({max_tokens}): a token selects it twice"
            )
    if stats is not None:
        err = tensor_error(
            "cumulative_local_expert_recv_stats",
            stats,
            (torch.int32,),
            1,
            x.device,
            [num_experts // R],
        )
        if err:
            return err
    return _workspace_error(workspace_bytes, max_tokens, h, R, num_experts)


def handle_error(handle, buffer_id: int, members: int) -> str | None:
    """Whether ``handle`` is a finished dispatch's handle of the Buffer ``buffer_id``
    whose membership is still ``members`` (its count of ``update_ep_member`` calls)."""
    state = handle.state if isinstance(handle, DispatchHandle) else None
    if state is None:
        return (
            f"handle must be the DispatchHandle a dispatch returned (or a copy of its five "
            f"items, or of the elastic form's four, while its half is the dispatch's), got "
            f"{type(handle).__name__}"
        )
    if state.buffer != buffer_id:
        return "handle comes from another Buffer's dispatch"
    if state.members != members:
        # Its rows came from, and would go back to, the members before the change.
        return "handle's dispatch ran before update_ep_member changed the members: dispatch again"
    if not state.finished:
        return (
            "handle's dispatch has not finished: call its hook() or "
            "event.current_stream_wait() first"
        )
    return None


def half_error(handle: DispatchHandle, seq: int) -> str | None:
    """Whether the Buffer's later dispatches (the latest is ``seq``) reused the half of
    the workspace that ``handle``'s dispatch wrote."""
    if seq - handle.state.seq >= 2:
        return (
            f"handle is from dispatch #{handle.state.seq}, but dispatch #{seq} has since "
            f"reused its half of the buffer"
        )
    return None


def zero_copy_error(x, handle: DispatchHandle, combine_buffers) -> str | None:
    """Whether ``x`` is the zero-copy combine buffer of ``handle``'s half."""
    buf = combine_buffers[handle.state.seq % 2]
    if buf is None or x.data_ptr() != buf.data_ptr():
        return "with zero_copy=True, x must be get_next_combine_buffer(handle)"
    return None


def combine_error(
    buffer_id: int,
    seq: int,
    combine_buffers,
    x,
    topk_idx,
    topk_weights,
    active_ranks,
    timeout_us,
    handle,
    zero_copy,
    async_finish,
    return_recv_hook,
    out,
    *,
    members: int,
    values: bool,
) -> str | None:
    """The first rule a combine's arguments break, or None.

    ``buffer_id``, ``seq`` and ``combine_buffers``: the Buffer's id, its latest
    dispatch's number and its zero-copy buffers; ``members``: its membership, as
    :func:`handle_error`. ``values=False`` skips comparing
    ``topk_idx`` with the dispatch's.
    """
    err = handle_error(handle, buffer_id, members)
    if err:
        return err
    state = handle.state
    epr, cols = handle.src_info.shape
    device = handle.src_info.device
    n, k = state.topk_idx.shape
    err = (
        tensor_error("x", x, (state.dtype,), 3, device, [epr, cols, handle.hidden])
        or tensor_error("topk_idx", topk_idx, INDEX_DTYPES, 2, device, [n, k])
        or tensor_error("topk_weights", topk_weights, FLOAT_DTYPES, 2, device, [n, k])
        or _active_ranks_error(active_ranks, device, handle.layout_range.shape[1])
        or timeout_error(timeout_us)
        or flags_error(
            zero_copy=zero_copy, async_finish=async_finish, return_recv_hook=return_recv_hook
        )
        or _exclusive_error(async_finish, return_recv_hook)
    )
    if err:
        return err
    if values and not torch.equal(topk_idx, state.topk_idx.to(topk_idx.dtype)):
        return "topk_idx differs from the one that handle's dispatch routed"
    if out is not None:
        err = tensor_error("out", out, (x.dtype,), 2, device, [n, handle.hidden])
        if err:
            return err
    if zero_copy:
        return half_error(handle, seq) or zero_copy_error(x, handle, combine_buffers)
    return None


# --- the ElasticBuffer (high-throughput regime, mooncake.mooncake_elastic_buffer) -------------

#: The dtypes of pre-quantised data, and of its scale factors (fp32, or packed 4-byte words).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPES = (torch.float32, torch.int32)
#: The most top-k selections a token may have (upstream's kernels give a warp lane to each).
MAX_TOPK = 32
#: The transports an ElasticBuffer can run over here; upstream's others are refused by name.
SERVED_TRANSPORTS = ("auto", "pg")
UPSTREAM_TRANSPORTS = ("ibgda", "nccl")
#: The longest timeout in seconds (its microseconds stay below MAX_TIMEOUT_US).
MAX_TIMEOUT_SECS = 2**30


def transport_arg(transport) -> str:
    """The transport an ElasticBuffer runs over for the request ``transport``; ValueError
    naming what can be served when it cannot."""
    if not isinstance(transport, str):
        raise ValueError(f"ElasticBuffer: transport must be a str, got {transport!r}")
    want = transport.strip().lower()
    served = ", ".join(repr(t) for t in SERVED_TRANSPORTS)
    if want in UPSTREAM_TRANSPORTS:
        raise ValueError(
            f"ElasticBuffer: transport {want!r} cannot be served here (no GPU-initiated RDMA "
            f"and no NCCL device API in this build); it can serve {served}: the process "
            f"group's exchange"
        )
    if want not in SERVED_TRANSPORTS:
        raise ValueError(
            f"ElasticBuffer: transport must be one of {served} (or upstream's "
            f"{', '.join(repr(t) for t in UPSTREAM_TRANSPORTS)}, which cannot be served "
            f"here), got {transport!r}"
        )
    return "pg"


def throughput_buffer_args(**args) -> None:
    """The rules of ``ElasticBuffer(...)``'s arguments but ``group`` and ``transport``."""
    what = "ElasticBuffer"
    num_bytes = args.pop("num_bytes")
    if num_bytes is not None and not (is_int(num_bytes) and 0 <= num_bytes < 2**63):
        raise ValueError(
            f"{what}: num_bytes must be None or an int in [0, 2**63), got {num_bytes!r}"
        )
    for name in ("num_max_tokens_per_rank", "hidden", "num_allocated_qps"):
        int_arg(what, name, args.pop(name), 0)
    num_topk = args.pop("num_topk")
    if not (is_int(num_topk) and 0 <= num_topk <= MAX_TOPK):
        raise ValueError(f"{what}: num_topk must be an int in [0, {MAX_TOPK}], got {num_topk!r}")
    int_arg(what, "sl_idx", args.pop("sl_idx"), 0, 16)
    for name in ("num_cpu_timeout_secs", "num_gpu_timeout_secs"):
        int_arg(what, name, args.pop(name), 1, MAX_TIMEOUT_SECS)
    err = flags_error(**args)
    if err:
        raise ValueError(f"{what}: {err}")


def throughput_x(x) -> tuple[str | None, torch.Tensor | None, torch.Tensor | None]:
    """``(error, data, scales)`` of a dispatch's ``x``: a tensor, or (data, scales)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            return f"x must be a tensor or a pair (data, scales), got {len(x)} items", None, None
        data, scales = x
        err = tensor_error("x[0] (data)", data, FP8_DTYPES, 2) or tensor_error(
            "x[1] (scales)", scales, SCALE_DTYPES, 2, data.device
        )
        if err:
            return err, None, None
        if scales.shape[0] != data.shape[0] or scales.shape[1] < 1:
            return (
                f"x[1] (scales) must have shape [num_tokens, packs >= 1] with one row per token "
                f"of x[0] ({data.shape[0]}), got {list(scales.shape)}",
                None,
                None,
            )
    else:
        data, scales = x, None
        err = tensor_error("x", data, FLOAT_DTYPES, 2)
        if err:
            return err, None, None
    if data.shape[1] < 1:
        return f"x must have a hidden size >= 1, got {data.shape[1]}", None, None
    if data.device.type not in ("cpu", "cuda"):
        return f"x must be on cpu or cuda, got {data.device}", None, None
    return None, data, scales


def _optional_int(name: str, v, low: int) -> str | None:
    if v is None or (is_int(v) and low <= v < MAX_INT):
        return None
    return f"{name} must be None or an int in [{low}, 2**31), got {v!r}"


def throughput_handle_error(handle, buffer_id: int, generation: int) -> str | None:
    """Whether ``handle`` is a dispatch's EPHandle of this ElasticBuffer, from its current
    membership generation."""
    from .ep.throughput_handle import EPHandle

    plan = handle.native_handle if isinstance(handle, EPHandle) else None
    if plan is None:
        return f"handle must be the EPHandle a dispatch returned, got {type(handle).__name__}"
    if plan.buffer != buffer_id:
        return "handle comes from another ElasticBuffer's dispatch"
    if plan.generation != generation:
        return (
            f"handle is from membership generation {plan.generation} of this ElasticBuffer, "
            f"but update_ep_member() has since changed its members (generation {generation}): "
            f"dispatch again for a new handle"
        )
    return None


def throughput_dispatch_error(
    num_ranks: int, data, scales, topk_idx, topk_weights, num_experts, max_tokens, alignment,
    handle, do_expand, do_cpu_sync, num_sms, async_with_compute_stream, buffer_id: int,
    generation: int, *, values: bool,
) -> str | None:  # fmt: skip
    """The first rule an ElasticBuffer dispatch's arguments break, or None.

    ``data``/``scales``: ``x`` as :func:`throughput_x` split it (checked there);
    ``num_experts``, ``max_tokens`` and ``alignment`` with their defaults filled in where
    there are any (None where not). ``values=False`` skips the rules on ``topk_idx``'s
    values.
    """
    n = data.shape[0]
    err = (
        flags_error(do_expand=do_expand, async_with_compute_stream=async_with_compute_stream)
        or (None if do_cpu_sync is None else flags_error(do_cpu_sync=do_cpu_sync))
        or _optional_int("num_sms", num_sms, 0)
        or _optional_int("expert_alignment", alignment, 1)
    )
    if err:
        return err
    if handle is not None:
        err = throughput_handle_error(handle, buffer_id, generation)
        if err:
            return err
        plan = handle.native_handle
        if topk_idx is not None:
            return "topk_idx must be None with a cached handle (the handle's routing serves)"
        if do_cpu_sync:
            return "do_cpu_sync must not be True with a cached handle (the layout is known)"
        if do_expand or handle.do_expand:
            return "do_expand: a cached handle serves only dispatches without expanding"
        for name, v, have in (
            ("num_experts", num_experts, handle.num_experts),
            ("num_max_tokens_per_rank", max_tokens, handle.num_max_tokens_per_rank),
            ("expert_alignment", alignment, handle.expert_alignment),
        ):
            if v is not None and v != have:
                return f"{name} ({v}) must be None or the cached handle's ({have})"
        if n != plan.num_tokens or data.device != plan.device:
            return (
                f"x must have the cached handle's {plan.num_tokens} tokens on {plan.device}, "
                f"got {n} on {data.device}"
            )
        k = plan.num_topk
    else:
        err = tensor_error("topk_idx", topk_idx, INDEX_DTYPES, 2, data.device)
        if err:
            return err
        if topk_idx.shape[0] != n:
            return (
                f"topk_idx must have one row per token of x ({n}), got shape {list(topk_idx.shape)}"
            )
        k = topk_idx.shape[1]
        if not 1 <= k <= MAX_TOPK:
            return f"topk_idx must have between 1 and {MAX_TOPK} columns (num_topk), got {k}"
        if num_experts is None:
            return "num_experts must be given: topk_idx selects no expert to infer it from"
        err = _shape_error("num_experts", num_experts) or _shape_error(
            "num_max_tokens_per_rank", max_tokens
        )
        if err:
            return err
        if num_experts % num_ranks:
            return (
                f"num_experts ({num_experts}) must be divisible by the number of ranks "
                f"({num_ranks})"
            )
        if n > max_tokens:
            return f"x has {n} tokens, more than num_max_tokens_per_rank ({max_tokens})"
    if topk_weights is not None:
        err = tensor_error("topk_weights", topk_weights, (torch.float32,), 2, data.device, [n, k])
        if err:
            return err
    if values and handle is None and topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            return f"topk_idx holds expert {bad}; ids must be in [0, {num_experts}) or -1"
        ids = topk_idx.long().sort(1).values
        twice = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)
        if bool(twice.any()):
            t = int(twice.any(1).nonzero()[0, 0])
            return f"topk_idx selects an expert twice in token {t}: {topk_idx[t].tolist()}"
    return None


def throughput_combine_error(x, handle, topk_weights, num_sms, async_with_compute_stream,
                             buffer_id: int, generation: int) -> str | None:  # fmt: skip
    """The first rule an ElasticBuffer combine's arguments break, or None."""
    err = throughput_handle_error(handle, buffer_id, generation)
    if err:
        return err
    plan = handle.native_handle
    rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
    err = (
        tensor_error("x", x, FLOAT_DTYPES, 2)
        or _optional_int("num_sms", num_sms, 0)
        or flags_error(async_with_compute_stream=async_with_compute_stream)
    )
    if err:
        return err
    if x.device != plan.device:
        return f"x must be on the dispatch's device ({plan.device}), got {x.device}"
    if x.shape[0] > rows or x.shape[1] < 1:
        what = "expanded rows" if handle.do_expand else "received tokens"
        return (
            f"x must have shape [rows, hidden >= 1] with at most {rows} rows (the handle's "
            f"{what}; it may be trimmed to the valid ones), got {list(x.shape)}"
        )
    if topk_weights is not None:
        n = x.shape[0]
        shape = [n] if handle.do_expand else [n, plan.num_topk]
        return tensor_error(
            "topk_weights", topk_weights, (torch.float32,), len(shape), x.device, shape
        )
    return None
