"""The ElasticBuffer's device path: dispatch and combine as CUDA kernels over workspaces
that every member maps (``src/kernels/ep_ht``, driven through the extension's
``EpHtDevice``), for CUDA tensors when every member runs on this host.

A member's tokens are cut into C channels (contiguous token ranges; the same C on every
rank). Per channel, a fresh dispatch runs a layout pass (each token's place among those
its rank sends each destination), a notify exchange (every pair of ranks tells each other
how many tokens it sends, whether it counts the other in, and its call's shape), then the
data: a sender block stages each token that goes to another rank once in its own ring,
and the receivers pull the rows meant for them straight into ``recv_x``; a rank's own
rows go from ``x`` to ``recv_x`` directly (at world 1 that is all there is). A combine
pulls each rank's returned rows through a ring per (source, channel) and sums each token's
rows slot by slot in fp32, rounding once. The rings' size does not depend on ``T``.

Results are the portable path's, bit for bit (``throughput_portable``): rows in the same
order, the same ``recv_topk_idx``, weights and handle fields, the same combine order.

Differences, because a check would need a host sync or another exchange:

* ``topk_idx`` values are checked in the kernels: a bad expert id is dropped and a token
  selecting an expert twice is reported; with ``do_cpu_sync`` this call raises ValueError
  after its sync, otherwise the next call on this rank does.
* A rank whose arguments break a rule raises ValueError without taking part: in a fresh
  dispatch it tells the others (they go on without its tokens); in a cached dispatch or a
  combine the others mask it when their deadline passes.
* A rank that fails while its rows stream in is dropped by each receiver that misses some
  of its rows (the rows after it move up, as the portable path's); a receiver that got
  all of them keeps them. A rank that fails during a combine: tokens already summed keep
  its rows, later ones do not.
"""

from __future__ import annotations

import hashlib
import os
import warnings
import zlib
from dataclasses import dataclass

import torch

from .. import _checks, pg
from ..errors import LeftOutError
from .throughput_handle import EPHandle
from .throughput_portable import fresh_defaults, padded_rows
from .types import NO_WAIT, tensor_key

#: Ring slots the workspace is sized for at the first call's hidden size (a call of
#: wider rows, fp32 combines for one, gets fewer; below the kernels' minimum it runs on
#: the portable path).
SLOTS = 72


def available() -> bool:
    """Whether this build has the device path (a CUDA build of the extension)."""
    return hasattr(pg._ext, "EpHtDevice")


