"""ElasticBuffer (high-throughput EP, prefill) against the copy floor, the low-latency
Buffer and upstream's ElasticBuffer.

Per world (``--worlds``: processes of one ``mooncake.launch`` group; on one GPU, run
several under MPS), per ``T`` (``--tokens``, tokens per rank; default 512, 1024 and
4096), H=7168, top-8 of E=256, BF16 and FP8 (``x`` given pre-quantised as ``(data,
scales)``, ``mooncake.fp8.quantize``: one fp32 scale per 128 channels; combine in
BF16). Every rank builds its tokens and routing from seeds (uniform top-k, weights
uniform), so every rank can rebuild every other rank's inputs for the checks.

Measures (each call's time is the slowest process's; a row shows the median and p90):

- ``dispatch``: ``ElasticBuffer.dispatch(x, topk_idx, topk_weights, num_experts=E)``
  (fresh: counts exchange, CPU sync, tokens exchange), two input sets alternating; on
  CUDA, with every process on this host, the device path runs (``src/kernels/ep_ht``:
  layout pass, notify, rows through bounded rings; the table's header says which path
  ran); ``no sync``: the same with ``do_cpu_sync=False`` (worst-case outputs, no host
  wait: the graph-capturable call);
- ``combine``: ``ElasticBuffer.combine(y, handle)``, each timed call after an untimed
  dispatch of its own, ``y`` the received rows as BF16 (identity experts; FP8 rows
  dequantised first, untimed);
- ``floor``: a copy of the bytes the call moves, timed like a call (on CUDA a
  device-to-device ``copy_`` of a uint8 buffer on an idle GPU, as ``bench_ep_device.py``
  measures its floor; on CPU a host ``copy_``); with peers every process copies its own
  bytes at once after a barrier, so the slowest is the floor of the aggregate bytes.
  Dispatch bytes: the payload of each (token, destination rank) pair once (``2H``, or
  ``H + 4H/128`` with FP8; a token goes to a rank once however many of its experts live
  there); combine bytes: ``2H`` per received row, sent back (the indices and weights
  that travel with the rows, under 1% at H=7168, are left out). ``×floor`` = median /
  median floor;
- ``exchange``: ``all_to_all_single`` of exactly those bytes with the call's splits,
  over the same group (on CUDA tensors the CUDA backend's device plane): the transport
  the portable path runs on, without its torch ops, counts exchange and CPU sync;
- ``Buffer``: our low-latency ``Buffer`` at the same T (its device path with
  ``--device cuda``): ``dispatch(x bf16, ..., use_fp8)`` (it quantises itself) and
  ``combine`` of its ``[E/R, R*T, H]`` rows with the weights, timed the same way;
  skipped where its workspace and outputs do not fit a process's share of memory;
- ``upstream``: upstream Mooncake 0.3.14's ElasticBuffer at world 1, from
  ``bench_ep_upstream_elastic.py``'s JSON (``--upstream``);
- memory, ``workspace + outputs``: on CUDA, ``torch.cuda.max_memory_allocated`` above
  the allocation before one fresh dispatch and one combine (outputs, temporaries and,
  with FP8, the BF16 expert rows), plus the workspace: for ElasticBuffer the CUDA
  backend's device segment (``MOONCAKE_CUDA_SEGMENT_BYTES``, default 64 MiB, made with
  the group outside torch's allocator; the portable path reserves nothing else) or, on
  the device path, its workspace (``device_workspace_bytes``: signals and rings, the same
  at every T), for Buffer ``get_ep_buffer_size_hint(T, H, R, E)`` (its device
  workspace). On CPU the
  bytes of the outputs (every tensor returned, the handles' too) instead of the peak,
  and Buffer's hint all the same (its portable path does not reserve it);
- ``cached``: at ``--cached-tokens`` (512), ``dispatch(x, handle=h)`` along the first
  set's routing (one exchange, no counts, no CPU sync) against the fresh dispatch.

Checks (every run, on every rank, against ``tests/python/support/ht_model.py``, a
plain-Python routing model): the received rows bit for bit in the documented order,
``recv_topk_idx``, the weights, the per-rank prefix sums, the cached dispatch's rows,
and combine (per token, its row times the number of ranks holding its experts, exact);
for Buffer, its per-expert counts and its weighted combine (within 1e-2). A failed
check prints ``CHECK FAILED`` and the program exits 1.

    python3 bench/bench_elastic_buffer.py --device cpu --quick      # seconds, small shapes
    python3 bench/bench_elastic_buffer.py --worlds 1,2,4 --quick    # GPU, 10 timed calls
    python3 bench/bench_elastic_buffer.py --upstream up.json        # with upstream's column
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import time

import torch

import harness

SUPPORT = harness.HERE.parent / "tests" / "python" / "support"
GIB = float(1 << 30)
COMBINE_BOUND = 1e-2  # Buffer's combine against sum_k w_k x, relative to the largest value


def ht_model():
    """The plain-Python routing model of the ElasticBuffer tests (it imports nothing)."""
    if str(SUPPORT) not in sys.path:
        sys.path.insert(0, str(SUPPORT))
    import ht_model as model

    return model


# --- inputs and the routing model -------------------------------------------------------


def seed_of(cfg: dict, k: int, rank: int, T: int) -> int:
    return cfg["seed"] + 7919 * T + 1009 * k + rank


def routing_of(cfg: dict, k: int, rank: int, T: int):
    """``topk_idx`` int64 ``[T, K]`` (K distinct experts, uniform) and ``topk_weights``
    float32 ``[T, K]`` of input set ``k`` of ``rank``, on the CPU."""
    g = torch.Generator().manual_seed(seed_of(cfg, k, rank, T))
    idx = torch.rand(T, cfg["E"], generator=g).topk(cfg["K"], dim=1).indices
    return idx, torch.rand(T, cfg["K"], generator=g)


def inputs(cfg: dict, k: int, rank: int, T: int, device: torch.device):
    """Input set ``k`` of ``rank`` at ``T`` on ``device``: ``x`` bf16 ``[T, H]`` and
    :func:`routing_of`'s; the same in every process."""
    idx, w = routing_of(cfg, k, rank, T)
    gx = torch.Generator(device=device).manual_seed(seed_of(cfg, k, rank, T))
    x = torch.randn(T, cfg["H"], generator=gx, device=device).to(torch.bfloat16)
    return x, idx.to(device), w.to(device)


def as_sent(x: torch.Tensor, fp8: bool):
    """What dispatch is given: ``x``, or with FP8 ``mooncake.fp8.quantize(x)``."""
    if not fp8:
        return x
    from mooncake import fp8 as fp8_mod

    return fp8_mod.quantize(x)


def as_bf16(rows) -> torch.Tensor:
    """Received rows as the identity experts return them: BF16 (FP8 dequantised)."""
    if isinstance(rows, tuple):
        from mooncake import fp8 as fp8_mod

        return fp8_mod.dequantize(*rows).to(torch.bfloat16)
    return rows


class Routing:
    """What rank ``me`` must receive and send, by ``ht_model`` (independent of the
    library): ``tokens`` ``(source, token)`` per received row in order, ``local`` their
    local expert ids, ``psum`` the prefix sum per source, ``counts`` per local expert,
    ``sent`` tokens sent to each rank, ``fanout`` per own token the ranks it goes to."""

    def __init__(self, idx_lists: list, R: int, E: int, me: int):
        model = ht_model()
        rec = model.receive(idx_lists, R, E, me, 1, lambda s, d: True)
        self.tokens, self.local, self.counts = rec.tokens, rec.local, rec.counts
        self.per_source, self.psum = rec.per_source, rec.psum_rank()
        self.sent, self.fanout = [0] * R, []
        for row in idx_lists[me]:
            ranks = [t[0] for t in model.combine_terms(row, R, E, lambda d: True, False) if t]
            self.fanout.append(len(ranks))
            for d in ranks:
                self.sent[d] += 1

    def from_source(self, s: int) -> list[int]:
        return [t for src, t in self.tokens if src == s]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (float8 compared as bytes)."""
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def check_rows(recv, rt: Routing, source, weights=None) -> list[str]:
    """``recv`` (rows, or ``(data, scales)``) against the model: per source rank in order,
    its tokens' rows as ``source(s)`` gives them (``(sent x, weights)``); and
    ``weights`` (``recv_topk_weights``) against theirs."""
    data = recv[0] if isinstance(recv, tuple) else recv
    if data.shape[0] != len(rt.tokens):
        return [f"{data.shape[0]} rows received, the model says {len(rt.tokens)}"]
    problems, start = [], 0
    for s in range(len(rt.per_source)):
        ts = rt.from_source(s)
        if not ts:
            continue
        sel = torch.tensor(ts, device=data.device)
        sent, w = source(s)
        end = start + len(ts)
        if isinstance(recv, tuple):
            ok = same(recv[0][start:end], sent[0][sel]) and same(recv[1][start:end], sent[1][sel])
        else:
            ok = same(recv[start:end], sent[sel])
        if not ok:
            problems.append(f"the rows from rank {s} differ from its tokens")
        if weights is not None and not same(weights[start:end], w[sel]):
            problems.append(f"the weights from rank {s} differ from its tokens'")
        start = end
    return problems


def check_dispatch(out, rt: Routing, source) -> list[str]:
    recv, recv_idx, recv_w, handle, _ = out
    problems = check_rows(recv, rt, source, recv_w)
    if recv_idx.tolist() != rt.local:
        problems.append("recv_topk_idx differs from the model's local expert ids")
    if handle.psum_num_recv_tokens_per_scaleup_rank.tolist() != rt.psum:
        problems.append("psum_num_recv_tokens_per_scaleup_rank differs from the model")
    return problems


def check_combine(combined: torch.Tensor, x_sent, rt: Routing) -> list[str]:
    """Identity experts: token t comes back as its BF16 row times the ranks holding its
    experts, summed in fp32 and rounded once: exact."""
    n = torch.tensor(rt.fanout, dtype=torch.float32, device=combined.device).unsqueeze(1)
    want = (as_bf16(x_sent).float() * n).to(torch.bfloat16)
    return [] if same(combined, want) else ["combine differs from the model's sums"]


# --- timing -----------------------------------------------------------------------------


class Clock:
    """Microseconds of one call, started together on every process (a barrier first);
    on CUDA by events on an idle GPU (the device synchronised first), as
    ``bench_ep_device.py`` times: host work, launches and kernels."""

    def __init__(self, cuda: bool, barrier=None):
        self.cuda, self.barrier = cuda, barrier

    def one(self, fn) -> float:
        if self.barrier is not None:
            self.barrier()
        if self.cuda:
            torch.cuda.synchronize()
            return harness.cuda_span_ms(fn) * 1000
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def loop(self, fn, iters: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            self.one(fn)
        return [self.one(fn) for _ in range(iters)]

    def prepared(self, prepare, iters: int, warmup: int) -> list[float]:
        """Each timed call after an untimed ``prepare(i)``, which returns the call."""
        out = []
        for i in range(warmup + iters):
            t = self.one(prepare(i))
            if i >= warmup:
                out.append(t)
        return out


def floors(clock, cfg, nbytes: int, in_splits, out_splits, device) -> tuple[list, list]:
    """A copy of ``nbytes`` and the exchange of ``in_splits`` bytes to each rank
    (``out_splits`` from each), timed like a call."""
    import torch.distributed as dist

    src = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = clock.loop(lambda: dst.copy_(src), cfg["iters"], cfg["warmup"])
    inp = torch.empty(sum(in_splits), dtype=torch.uint8, device=device)
    out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)

    def exchange():
        dist.all_to_all_single(out, inp, list(out_splits), list(in_splits))

    return copy, clock.loop(exchange, cfg["iters"], cfg["warmup"])


# --- memory -----------------------------------------------------------------------------


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of the tensors in ``obj`` (tuples, lists, an object's attributes), each
    storage once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.device)
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o, seen) for o in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(tensor_bytes(o, seen) for o in vars(obj).values())
    return 0


def peak_bytes(cuda: bool, run) -> int:
    """CUDA: the most allocated above the start while ``run()`` ran (what it returns is
    held until then), or the bytes of what it returned where more: outputs from a pool
    allocated before the start (the Buffer's device path keeps one) count too. CPU: the
    bytes of what it returned."""
    if not cuda:
        return tensor_bytes(run())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    kept = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    held = tensor_bytes(kept)
    del kept
    return max(peak, held)


# --- one rank ---------------------------------------------------------------------------


def measure_elastic(eb, cfg, T, fp8, sets, rt, clock, device, problems) -> dict:
    """ElasticBuffer's calls at one (T, dtype); appends failed checks to ``problems``."""
    H, E = cfg["H"], cfg["E"]
    sent = [as_sent(x, fp8) for x, _, _ in sets]
    tag = f"T={T} {'FP8' if fp8 else 'BF16'}"

    def source(k):
        def rows_of(s):
            x, _, w = inputs(cfg, k, s, T, device)
            return as_sent(x, fp8), w

        return rows_of

    def fresh(k):
        return eb.dispatch(
            sent[k], sets[k][1], sets[k][2], num_experts=E, num_max_tokens_per_rank=T
        )

    out = fresh(0)  # checked, and the first (untimed) call
    problems += [f"{tag} dispatch: {p}" for p in check_dispatch(out, rt, source(0))]
    combined = eb.combine(as_bf16(out[0]), out[3])[0]
    problems += [f"{tag} combine: {p}" for p in check_combine(combined, sent[0], rt)]
    handle0 = out[3]
    del out, combined

    row = {"T": T, "fp8": fp8, "path": eb.path, "transport": eb.transport}
    payload = H + 4 * (H // 128) if fp8 else 2 * H
    row["dispatch_bytes"] = sum(rt.sent) * payload
    row["combine_bytes"] = len(rt.tokens) * 2 * H
    turn = itertools.count()
    row["dispatch_us"] = clock.loop(lambda: fresh(next(turn) % 2), cfg["iters"], cfg["warmup"])

    def combine_call(i):
        recv, _, _, handle, _ = fresh(i % 2)
        y = as_bf16(recv)
        return lambda: eb.combine(y, handle)

    row["combine_us"] = clock.prepared(combine_call, cfg["iters"], cfg["warmup"])

    def no_sync(k):
        return eb.dispatch(
            sent[k], sets[k][1], sets[k][2], num_experts=E, num_max_tokens_per_rank=T,
            do_cpu_sync=False,
        )  # fmt: skip

    got = no_sync(0)  # checked: the same rows, at the front of the worst-case outputs
    valid = int(got[3].psum_num_recv_tokens_per_scaleup_rank[-1])
    if valid != len(rt.tokens):
        problems.append(f"{tag} dispatch without CPU sync: {valid} rows, the model says "
                        f"{len(rt.tokens)}")  # fmt: skip
    else:
        head = (got[0][0][:valid], got[0][1][:valid]) if fp8 else got[0][:valid]
        problems += [
            f"{tag} dispatch without CPU sync: {p}" for p in check_rows(head, rt, source(0))
        ]
    del got
    row["dispatch_nosync_us"] = clock.loop(
        lambda: no_sync(next(turn) % 2), cfg["iters"], cfg["warmup"]
    )
    d_in = [n * payload for n in rt.sent]
    d_out = [n * payload for n in rt.per_source]
    row["dispatch_floor_us"], row["dispatch_exchange_us"] = floors(
        clock, cfg, row["dispatch_bytes"], d_in, d_out, device
    )
    c_in = [n * 2 * H for n in rt.per_source]
    c_out = [n * 2 * H for n in rt.sent]
    row["combine_floor_us"], row["combine_exchange_us"] = floors(
        clock, cfg, row["combine_bytes"], c_in, c_out, device
    )

    if T == cfg["cached_T"]:
        # New data (set 1's rows) along set 0's routing: check it, then time it.
        cached = eb.dispatch(sent[1], handle=handle0)
        problems += [f"{tag} cached dispatch: {p}" for p in check_rows(cached[0], rt, source(1))]
        del cached
        row["cached_dispatch_us"] = clock.loop(
            lambda: eb.dispatch(sent[next(turn) % 2], handle=handle0), cfg["iters"], cfg["warmup"]
        )

    def round_trip():
        recv, _, _, handle, _ = fresh(0)
        return recv, handle, eb.combine(as_bf16(recv), handle)

    cuda = device.type == "cuda"
    workspace = eb.device_workspace_bytes if eb.path == "device" else segment_bytes()
    row["memory_bytes"] = peak_bytes(cuda, round_trip) + (workspace if cuda else 0)
    return row


def segment_bytes() -> int:
    """The CUDA backend's device segment, per rank: ``MOONCAKE_CUDA_SEGMENT_BYTES``, or its
    default from the library's registry."""
    from mooncake import pg

    name = "MOONCAKE_CUDA_SEGMENT_BYTES"
    default = {n: d for n, d, _ in pg._ext.env_registry()}[name]
    return int(os.environ.get(name, default))


def buffer_recv_bytes(cfg, T: int, R: int, fp8: bool) -> int:
    """The low-latency Buffer's ``recv_x`` ``[E/R, R*T, H]`` at ``T`` (with FP8 its scales)."""
    H, E = cfg["H"], cfg["E"]
    return (E // R) * R * T * (H + 4 * (H // 128) if fp8 else 2 * H)


def buffer_need(cfg, T: int, R: int, fp8: bool) -> int:
    """What the low-latency Buffer takes at ``T``: its workspace, ``recv_x``, with FP8 the
    BF16 expert rows, the combined tokens, the outputs its pool still holds from the
    dtypes measured before this one at ``T`` (the same Buffer), and 1 GiB to spare."""
    from mooncake.mooncake_ep_buffer import Buffer

    H, E = cfg["H"], cfg["E"]
    rows = (E // R) * R * T
    before = cfg["fp8"][: cfg["fp8"].index(fp8)]
    return (
        Buffer.get_ep_buffer_size_hint(T, H, R, E)
        + buffer_recv_bytes(cfg, T, R, fp8)
        + sum(buffer_recv_bytes(cfg, T, R, f) for f in before)
        + (rows * 2 * H if fp8 else 0)
        + 2 * T * H * 2
        + (1 << 30)
    )


def ll_expert_rows(recv, count: list[int], out=None) -> torch.Tensor:
    """Buffer's received rows as identity experts return them: BF16 ``[E/R, R*T, H]``
    (FP8 dequantised expert by expert, the valid rows only)."""
    if not isinstance(recv, tuple):
        return recv
    from mooncake import fp8 as fp8_mod

    data, scales = recv
    if out is None:
        out = torch.zeros(data.shape, dtype=torch.bfloat16, device=data.device)
    for j, n in enumerate(count):
        out[j, :n] = fp8_mod.dequantize(data[j, :n], scales[j, :n]).to(torch.bfloat16)
    return out


def measure_buffer(buf, cfg, T, fp8, sets, rt, clock, device, problems) -> dict:
    """The low-latency Buffer's dispatch and combine at one (T, dtype)."""
    E = cfg["E"]
    tag = f"T={T} {'FP8' if fp8 else 'BF16'} Buffer"
    active = torch.ones(len(rt.per_source), dtype=torch.int32, device=device)

    def fresh(k):
        return buf.dispatch(sets[k][0], sets[k][1], active, T, E, -1, use_fp8=fp8)

    def combine(y, k, handle):
        return buf.combine(y, sets[k][1], sets[k][2], active, -1, handle)

    recv, count, handle, _, _ = fresh(0)
    counts = count.tolist()
    if counts != rt.counts:
        problems.append(f"{tag} dispatch: recv_count differs from the model's per-expert counts")
    y = ll_expert_rows(recv, counts)
    rows_out = [y] if fp8 else [None]  # FP8: one BF16 [E/R, R*T, H], refilled every call
    combined = combine(y, 0, handle)[0].float()
    x = as_bf16(as_sent(sets[0][0], True)) if fp8 else sets[0][0]
    want = x.float() * sets[0][2].sum(dim=1, keepdim=True)
    err = ((combined - want).abs().max() / want.abs().max()).item()
    if not err <= COMBINE_BOUND:
        problems.append(
            f"{tag} combine: error {err:.2e} against sum_k w_k x (bound {COMBINE_BOUND})"
        )
    del recv, count, handle, combined, y
    row = {"buffer_path": buf.path, "buffer_check_error": err}
    turn = itertools.count()
    row["buffer_dispatch_us"] = clock.loop(
        lambda: fresh(next(turn) % 2), cfg["iters"], cfg["warmup"]
    )

    def combine_call(i):  # after a dispatch of its own, as bench_ep_device.py
        recv, count, handle, _, _ = fresh(i % 2)
        y = ll_expert_rows(recv, count.tolist(), rows_out[0])
        return lambda: combine(y, i % 2, handle)

    row["buffer_combine_us"] = clock.prepared(combine_call, cfg["iters"], cfg["warmup"])
    rows_out.clear()

    def round_trip():
        recv, count, handle, _, _ = fresh(0)
        return recv, handle, combine(ll_expert_rows(recv, count.tolist()), 0, handle)

    cuda = device.type == "cuda"
    row["buffer_memory_bytes"] = peak_bytes(cuda, round_trip) + buf.num_ep_buffer_bytes
    return row


def buffer_share(cfg, R: int) -> int:
    """The bytes one process may give the low-latency Buffer."""
    if cfg["buffer_cap_gib"] > 0:
        return int(cfg["buffer_cap_gib"] * GIB)
    if cfg["device"] != "cuda":
        return 4 << 30
    per_gpu = -(-R // torch.cuda.device_count())
    return int(0.85 * torch.cuda.get_device_properties(0).total_memory / per_gpu)


def member(rank: int, world: int, port: int, cfg: dict) -> dict:
    import torch.distributed as dist

    from mooncake import pg
    from mooncake.launch import init_rank
    from mooncake.mooncake_elastic_buffer import ElasticBuffer
    from mooncake.mooncake_ep_buffer import Buffer

    cuda = cfg["device"] == "cuda"
    init_rank(rank, world, port, "mooncake" if cuda else "mooncake-cpu", timeout_s=300)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    clock = Clock(cuda, (lambda: dist.barrier(group)) if world > 1 else None)
    H, K, E = cfg["H"], cfg["K"], cfg["E"]
    eb = ElasticBuffer(group, num_max_tokens_per_rank=max(cfg["tokens"]), hidden=H, num_topk=K)
    res = {"cases": [], "problems": [], "device": str(device)}
    share = buffer_share(cfg, world)
    paths_before = pg.get_op_paths(group) if cuda else None
    for T in cfg["tokens"]:
        sets = [inputs(cfg, k, rank, T, device) for k in (0, 1)]
        idx_lists = [routing_of(cfg, 0, s, T)[0].tolist() for s in range(world)]
        rt = Routing(idx_lists, world, E, rank)
        need = {fp8: buffer_need(cfg, T, world, fp8) for fp8 in cfg["fp8"]}
        buf = None
        if cfg["buffer"] and min(need.values()) <= share:
            buf = Buffer(group, Buffer.get_ep_buffer_size_hint(T, H, world, E))
        for fp8 in cfg["fp8"]:
            before = eb.device_one_copy
            row = measure_elastic(eb, cfg, T, fp8, sets, rt, clock, device, res["problems"])
            # MOONCAKE_EP_HT_ONE_COPY: (source, channel) reads in place / through the ring
            after = eb.device_one_copy
            row["one_copy"] = after["on"]
            for key in ("dispatch_in_place", "dispatch_ring", "combine_in_place", "combine_ring"):
                row[f"one_copy_{key}"] = after[key] - before[key]
            if not cfg["buffer"]:
                row["buffer_skipped"] = "--no-buffer"
            elif buf is None or need[fp8] > share:
                row["buffer_skipped"] = (
                    f"needs {need[fp8] / GIB:.1f} GiB a process, above its share "
                    f"{share / GIB:.1f} GiB"
                )
            else:
                row.update(
                    measure_buffer(buf, cfg, T, fp8, sets, rt, clock, device, res["problems"])
                )
            res["cases"].append(row)
        del buf, sets
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        after = pg.get_op_paths(group)
        res["op_paths"] = {k: after[k] - paths_before[k] for k in after}
    eb.destroy()
    dist.destroy_process_group()
    return res


# --- the parent: merge, tables, JSON ----------------------------------------------------


def merge(results: list[dict]) -> tuple[list[dict], list[str]]:
    """Per case: every timing list as the slowest process's per call, summarised; sizes
    and memory the largest process's. And every rank's failed checks."""
    stats = {"median": "median", "p90": "p90", "n": "n"}
    rows = []
    for cases in zip(*(r["cases"] for r in results), strict=True):
        row = {}
        for key, value in cases[0].items():
            if isinstance(value, list):
                calls = harness.slowest([c[key] for c in cases])
                row[key] = harness.summarize(calls, stats, digits=1)
                row[key]["calls"] = [round(v, 1) for v in calls]
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                row[key] = max(c[key] for c in cases)
            else:
                row[key] = value
        rows.append(row)
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    return rows, problems


def med(row: dict, key: str):
    return (row.get(key) or {}).get("median")


def fmt_us(row: dict, key: str) -> str:
    s = row.get(key)
    if not s or s.get("median") is None:
        return "-"
    return f"{harness.fmt_fixed(s['median'], 100)} / {harness.fmt_fixed(s['p90'], 100)}"


def mib(n: int) -> str:
    v = n / 2**20
    return f"{v:.2f}" if v < 10 else harness.fmt_fixed(v, 100)


def ratio(a, b) -> str:
    return harness.fmt_ratio(a / b) if a is not None and b else "-"


def upstream_cases(path: str | None) -> dict:
    """bench_ep_upstream_elastic.py's cases by (T, fp8); ``{"error": why}`` without any."""
    data = harness.read_json(path) if path else None
    if data is None:
        return {"error": "not run (bench_ep_upstream_elastic.py, then --upstream its JSON)"}
    cases = {(c["T"], bool(c["fp8"])): c for c in data.get("cases", []) if not c.get("error")}
    if not cases:
        return {"error": (data.get("error") or "no case finished").splitlines()[-1][:160]}
    return cases


def tables(world: int, cfg: dict, rows: list[dict], up: dict) -> list[str]:
    def up_cell(r, key):
        u = up.get((r["T"], r["fp8"])) if world == 1 else None
        s = (u or {}).get(key) or {}
        return harness.fmt_fixed(s.get("median"), 100) if s else "-"

    head = ["T", "dtype", "MiB", "dispatch", "no sync", "floor", "×floor", "exchange", "Buffer"]
    head += ["upstream"]
    head += ["MiB", "combine", "floor", "×floor", "exchange", "Buffer", "upstream"]
    cells = []
    for r in rows:
        cells.append([
            str(r["T"]), "FP8" if r["fp8"] else "BF16", mib(r["dispatch_bytes"]),
            fmt_us(r, "dispatch_us"), fmt_us(r, "dispatch_nosync_us"),
            fmt_us(r, "dispatch_floor_us"),
            ratio(med(r, "dispatch_us"), med(r, "dispatch_floor_us")),
            fmt_us(r, "dispatch_exchange_us"), fmt_us(r, "buffer_dispatch_us"),
            up_cell(r, "dispatch_us"), mib(r["combine_bytes"]),
            fmt_us(r, "combine_us"), fmt_us(r, "combine_floor_us"),
            ratio(med(r, "combine_us"), med(r, "combine_floor_us")),
            fmt_us(r, "combine_exchange_us"), fmt_us(r, "buffer_combine_us"),
            up_cell(r, "combine_us"),
        ])  # fmt: skip
    what = f"H={cfg['H']}, top-{cfg['K']} of E={cfg['E']}"
    paths = (f"ElasticBuffer {rows[0]['path']} ({rows[0].get('transport', '-')}), "
             f"Buffer {rows[0].get('buffer_path', '-')}")  # fmt: skip
    lines = [
        f"world {world}, {cfg['device']}: µs, median / p90 of the slowest process ({what}; "
        f"paths: {paths})"
    ]
    lines += harness.markdown_table(head, cells, "rrrrrrrrrrrrrrrrr")
    if world == 1 and "error" in up:
        lines.append(f"upstream's ElasticBuffer: {up['error']}")
    elif world == 1:
        bad = [f"T={t} {'FP8' if f else 'BF16'}: {c.get('check_dispatch')}, {c.get('check_combine')}"
               for (t, f), c in up.items() if (c.get("check_dispatch"), c.get("check_combine"))
               != ("ok", "ok")]  # fmt: skip
        if bad:
            lines.append(f"upstream's results failed their checks: {'; '.join(bad)}")
    elif world > 1:
        lines.append("upstream's ElasticBuffer: world 1 only")
    mem = []
    for r in rows:
        b = r.get("buffer_memory_bytes")
        mem.append([
            str(r["T"]), "FP8" if r["fp8"] else "BF16", mib(r["memory_bytes"]),
            mib(b) if b else "-", ratio(r["memory_bytes"], b), r.get("buffer_skipped", ""),
        ])  # fmt: skip
    lines += ["", "workspace + outputs, MiB a process (the largest)"]
    lines += harness.markdown_table(
        ["T", "dtype", "ElasticBuffer", "Buffer", "ratio", "Buffer skipped"], mem, "llrrr"
    )
    for r in rows:
        if r.get("one_copy"):
            lines.append(
                f"one copy, T={r['T']} {'FP8' if r['fp8'] else 'BF16'}: (source, channel) "
                f"reads in place / through the ring after an offer (the most of any "
                f"process): dispatch {r['one_copy_dispatch_in_place']} / "
                f"{r['one_copy_dispatch_ring']}, combine {r['one_copy_combine_in_place']} / "
                f"{r['one_copy_combine_ring']}"
            )
    for r in rows:
        if "cached_dispatch_us" in r:
            fresh, cached = med(r, "dispatch_us"), med(r, "cached_dispatch_us")
            lines.append(
                f"cached-handle dispatch, T={r['T']} {'FP8' if r['fp8'] else 'BF16'}: "
                f"{fmt_us(r, 'cached_dispatch_us')} µs against fresh {fmt_us(r, 'dispatch_us')}"
                f" ({(1 - cached / fresh) * 100:.0f}% faster)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = harness.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--worlds", default="1", help="comma-separated process counts")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tokens", default="512,1024,4096", help="comma-separated T (tokens per rank)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--fp8", default="0,1", help="comma-separated: 0 BF16, 1 FP8 (pre-quantised)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per measure")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each measure")
    p.add_argument("--cached-tokens", type=int, default=512, help="T of the cached-handle row")
    p.add_argument("--no-buffer", action="store_true", help="leave out the low-latency Buffer")
    p.add_argument(
        "--buffer-cap-gib", type=float, default=0.0,
        help="most a process gives the Buffer (0: 85%% of the GPU's memory over the processes "
        "on it; 4 GiB on CPU)",
    )  # fmt: skip
    p.add_argument("--upstream", default=None, help="bench_ep_upstream_elastic.py's JSON")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--launch-timeout", type=float, default=560.0, help="seconds per world")
    harness.add_output_args(
        p, "10 timed calls, 2 warm-up; on CPU also small shapes (T=64,128, H=512, E=32)"
    )
    harness.add_if_gpu(p)
    a = p.parse_args(argv)
    if a.quick:
        a.iters, a.warmup = min(a.iters, 10), min(a.warmup, 2)
        if a.device == "cpu":
            a.tokens, a.hidden, a.experts, a.cached_tokens = "64,128", 512, 32, 64
            a.iters = min(a.iters, 5)
    if a.device == "cuda":
        status = harness.no_gpu_status("bench_elastic_buffer", a.if_gpu)
        if status is not None:
            return status
    worlds = harness.csv_ints(a.worlds)
    if any(a.experts % w for w in worlds) or a.hidden % 128:
        p.error(f"--experts ({a.experts}) must be divisible by every world in --worlds and "
                f"--hidden ({a.hidden}) by 128")  # fmt: skip
    from mooncake.launch import run_local

    started, load = time.time(), os.getloadavg()
    tokens = harness.csv_ints(a.tokens)
    cfg = {
        "device": a.device, "tokens": tokens, "H": a.hidden, "K": a.topk, "E": a.experts,
        "fp8": [bool(int(f)) for f in a.fp8.split(",")], "iters": a.iters,
        "warmup": a.warmup, "cached_T": a.cached_tokens if a.cached_tokens in tokens else tokens[0],
        "buffer": not a.no_buffer, "buffer_cap_gib": a.buffer_cap_gib, "seed": a.seed,
    }  # fmt: skip
    harness.say_host(f"bench_elastic_buffer ({a.device})", os.cpu_count() or 1, load)
    up = upstream_cases(a.upstream) if a.device == "cuda" else {"error": "needs CUDA"}
    env = {"OMP_NUM_THREADS": "1"} if a.device == "cpu" else {}
    out = {"worlds": {}, "upstream": a.upstream}
    if a.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    failed, text = False, []

    def save() -> str:  # after every world, so that a run stopped later keeps what it did
        out["meta"] = harness.run_meta(started, os.cpu_count() or 1, load, a)
        files = {"elastic_buffer.json": out, "elastic_buffer_table.md": "\n".join(text)}
        return harness.write_outputs(a.out_dir, files)

    for world in worlds:
        t0 = time.monotonic()
        try:
            results = run_local(member, world, args=(cfg,), env=env, timeout_s=a.launch_timeout)
        except RuntimeError as e:
            harness.say(f"world {world}: FAILED: {str(e)[-2000:]}")
            out["worlds"][world] = {"error": str(e)}
            text.append(f"world {world}: FAILED (see elastic_buffer.json)")
            failed = True
            save()
            continue
        rows, problems = merge(results)
        lines = tables(world, cfg, rows, up)
        if problems:
            failed = True
            lines += [f"CHECK FAILED: {p}" for p in problems]
        else:
            lines.append(f"checks: every result matched the routing model ({len(rows)} cases)")
        paths = results[0].get("op_paths")
        if paths is not None:
            lines.append(f"rank 0's CUDA collectives: {paths['device']} on the device plane, "
                         f"{paths['staged']} staged through the host")  # fmt: skip
        lines.append(f"(world {world}: {time.monotonic() - t0:.0f} s)")
        harness.say("\n".join(lines) + "\n")
        text += lines + [""]
        out["worlds"][world] = {"cases": rows, "problems": problems, "op_paths": paths}
        harness.say(save())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