def _env_int(name: str) -> int:
    default = {n: d for n, d, _ in pg._ext.env_registry()}[name]
    return int(os.environ.get(name) or default)


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def ring_bytes(R: int, C: int, H: int, K: int) -> int:
    """The rings' bytes for :data:`SLOTS` rows of a hidden size ``H`` (BF16), top-``K``
    routing and weights: the larger of a dispatch's ``C`` stage rings (16-byte header,
    ids, places, ranks and weights, data, FP8 scales) and a combine's ``R * C`` reply
    rings (weights, data). None at world 1: every row is this rank's own."""
    if R == 1:
        return 0
    stage = 16 + 4 * _align16(4 * K) + _align16(2 * H) + _align16(4 * -(-H // 128))
    reply = _align16(4 * K) + _align16(2 * H)
    return max(C * SLOTS * stage, R * C * SLOTS * reply)


@dataclass(slots=True, eq=False)
class DevicePlan:
    """A device-path dispatch's routing, kept by its handle (``EPHandle.native_handle``):
    the fields the argument checks read, and the kernels' plan (``native``)."""

    buffer: int
    generation: int
    seq: int
    device: torch.device
    num_ranks: int
    num_experts: int
    num_topk: int
    max_tokens: int
    num_tokens: int
    rows_allocated: int  # rows of recv_x without expanding (M, or R*T without CPU sync)
    expanded_allocated: int
    native: object  # the extension's HtPlan

    @property
    def exchange_device(self) -> torch.device:
        return self.device


def _not_served(rank: int, step: str, e: Exception) -> None:
    """Says why this rank cannot serve the device path (every member then takes the
    portable one)."""
    warnings.warn(
        f"mooncake ElasticBuffer: rank {rank}: the device path failed {step} "
        f"({type(e).__name__}: {e}); dispatch and combine take the portable path",
        RuntimeWarning,
        3,
    )


def connect(buf, data: torch.Tensor, num_topk: int, host_key: int) -> ThroughputDevice | None:
    """The device path of ``buf`` for tensors on ``data``'s device, or None where it cannot
    serve every member (a build or member without it, another host, a mapping that fails).

    Collective: every present member calls it (at its first dispatch of CUDA tensors), and
    all reach the same answer. The channels and the rings' size are agreed first (each
    member's share of its GPU's multiprocessors, halved for the two roles, the smallest;
    rings for the largest ``hidden``/``num_topk`` among the constructors' and this call's),
    then the workspaces are made and mapped, then the members confirm that each mapped
    all.
    """
    members = buf._members
    R, me = members.num_ranks, members.rank
    device = data.device
    # A failure on this rank alone (the GPU query, the workspace's allocation, a mapping)
    # is told to the others in the next exchange, never by leaving it: every member takes
    # part in each, and all fall back to the portable path together.
    willing = (
        available()
        and _env_int("MOONCAKE_EP_FORCE_FALLBACK") == 0
        and R <= pg._ext.EP_HT_MAX_RANKS
        and device.type == "cuda"
        and data.dim() == 2  # (the argument checks refuse other shapes)
    )
    row = [0] * 5
    if willing:
        try:
            bus, sms = pg._ext.ep_ht_gpu(device.index)
        except Exception as e:
            _not_served(me, "reading the GPU's properties", e)
        else:
            gpu = hashlib.blake2b(f"{host_key}|{bus}".encode(), digest_size=7).digest()
            # rings for the constructor's hidden size and top-k, or this first call's if larger
            H, K = max(data.shape[1], buf.hidden), max(num_topk, buf.num_topk)
            row = [1, sms, int.from_bytes(gpu, "little"), H, K]
    rows = members.all_gather(torch.tensor(row, dtype=torch.int64)).reshape(R, 5).tolist()
    present = members.present(R).tolist()
    live = [r for r in range(R) if present[r]]
    if not all(rows[r][0] for r in live):
        return None

    def agree(ok: bool) -> bool:  # every live member's ok, each taking part
        oks = members.all_gather(torch.tensor([int(ok)], dtype=torch.int64)).tolist()
        return all(oks[r] for r in live)

    def share(r: int) -> int:  # rank r's share of its GPU's multiprocessors
        sharers = sum(1 for q in live if rows[q][2] == rows[r][2])
        return max(1, rows[r][1] // sharers)

    channels = min(max(1, share(r) // 2) if R > 1 else share(r) for r in live)
    channels = min(channels, pg._ext.EP_HT_MAX_CHANNELS)
    # Every member's rings the same size (slots are found by their number): the largest.
    H, K = max(rows[r][3] for r in live), max(rows[r][4] for r in live)
    ext = None
    try:
        ext = pg._ext.EpHtDevice(R, me, channels, ring_bytes(R, channels, H, K), device.index)
    except Exception as e:
        _not_served(me, "making the workspace", e)
    if not agree(ext is not None):
        return None
    own = ext.card()
    card = torch.frombuffer(bytearray(own), dtype=torch.uint8).clone()
    cards = members.all_gather(card).reshape(R, card.numel())
    mapped = False
    try:
        reachable, _, _ = ext.connect([bytes(c.tolist()) for c in cards])
        mapped = all(reachable[r] for r in live)
    except Exception as e:
        _not_served(me, "mapping the peers' workspaces", e)
    if not agree(mapped):
        return None
    # The group's transport tells the kernels of a peer it sees lost (they stop waiting).
    members.watch_lost(ext)
    return ThroughputDevice(members, device, ext, channels, share(me))


class ThroughputDevice:
    """Dispatch and combine on the device for one ElasticBuffer (``buf`` in the calls:
    its mask, call numbers, generation and timeouts)."""

    name = "device"
    transport = "cuda_ipc"

    def __init__(self, members, device: torch.device, ext, channels: int, max_blocks: int):
        self.members, self.device, self.ext = members, device, ext
        self.R, self.rank = members.num_ranks, members.rank
        self.channels = channels
        # The largest grid: every block of a launch resident at once, beside the other
        # processes on this GPU.
        self.max_blocks = max(2 if self.R > 1 else 1, max_blocks)
        self._mask_dev: torch.Tensor | None = None
        self._mask_host: torch.Tensor | None = None
        self._min_slots = pg._ext.EP_HT_MIN_SLOTS
        # The checks look at shapes only: a call shaped like the last good one passes
        # them too (they cost more host time than the launches).
        self._checked: tuple | None = None
        self._view: tuple = (None, None)  # (the group's view version, present ranks)
        # Reads the group's view version (pg._view_version_reader; False: the group has
        # no backend of ours).
        self._version = None
        # What the last fold of the view (_settle) and the last mask (_mask) were made
        # from: the buffer's mask tensor, its change count (and the view's version).
        self._folded: tuple = (None, None, None)
        self._masked: tuple = (None, None)
        self._sig: tuple = (None, 0)  # the last call's shape, and its signature

    @property
    def workspace_bytes(self) -> int:
        return self.ext.bytes

    # --- which calls run here -------------------------------------------------------------

    def takes(self, data, scales, topk_idx, topk_weights, num_experts, do_expand) -> bool:
        """Whether a fresh dispatch of these arguments runs here: CUDA rows on this
        device that the kernels copy in 16-byte pieces, and rings wide enough for them.
        A call that breaks a rule is taken too (the rules are checked here, alike)."""
        if not (isinstance(data, torch.Tensor) and data.is_cuda and data.device == self.device):
            return False
        if data.dim() != 2 or (data.shape[1] * data.element_size()) % 16 or data.shape[1] % 8:
            return False
        if scales is not None and (not isinstance(scales, torch.Tensor) or scales.dim() != 2):
            return False
        if _checks.is_int(num_experts) and (
            num_experts > pg._ext.EP_HT_MAX_EXPERTS
            or num_experts // self.R > pg._ext.EP_HT_MAX_LOCAL_EXPERTS
        ):
            return False
        if self.R == 1 or not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            return True
        K = topk_idx.shape[1]
        if not 1 <= K <= _checks.MAX_TOPK:
            return True
        data_bytes = data.shape[1] * data.element_size()
        scale_bytes = 0 if scales is None else scales.shape[1] * scales.element_size()
        weights = topk_weights is not None
        stage = self.ext.dispatch_slots(K, weights, bool(do_expand), data_bytes, scale_bytes)
        # The combine of its rows (up to fp32) must fit as well.
        reply = self.ext.combine_slots(K, weights, 4 * data.shape[1])
        return min(stage, reply) >= self._min_slots

    # --- per call ----------------------------------------------------------------------

    def _blocks(self, num_sms) -> int:
        """The grid: ``num_sms`` where given (at least 2 with peers: one sends, one
        receives), at most this process's share of the GPU."""
        if not num_sms:
            return self.max_blocks
        return max(2 if self.R > 1 else 1, min(int(num_sms), self.max_blocks))

    @staticmethod
    def _ns(us: int) -> int:
        return min(us * 1000, 2**62)

    def _present(self) -> torch.Tensor:
        """bool [R] on the CPU: the ranks the group counts present (read again only when
        its view changes; ``_view[0]`` is None where the group cannot say when)."""
        if self._version is None:  # looked up once: a lookup costs more than a call's launches
            try:
                self._version = pg._view_version_reader(pg._backend_of(self.members.group))
            except (AttributeError, RuntimeError, ValueError):  # a group without our backend
                self._version = False
        version = self._version() if self._version else None
        if version is None:
            self._view = (None, self.members.present(self.R))
        elif self._view[0] != version:
            self._view = (version, self.members.present(self.R))
        return self._view[1]

    def _settle(self, buf) -> None:
        """Takes what the kernels masked (host-mapped words: no sync), and the group's
        view, into the buffer's mask (a fold only when either changed)."""
        masked = self.ext.take_masked()
        for r, why in masked:
            buf._active[r] = False
            how = "lost (its process gone, or silent past MOONCAKE_HANG_MS)" if why == 2 else (
                "silent past the deadline of a wait"
            )  # fmt: skip
            self.members.device_masked(r, f"rank {r} masked: {how}")
        present = self._present()
        active, changes, version = self._folded
        if (masked or self._view[0] is None or active is not buf._active
                or changes != buf._active_changes or version != self._view[0]):  # fmt: skip
            buf._active &= present
            buf._active_changes += 1
            self._folded = (buf._active, buf._active_changes, self._view[0])

    def _before(self, buf, what: str) -> None:
        """Before a call: an earlier kernel's report raises here (ValueError for bad
        ``topk_idx`` values or calls of different shapes, RuntimeError for corrupt data);
        a rank the group left out gets LeftOutError."""
        self._settle(buf)
        code = self.ext.status_code()
        if code == pg._ext.EP_STATUS_SILENT_PEER:
            self.ext.status(clear=True)
        elif code:
            self.ext.raise_reported(what)
        if not bool(self._present()[self.rank]):
            raise LeftOutError(
                f"{what}: the other ranks left rank {self.rank} out of the group; a new process "
                f"for it can join (pg.join_group) while they call pg.recover_ranks",
                [self.rank],
            )

    def _mask(self, buf) -> torch.Tensor:
        """The kernels' mask (device int32 [R]): the members that take part. The kernels
        clear entries themselves, so the host only ever clears entries too (a rank that
        comes back is a new connection: update_ep_member)."""
        active, changes = self._masked
        if self._mask_dev is not None and active is buf._active and changes == buf._active_changes:
            return self._mask_dev  # the buffer's mask is as it was at the last call
        want = buf._active.clone()
        if self._mask_dev is None:
            self._mask_dev = want.to(torch.int32).to(self.device)
            self._mask_host = want
        elif not torch.equal(want & self._mask_host, self._mask_host):
            self._mask_dev.mul_(want.to(torch.int32).to(self.device))
            self._mask_host = want & self._mask_host
        self._masked = (buf._active, buf._active_changes)
        return self._mask_dev

    def _next_seq(self, buf) -> int:
        buf._seq += 1
        return buf._seq

    @staticmethod
    def _rows(t: torch.Tensor) -> torch.Tensor:
        """``t`` as rows the kernels copy in 16-byte pieces: dense rows, 16-byte aligned
        (a strided view of such rows stays a view; a copy only when needed)."""
        ok = (t.shape[0] == 0 or t.stride(1) == 1) and (t.stride(0) * t.element_size()) % 16 == 0
        if ok and t.data_ptr() % 16 == 0:
            return t
        t = t.contiguous()
        return t if t.data_ptr() % 16 == 0 else t.clone()

    @staticmethod
    def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` contiguous and 16-byte aligned (a copy only when needed)."""
        if t is None:
            return None
        t = t.contiguous()
        return t if t.data_ptr() % 16 == 0 else t.clone()

    # --- dispatch ----------------------------------------------------------------------

    def dispatch_call(self, buf, x, topk_idx, topk_weights, num_experts, max_tokens,
                      alignment, handle, do_expand, do_cpu_sync, num_sms,
                      async_with_compute_stream):  # fmt: skip
        """``buf.dispatch`` on this path."""
        try:
            self._before(buf, "dispatch")
        except LeftOutError:
            raise
        except (ValueError, RuntimeError):
            # An earlier call's report: this call takes no part (a fresh one tells the
            # others, which go on without it), and its number stays in step with theirs.
            seq = self._next_seq(buf)
            if handle is None:
                self._reject(buf, seq)
            raise
        R = self.R
        error, data, scales = _checks.throughput_x(x)
        if handle is not None:
            if error is None:
                error = _checks.throughput_dispatch_error(
                    R, data, scales, topk_idx, topk_weights, num_experts, max_tokens,
                    alignment, handle, do_expand, do_cpu_sync, num_sms,
                    async_with_compute_stream, buf._id, buf._generation, values=False,
                )  # fmt: skip
            seq = self._next_seq(buf)
            if error:
                raise ValueError(f"dispatch: {error}")
            return self._cached(buf, data, scales, topk_weights, handle, num_sms, seq)
        if error is None:
            num_experts, max_tokens, alignment, do_cpu_sync = fresh_defaults(
                buf, data, topk_idx, num_experts, max_tokens, alignment, do_cpu_sync
            )
            key = (
                tensor_key(data), tensor_key(scales), tensor_key(topk_idx),
                tensor_key(topk_weights), num_experts, max_tokens, alignment, do_expand,
                do_cpu_sync, num_sms, async_with_compute_stream, buf._generation,
            )  # fmt: skip
            if key != self._checked:
                error = _checks.throughput_dispatch_error(
                    R, data, scales, topk_idx, topk_weights, num_experts, max_tokens,
                    alignment, None, do_expand, do_cpu_sync, num_sms,
                    async_with_compute_stream, buf._id, buf._generation, values=False,
                )  # fmt: skip
                if error is None:
                    self._checked = key
        if error is None and num_experts // R > pg._ext.EP_HT_MAX_LOCAL_EXPERTS:
            error = (
                f"num_experts / ranks ({num_experts // R}) must be at most "
                f"{pg._ext.EP_HT_MAX_LOCAL_EXPERTS} on the device path"
            )
        seq = self._next_seq(buf)
        if error:
            self._reject(buf, seq)
            raise ValueError(f"dispatch: {error}")
        return self._fresh(buf, data, scales, topk_idx, topk_weights, num_experts, max_tokens,
                           alignment, do_expand, do_cpu_sync, num_sms, seq)  # fmt: skip

    def _reject(self, buf, seq: int) -> None:
        """A fresh dispatch this rank rejected: its notify tells every peer that it takes
        no part (they go on without its tokens, and do not wait for it)."""
        none = torch.zeros(self.R, dtype=torch.int32, device=self.device)
        topk = torch.empty(0, 1, dtype=torch.int64, device=self.device)
        self.ext.layout(topk, none, 1, self.R, 1, False, 0, seq,
                        self._ns(buf._cpu_timeout_us), 1)  # fmt: skip

    def _signature(self, T, E, K, data, scales, weights, expand, alignment) -> int:
        """The call's shape as 31 bits (the notify record carries it)."""
        shape = (T, E, K, data.shape[1] * data.element_size(), str(data.dtype),
                 0 if scales is None else scales.shape[1] * scales.element_size(),
                 weights is not None, bool(expand), alignment,
                 self.ext.one_copy())  # every rank alike: MOONCAKE_EP_HT_ONE_COPY  # fmt: skip
        if shape != self._sig[0]:  # calls of one shape in a row: hashed once
            self._sig = (shape, zlib.crc32(repr(shape).encode()) & 0x7FFFFFFF)
        return self._sig[1]

    def _fresh(self, buf, data, scales, topk_idx, topk_weights, E, T, alignment, do_expand,
               do_cpu_sync, num_sms, seq):  # fmt: skip
        R = self.R
        K, N = topk_idx.shape[1], data.shape[0]
        epr = E // R
        active = self._mask(buf)
        blocks = self._blocks(num_sms)
        data, scales, weights = self._rows(data), self._dense(scales), self._dense(topk_weights)
        sig = self._signature(T, E, K, data, scales, weights, do_expand, alignment)
        # The plan holds its own copy of topk_idx (the handle's), made in the layout call.
        plan = self.ext.layout(topk_idx.contiguous(), active, T, E, alignment, bool(do_expand),
                               sig, seq, self._ns(buf._cpu_timeout_us), blocks)  # fmt: skip
        topk = plan.topk
        rows, expanded = R * T, 0
        padded_list: list[int] = []
        if do_cpu_sync and R > 1:
            # Exact sizes from the layout pass's counts (a sync before the data moves):
            # the worst case, R * T rows, is R times the memory at prefill sizes.
            rows, expanded = self.ext.plan_head(plan, 2)
            expanded = expanded if do_expand else 0
        elif do_cpu_sync:
            # Alone, the worst case is this rank's own N tokens (the exact sizes when
            # each selects an expert; expanded, plus the alignment padding): the dispatch
            # goes out without waiting for the layout pass, and the one sync after it
            # trims the outputs (the rows past the valid ones are neither written nor
            # zeroed).
            rows = N
            expanded = padded_rows(N, K, epr, alignment) if do_expand else 0
        elif do_expand:
            expanded = padded_rows(rows, K, epr, alignment)
        recv_x, recv_sf, recv_idx, recv_w = self.ext.dispatch(
            plan, data, scales, weights, active, rows, expanded, False, bool(do_cpu_sync), seq,
            self._ns(buf._gpu_timeout_us), blocks,
        )  # fmt: skip
        metadata = plan.metadata
        if do_cpu_sync:
            # The counts as the kernels left them (a receiver may have dropped a source
            # that failed while its rows streamed in): outputs trimmed to them.
            # (one pinned copy and a stream sync: a tensor's .cpu() and .tolist() are
            # several torch ops, a good part of a small call's host time)
            head = self.ext.plan_head(plan, 4 + epr)
            rows, padded_list = head[0], head[4:]
            expanded = head[1] if do_expand else 0
            self._settle(buf)
            code = self.ext.status_code()
            if code and code != pg._ext.EP_STATUS_SILENT_PEER:
                self.ext.raise_reported("dispatch")
            # (one call: a slice from Python is a torch op each; the absent outputs,
            # empty, are left as they are)
            end = expanded if do_expand else rows
            recv_x, recv_sf, recv_idx, recv_w, metadata = pg._ext.ep_ht_trim(
                [recv_x, recv_sf, recv_idx, recv_w, metadata],
                [end, end if scales is not None else -1, rows,
                 end if weights is not None else -1, rows],
            )  # fmt: skip
        else:
            self._settle(buf)
        dplan = DevicePlan(
            buf._id, buf._generation, seq, data.device, R, E, K, T, N, rows, expanded, plan
        )
        handle = EPHandle(
            bool(do_expand), E, alignment, T, num_sms or 0, topk, padded_list, plan.psum_rank,
            plan.psum_expert, metadata, plan.dst_slot, None, None, dplan, buf._generation,
            num_expanded_tokens=expanded if do_expand else 0,
            num_unaligned_recv_tokens_per_expert=plan.unaligned,
        )  # fmt: skip
        recv = (recv_x, recv_sf) if scales is not None else recv_x
        return recv, recv_idx, (recv_w if weights is not None else None), handle, NO_WAIT

    def _cached(self, buf, data, scales, topk_weights, handle, num_sms, seq):
        """Along a handle's plan: one launch, no layout pass, no CPU sync. Rows of a
        source that fails during it read as zero rows with ``recv_topk_idx`` -1."""
        plan: DevicePlan = handle.native_handle
        active = self._mask(buf)
        blocks = self._blocks(num_sms)
        data, scales, weights = self._rows(data), self._dense(scales), self._dense(topk_weights)
        recv_x, recv_sf, recv_idx, recv_w = self.ext.dispatch(
            plan.native, data, scales, weights, active, plan.rows_allocated, 0, True, False, seq,
            self._ns(buf._gpu_timeout_us), blocks,
        )  # fmt: skip
        self._settle(buf)
        recv = (recv_x, recv_sf) if scales is not None else recv_x
        return recv, recv_idx, (recv_w if weights is not None else None), handle, NO_WAIT

    # --- combine -----------------------------------------------------------------------

    def combine_call(self, buf, x, handle, topk_weights, num_sms, async_with_compute_stream):
        """``buf.combine`` for a handle of this path."""
        try:
            self._before(buf, "combine")
        except LeftOutError:
            raise
        except (ValueError, RuntimeError):
            self._next_seq(buf)  # in step with the others, which mask this rank
            raise
        error = _checks.throughput_combine_error(
            x, handle, topk_weights, num_sms, async_with_compute_stream, buf._id,
            buf._generation,
        )  # fmt: skip
        if error is None and (x.shape[1] * x.element_size()) % 16:
            error = (
                f"x's rows ({x.shape[1]} x {x.element_size()} bytes) must be a multiple of 16 "
                f"bytes on the device path"
            )
        if error is None and self.R > 1:
            # The rings were sized for the dispatch's rows up to fp32 (takes()): wider
            # rows, or weights the dispatch did not have, may not fit them.
            K, wide = handle.native_handle.num_topk, x.shape[1] * x.element_size()
            if self.ext.combine_slots(K, topk_weights is not None, wide) < self._min_slots:
                error = (
                    f"x's rows ({x.shape[1]} x {x.element_size()} bytes"
                    f"{', with topk_weights' if topk_weights is not None else ''}) do not fit "
                    f"the device path's rings, made for the dispatch's rows up to float32"
                )
        seq = self._next_seq(buf)
        if error:
            raise ValueError(f"combine: {error}")
        plan: DevicePlan = handle.native_handle
        single = bool(handle.do_expand and not buf.allow_multiple_reduction)
        active = self._mask(buf)
        out, out_w = self.ext.combine(
            plan.native, self._dense(x), self._dense(topk_weights), active, single, seq,
            self._ns(buf._gpu_timeout_us), self._blocks(num_sms),
        )  # fmt: skip
        self._settle(buf)
        return out, (out_w if topk_weights is not None else None), NO_WAIT
