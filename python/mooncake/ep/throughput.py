"""High-throughput expert-parallel dispatch and combine (prefill): ``ElasticBuffer``.

Upstream Mooncake 0.3.14's DeepEP-V2-style API (``mooncake.mooncake_elastic_buffer``,
which re-exports it from here), beside the low-latency ``Buffer``. Where ``Buffer``
receives into ``[E/R, R*T, H]`` padded for the worst case, ``ElasticBuffer`` receives one
row per token (``[num_recv_tokens, H]``) with the token's local expert ids
(``recv_topk_idx``, -1 where an expert lives on another rank) and weights, or with
``do_expand`` one row per (token, local expert), grouped by expert and padded to
``expert_alignment``.

An ElasticBuffer is its members (a process group's: ``group.GroupMembers``) times its
paths. The device path (``throughput_device``: kernels over workspaces every member maps
through CUDA IPC) runs calls on CUDA tensors when every member runs on this host and the
build has it; the portable path (``throughput_portable`` over ``throughput_rows``: torch
ops over the group's exchange) runs the others, for CPU tensors and (staged through the
host where the group cannot move them) CUDA ones. Both are deterministic and give the same
results bit for bit; :meth:`ElasticBuffer._path_for` picks, and ``path`` and ``transport``
say which ran last.

Failures as in ``Buffer``: a rank that dies (or stays silent past the exchange's
timeout) is left out by the process group, counted as having sent nothing, and masked
from then on (``active_ranks``); the survivors return. After replacements joined,
``update_ep_member`` starts a new membership generation, and handles of the old one are
refused.

Shapes: ``N`` tokens on this rank, ``K`` top-k, ``H`` hidden, ``R`` ranks, ``E``
experts, ``E/R`` local experts per rank, ``T`` = ``num_max_tokens_per_rank``.
"""

from __future__ import annotations

import hashlib
import itertools
import os

import torch
import torch.distributed as dist

from .. import _checks
from . import throughput_device
from .group import members_of
from .throughput_device import DevicePlan
from .throughput_handle import EPHandle
from .throughput_portable import ThroughputPortable
from .types import EventOverlap

__all__ = ["ElasticBuffer", "EPHandle", "EventOverlap"]

_buffer_ids = itertools.count(1)
_ALIGNMENT = 2 << 20  # the size hints' granularity (2 MiB, as upstream's)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _host_key() -> int:
    """This process's host, as peers on the same one see it: the boot id and the network
    namespace (as the transport's peer table decides "same host"), hashed to an int63."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        boot, netns = "?", str(os.getpid())  # unknown: a host of its own
    digest = hashlib.blake2b(f"{boot}|{netns}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Runtime:
    """``ElasticBuffer.runtime``: what upstream's native runtime answers; None once the
    buffer is destroyed."""

    def __init__(self, buffer: ElasticBuffer):
        self._buffer = buffer

    def ibgda_disabled(self) -> bool:
        """Always True: peers are reached through the process group's exchange or CUDA IPC
        (no GPU-initiated RDMA)."""
        return True

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self._buffer.get_physical_domain_size()

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self._buffer.get_logical_domain_size()


class ElasticBuffer:
    """High-throughput EP over a process group: upstream's ``ElasticBuffer``.

    Args:
        group: a ``torch.distributed`` ProcessGroup; ``R = group.size()``. With a
            mooncake backend the buffer follows the group's view of failed ranks; any
            other group works too, with a warning (nothing detects a failed rank).
        num_bytes: the workspace to reserve (None: :meth:`get_buffer_size_hint` of the
            MoE settings below, or 0 without ``num_max_tokens_per_rank`` and ``hidden``).
            Recorded: the portable path allocates per call and reserves nothing, and the
            device path sizes its own workspace (``device_workspace_bytes``).
        num_max_tokens_per_rank: the default ``T`` of :meth:`dispatch` (0: none).
        hidden, num_topk, use_fp8_dispatch: the MoE settings the size hint takes (the
            device path sizes its rings for ``hidden`` and ``num_topk``, or its first
            call's if larger). FP8 is chosen per call by passing ``x`` as ``(data,
            scales)``, as upstream's.
        deterministic: upstream's switch for a fixed receive order; both paths are always
            deterministic (sources in rank order, tokens in order; results bit for bit
            the same run to run, and the same on either path).
        allow_hybrid_mode: accepted; the portable path is one flat exchange (logical
            domain ``(1, R)``).
        allow_multiple_reduction: True: with ``do_expand`` a rank sums a token's expanded
            rows before sending them back (one rounding there, one at the source);
            False: it sends each row and the source sums them all, rounding once.
        prefer_overlap_with_compute: what :meth:`get_theoretical_num_sms` assumes.
        sl_idx, num_allocated_qps: RDMA settings; accepted (``sl_idx`` in [0, 16)) and
            without effect here: there is no RDMA path.
        num_cpu_timeout_secs: the budget of a dispatch's counts exchange, in seconds: a
            rank silent that long is left out of the group (a dead one sooner: the group
            notices its death).
        num_gpu_timeout_secs: the budget of each tokens and combine exchange, in seconds
            (on the device path, of a wait for a silent peer, started again whenever it
            shows progress; the counts' wait takes ``num_cpu_timeout_secs``).
        explicitly_destroy: accepted; :meth:`destroy` works either way.
        transport: ``"auto"`` (the default) or ``"pg"``: the process group's exchange, or
            the device path's mapped workspaces where it serves (the attribute
            ``transport`` reads which moved the last call's rows). Upstream's ``"ibgda"`` and ``"nccl"`` cannot
            be served here and raise ValueError naming what can.

    Collective: every rank of the group constructs its buffer together (they check
    that they agree on ``num_bytes``), and a replacement that joined the group later
    constructs its buffer while the others call :meth:`update_ep_member`.

    Attributes (upstream's): ``group`` and ``backend`` (the group), ``rank_idx``,
    ``num_ranks``, the constructor's arguments, ``requested_transport`` and
    ``transport`` (what moved the last call's rows: ``"pg"``, the group's exchange, or
    ``"cuda_ipc"``, the device path's mapped workspaces), ``num_scaleout_ranks``/
    ``num_scaleup_ranks`` and ``scaleout_rank_idx``/``scaleup_rank_idx`` (the logical
    domain), ``num_rdma_ranks``/``num_nvlink_ranks`` (the physical one), ``runtime`` (None
    once destroyed). Ours: ``path`` (``"portable"`` or ``"device"``: the last call's),
    ``device_workspace_bytes`` (the device path's workspace, 0 without one),
    ``active_ranks``, ``generation``.

    Raises:
        ValueError: an argument breaks a rule above, or the ranks disagree on
            ``num_bytes``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        transport: str = "auto",
    ) -> None:
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(
                f"ElasticBuffer: group must be a torch.distributed ProcessGroup, got "
                f"{type(group).__name__}"
            )
        num_bytes, num_max_tokens_per_rank, hidden, num_topk, sl_idx, num_allocated_qps = map(
            _checks.plain,
            (num_bytes, num_max_tokens_per_rank, hidden, num_topk, sl_idx, num_allocated_qps),
        )
        num_cpu_timeout_secs, num_gpu_timeout_secs = map(
            _checks.plain, (num_cpu_timeout_secs, num_gpu_timeout_secs)
        )
        _checks.throughput_buffer_args(
            num_bytes=num_bytes, num_max_tokens_per_rank=num_max_tokens_per_rank,
            hidden=hidden, num_topk=num_topk, use_fp8_dispatch=use_fp8_dispatch,
            deterministic=deterministic, allow_hybrid_mode=allow_hybrid_mode,
            allow_multiple_reduction=allow_multiple_reduction,
            prefer_overlap_with_compute=prefer_overlap_with_compute, sl_idx=sl_idx,
            num_allocated_qps=num_allocated_qps, num_cpu_timeout_secs=num_cpu_timeout_secs,
            num_gpu_timeout_secs=num_gpu_timeout_secs, explicitly_destroy=explicitly_destroy,
        )  # fmt: skip
        self.transport = _checks.transport_arg(transport)
        self.requested_transport = transport.strip().lower()
        members = members_of(
            group, "ElasticBuffer", ", and a dead rank stalls the exchanges for the group's timeout"
        )
        self._members = members
        self.group = self.backend = group
        self.rank_idx, self.num_ranks = members.rank, members.num_ranks
        self.num_max_tokens_per_rank, self.hidden = num_max_tokens_per_rank, hidden
        self.num_topk, self.use_fp8_dispatch = num_topk, use_fp8_dispatch
        self.deterministic, self.allow_hybrid_mode = deterministic, allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.sl_idx, self.num_allocated_qps = sl_idx, num_allocated_qps
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self._cpu_timeout_us = num_cpu_timeout_secs * 1_000_000
        self._gpu_timeout_us = num_gpu_timeout_secs * 1_000_000
        self.explicitly_destroy = explicitly_destroy
        if num_bytes is None:
            num_bytes = 0
            if num_max_tokens_per_rank and hidden:
                num_bytes = self.get_buffer_size_hint(
                    group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                    allow_hybrid_mode, allow_multiple_reduction,
                )  # fmt: skip
        self.num_bytes = num_bytes
        # The logical domain: one flat exchange.
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks
        self._id = next(_buffer_ids)
        self._seq = 0  # the latest fresh dispatch's number; combine rows carry theirs
        self._generation = 0  # membership generations; handles carry theirs
        self._active = torch.ones(self.num_ranks, dtype=torch.bool)
        self._active_changes = 0  # bumped at each change of _active (the device path caches)
        self._portable = ThroughputPortable(members)
        # The device path: made by every member together at their first dispatch of CUDA
        # tensors (see _path_for), None where it cannot serve them all.
        self._device: throughput_device.ThroughputDevice | None = None
        self._device_tried = False
        self.path = "portable"
        self.runtime: _Runtime | None = _Runtime(self)
        self._agree("ElasticBuffer")

    # --- membership --------------------------------------------------------------------

    def _agree(self, what: str) -> None:
        """Collective (every present member calls it, a replacement from its
        constructor): checks that the members agree on ``num_bytes``, moves to the next
        membership generation and the highest call number among them, masks the members
        the group does not count present, and learns which members share this host."""
        R = self.num_ranks
        mine = torch.tensor([1, self.num_bytes, R, self._generation, self._seq, _host_key()])
        rows = self._members.all_gather(mine).reshape(R, 6).tolist()
        present = [r for r in range(R) if rows[r][0]]
        for r in present:
            if rows[r][1:3] != [self.num_bytes, R]:
                raise ValueError(
                    f"{what}: ranks disagree on num_bytes: rank {r} has {rows[r][1]}, rank "
                    f"{self.rank_idx} has {self.num_bytes}"
                )
        self._generation = max(rows[r][3] for r in present) + 1
        self._seq = max(rows[r][4] for r in present)
        self._active = self._members.present(R).clone()
        self._active_changes += 1
        hosts = [rows[r][5] for r in present]
        self.num_nvlink_ranks = hosts.count(rows[self.rank_idx][5])
        self.num_rdma_ranks = len(set(hosts))

    def update_ep_member(self) -> None:
        """Refreshes the members after the process group changed membership.

        Call it on every healthy rank after ``pg.recover_ranks`` admitted replacements,
        while each replacement constructs its ElasticBuffer (both run the same exchange).
        Afterwards every member the group counts present takes part again, and the
        membership generation moves on: handles from earlier dispatches are refused
        (ValueError), so dispatch again. A rank that died needs no call: dispatch and
        combine mask it themselves.

        Raises:
            ValueError: the members disagree on ``num_bytes``.
            RuntimeError: the buffer was destroyed.
        """
        self._alive("update_ep_member")
        self._drop_device()
        self._agree("update_ep_member")

    @property
    def active_ranks(self) -> torch.Tensor:
        """int32 ``[R]`` on the CPU, a copy: 1 for the ranks that take part, 0 for those
        masked (they failed, or the group counted them out when the buffer was made or
        last updated)."""
        return self._active.to(torch.int32)

    @property
    def generation(self) -> int:
        """The membership generation: 1 when made, one more at each update_ep_member."""
        return self._generation

    def destroy(self) -> None:
        """Releases the buffer (not collective; a second call does nothing). Dispatch,
        combine, barrier and update_ep_member raise RuntimeError afterwards."""
        self.runtime = None
        self._drop_device()

    def _drop_device(self) -> None:
        """Lets the device path go (peers that still map its workspace keep it readable);
        the members make a new one together at their next dispatch of CUDA tensors."""
        if self._device is not None and torch.cuda.is_available():
            torch.cuda.synchronize(self._device.device)  # no kernel of ours still runs
        self._device, self._device_tried = None, False

    @property
    def device_workspace_bytes(self) -> int:
        """The device path's workspace on this rank (bytes; 0 without one): signals and
        rings whose size does not depend on ``num_max_tokens_per_rank``."""
        return 0 if self._device is None else self._device.workspace_bytes

    @property
    def device_one_copy(self) -> dict:
        """The device path's one copy (``MOONCAKE_EP_HT_ONE_COPY``): ``on``; since the path
        was made, the (source, channel) pairs whose rows this rank read where they lie in
        the peer's memory (``dispatch_in_place``: a source's ``x``; ``combine_in_place``: a
        replier's) and those it read through the peer's ring after an offer (the
        allocation not mapped here yet: ``dispatch_ring``, ``combine_ring``); and
        ``mapped``, the peers' allocations mapped now. Waits for the device. All zero
        without a device path."""
        keys = ("dispatch_in_place", "dispatch_ring", "combine_in_place", "combine_ring")
        if self._device is None:
            return {"on": False, **dict.fromkeys(keys, 0), "mapped": 0}
        ext = self._device.ext
        counts = [int(n) for n in ext.one_copy_counts()]
        return {"on": bool(ext.one_copy()), **dict(zip(keys, counts, strict=True)),
                "mapped": int(ext.one_copy_mapped())}  # fmt: skip

    def _alive(self, what: str) -> None:
        if self.runtime is None:
            raise RuntimeError(f"{what}: the ElasticBuffer has been destroyed")

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False) -> None:
        """A barrier of the group's present members (``use_comm_stream`` is accepted:
        there is no communication stream of its own); with ``with_cpu_sync`` the host
        also waits for this device's work before and after.

        Raises:
            ValueError: a flag is not a bool.
            RuntimeError: the buffer was destroyed.
        """
        self._alive("barrier")
        err = _checks.flags_error(use_comm_stream=use_comm_stream, with_cpu_sync=with_cpu_sync)
        if err:
            raise ValueError(f"barrier: {err}")
        sync = with_cpu_sync and torch.cuda.is_available()
        if sync:
            torch.cuda.synchronize()
        dist.barrier(group=self.group)
        if sync:
            torch.cuda.synchronize()

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded now on the current CUDA stream (without CUDA, one with
        nothing to wait for), as ``Buffer.capture``."""
        if not torch.cuda.is_available():
            return EventOverlap()
        event = torch.cuda.Event()
        event.record()
        return EventOverlap(event)

    # --- sizes and domains -------------------------------------------------------------

    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """The bytes one call of the portable path stages at most, 2 MiB aligned.

        A closed formula of ``R = group.size()``, ``T``, ``H`` and ``K`` (``num_topk``;
        0: 32, the most): ``align(max(D, C), 2 MiB)``, where a dispatch holds
        ``(R*T + T*min(R, K))`` token rows of ``align8(16 + 8K + P)`` bytes (the ``R*T``
        it may receive and the ``T*min(R, K)`` it sends; ``P = 2H``, or ``H + 4 *
        ceil(H / 128)`` with FP8) and a combine ``(R*T + T*min(R, K)) * c`` rows of
        ``align8(16 + 4K + 2H)`` (``c = 1``, or ``K`` without multiple reductions).
        ``allow_hybrid_mode`` has no effect. The portable path allocates these per call;
        a device path will size its workspace (bounded independently of ``T``) itself.

        Raises:
            ValueError: ``group`` is not a ProcessGroup, ``T`` or ``hidden`` is not an
                int in [1, 2**31), ``num_topk`` not in [0, 32], or a flag not a bool.
        """
        what = "get_buffer_size_hint"
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(
                f"{what}: group must be a torch.distributed ProcessGroup, got {type(group).__name__}"
            )
        T = _checks.int_arg(what, "num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        H = _checks.int_arg(what, "hidden", hidden, 1)
        if not (_checks.is_int(num_topk) and 0 <= num_topk <= _checks.MAX_TOPK):
            raise ValueError(f"{what}: num_topk must be an int in [0, 32], got {num_topk!r}")
        K = int(num_topk) or _checks.MAX_TOPK
        err = _checks.flags_error(
            use_fp8_dispatch=use_fp8_dispatch, allow_hybrid_mode=allow_hybrid_mode,
            allow_multiple_reduction=allow_multiple_reduction,
        )  # fmt: skip
        if err:
            raise ValueError(f"{what}: {err}")
        R = group.size()
        payload = H + 4 * -(-H // 128) if use_fp8_dispatch else 2 * H
        rows = R * T + T * min(R, K)
        dispatch = rows * _align(16 + 8 * K + payload, 8)
        combine = rows * (1 if allow_multiple_reduction else K) * _align(16 + 4 * K + 2 * H, 8)
        return _align(max(dispatch, combine), _ALIGNMENT)

    @staticmethod
    def get_engram_storage_size_hint(
        num_entries: int, hidden: int, num_max_tokens_per_rank: int,
        dtype: torch.dtype = torch.bfloat16,
    ) -> int:  # fmt: skip
        """Upstream's sizing of an Engram store (a feature served neither here nor by
        upstream's ElasticBuffer): ``(num_entries + T)`` entries of ``align32(H * itemsize
        + 4 * ceil(H / 128))`` bytes, the scales counted for 1-byte dtypes only."""
        what = "get_engram_storage_size_hint"
        n = _checks.int_arg(what, "num_entries", num_entries, 0, 2**62)
        H = _checks.int_arg(what, "hidden", hidden, 1)
        T = _checks.int_arg(what, "num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{what}: dtype must be a torch.dtype, got {dtype!r}")
        scales = 4 * -(-H // 128) if dtype.itemsize <= 1 else 0
        return _align(H * dtype.itemsize + scales, 32) * (n + T)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """Upstream's sizing of pipeline-parallel send/receive buffers (not served here):
        ``align32(num_max_tensor_bytes) * num_max_inflight_tensors * 4`` (send and
        receive, to each ring neighbour)."""
        what = "get_pp_buffer_size_hint"
        nbytes = _checks.int_arg(what, "num_max_tensor_bytes", num_max_tensor_bytes, 0, 2**62)
        n = _checks.int_arg(what, "num_max_inflight_tensors", num_max_inflight_tensors, 0)
        return _align(nbytes, 32) * n * 4

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
        """Upstream's sizing of all-gather/reduce-scatter sessions (not served here):
        ``num_max_session_bytes`` itself."""
        return _checks.int_arg(
            "get_agrs_buffer_size_hint", "num_max_session_bytes", num_max_session_bytes, 0,
            2**62,
        )  # fmt: skip

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: the hosts among the present members,
        and the members on this rank's host (same boot and network namespace)."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, R)``, one flat exchange."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int) -> int:
        """The SMs a device path would take: a quarter of this GPU's (at most 24) when
        overlapping with compute, else half (at most 40, and at most ``E * K``); 1
        without CUDA. The portable path takes none."""
        what = "get_theoretical_num_sms"
        E = _checks.int_arg(what, "num_experts", num_experts, 1)
        K = _checks.int_arg(what, "num_topk", num_topk, 0)
        if not torch.cuda.is_available():
            return 1
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if self.prefer_overlap_with_compute:
            return max(1, min(24, sms // 4))
        return max(1, min(40, sms // 2, E * max(1, K)))

    # --- dispatch and combine ----------------------------------------------------------

    def _path_for(self, x, topk_idx=None, topk_weights=None, num_experts=None,
                  do_expand=False, handle=None):  # fmt: skip
        """The path that runs a dispatch: a handle's own path; else, for CUDA tensors, the
        device path where it serves every member and these arguments; else the portable
        path. Every member picks alike (the choice depends on what a valid call agrees on).

        The first dispatch of CUDA tensors makes the device path, collectively
        (``throughput_device.connect``)."""
        if handle is not None:
            plan = getattr(handle, "native_handle", None)
            if isinstance(plan, DevicePlan) and self._device is not None:
                return self._device
            return self._portable  # (which refuses a device handle of another generation)
        data, scales = (x[0], x[1]) if isinstance(x, (tuple, list)) and len(x) == 2 else (x, None)
        if not (isinstance(data, torch.Tensor) and data.is_cuda):
            return self._portable
        # (x of another shape: the portable path's checks name it; the device path stays
        # to be tried by a valid call)
        if self._device is None and not self._device_tried and data.dim() == 2:
            self._device_tried = True
            K = (
                topk_idx.shape[1]
                if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2
                else 8
            )
            try:
                self._device = throughput_device.connect(self, data, K, _host_key())
            except BaseException:
                self._device_tried = False  # an exchange failed (a peer lost): a later call retries
                raise
        if self._device is not None and self._device.takes(
            data, scales, topk_idx, topk_weights, num_experts, do_expand
        ):
            return self._device
        return self._portable

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        handle: EPHandle | None = None,
        do_expand: bool = False,
        do_cpu_sync: bool | None = None,
        num_sms: int | None = None,
        async_with_compute_stream: bool = False,
    ):
        """Sends every token to the ranks that hold its selected experts, once per rank.

        Collective over the group's members: every present rank calls it, with the same
        ``T``, ``E``, ``K``, hidden size, dtypes and device, and all fresh or all with a
        handle of the same dispatch.

        Args:
            x: ``[N, H]`` bf16 (fp16 and fp32 work too), or pre-quantised ``(data,
                scales)``: ``data`` ``[N, H]`` float8 (e4m3 or e5m2), ``scales`` ``[N,
                packs]`` float32 (or int32 packed words), any strides (for example
                ``mooncake.fp8.quantize(x)``: one scale per 128 channels). CPU or CUDA.
            topk_idx: ``[N, K]`` int64 (or int32), ``1 <= K <= 32``, expert ids in
                ``[0, E)`` or -1 (no selection); a token selects an expert at most once.
                None with ``handle``.
            topk_weights: optional ``[N, K]`` float32, sent with the tokens.
            num_experts: ``E``, divisible by ``R``. None: the handle's, or
                ``topk_idx.max() + 1`` (as upstream's; pass it: ranks must agree).
            num_max_tokens_per_rank: ``T >= N``, the same on every rank. None: the
                handle's, the constructor's, or ``N``.
            expert_alignment: with ``do_expand``, each local expert's block of rows (and
                in every mode its count in ``num_recv_tokens_per_expert_list``) is
                padded to a multiple of it. None: 1 (or the handle's).
            handle: an EPHandle of an earlier dispatch of this buffer (and this
                membership generation): reuse its routing (the same tokens to the same
                ranks) with new data: one exchange, no counts, no CPU sync. Not with
                ``do_expand``.
            do_expand: one row of ``recv_x`` per (token, local expert) instead of per
                token: per local expert in order, its tokens in arrival order, each
                expert's block padded with zero rows to ``expert_alignment``.
            do_cpu_sync: True (the default without a handle): outputs sized exactly.
                False: sized for the worst case (``R*T`` rows; expanded,
                ``align(R*T*min(K, E/R) + (alignment - 1) * E/R, alignment)``), the same
                every call; the valid rows are counted by
                ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]`` (and expanded, by
                ``handle.psum_num_recv_tokens_per_expert``), on ``x``'s device; the rest
                are zero, with ``recv_topk_idx`` -1.
            num_sms: None or an int >= 0: on the device path, the thread blocks its kernels
                run (at most this process's share of the GPU's multiprocessors; None or 0:
                that share); the portable path uses no SMs.
            async_with_compute_stream: accepted; both paths run on the current stream
                (the device path's kernels are queued on it; without CPU sync nothing
                waits for them), so the event has nothing to wait for.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``:

            * ``recv_x``: ``[M, H]`` of ``x``'s dtype (a pair ``(data, scales [M,
              packs])`` for pre-quantised ``x``, scales contiguous). Without
              ``do_expand``, one row per received token: sources in rank order, tokens
              in order (``M`` = the tokens received, or ``R*T`` without CPU sync). With
              it, the expanded rows above.
            * ``recv_topk_idx``: ``[M_tokens, K]`` of ``topk_idx``'s dtype, one row per
              received token: each slot's local expert id, -1 where the expert lives on
              another rank (or there was none).
            * ``recv_topk_weights``: None without ``topk_weights``; else float32
              ``[M_tokens, K]`` (each token's weights as sent), or expanded ``[M]`` (the
              weight of each expanded row's slot, 0 on padding).
            * ``handle``: an :class:`EPHandle` for :meth:`combine` and cached
              dispatches (with a handle given: that handle).
            * ``event``: an ``EventOverlap`` with nothing to wait for.

            Tokens of ranks that failed during the call are left out (or, with a
            handle, read as zero rows with ``recv_topk_idx`` -1); ``active_ranks``
            says who took part (on the device path without CPU sync, as of the next
            call: the kernels report it as they run).

        Raises:
            ValueError: an argument breaks a rule above (the message names it), or the
                ranks' calls disagree; raised on every rank alike, and the buffer stays
                usable.
            RuntimeError: the buffer was destroyed.
            mooncake.LeftOutError: this rank was left out of the group.
        """
        self._alive("dispatch")
        num_experts, num_max_tokens_per_rank, expert_alignment, num_sms = map(
            _checks.plain, (num_experts, num_max_tokens_per_rank, expert_alignment, num_sms)
        )
        path = self._path_for(x, topk_idx, topk_weights, num_experts, do_expand, handle)
        self.path, self.transport = path.name, path.transport
        return path.dispatch_call(
            self, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
            expert_alignment, handle, do_expand, do_cpu_sync, num_sms,
            async_with_compute_stream,
        )  # fmt: skip

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        num_sms: int | None = None,
        async_with_compute_stream: bool = False,
    ):
        """Sends expert outputs back to their tokens' ranks and sums them per token.

        Collective, as :meth:`dispatch`, with handles of the same dispatch. Weights are
        not applied here: as upstream's, ``x`` holds what each rank contributes (apply
        ``recv_topk_weights`` in the experts).

        Args:
            x: the dispatch's layout: ``[handle.num_recv_tokens, H]`` (one row per
                received token; rows past the valid ones are ignored) or, expanded,
                ``[handle.num_expanded_tokens, H]`` (padding rows ignored); bf16, fp16 or
                float32, the same on every rank, on the dispatch's device. It may be
                trimmed to the valid rows, as upstream's callers pass it after a dispatch
                without CPU sync (``psum_num_recv_tokens_per_scaleup_rank[-1]`` rows;
                expanded, ``psum_num_recv_tokens_per_expert[-1]``), not shorter: the
                portable path raises ValueError for a shorter one; the device path, which
                does not know the valid rows on the host, reads the missing rows as zero
                and raises ValueError at this rank's next call.
            handle: the dispatch's EPHandle (this buffer's, this membership generation).
            topk_weights: optional float32, ``[rows, K]`` (expanded: ``[rows]``), ``rows``
                as ``x``'s: sent back beside the data, to be returned per source slot
                (upstream's backward pass).
            num_sms, async_with_compute_stream: as in :meth:`dispatch`.

        Returns:
            ``(combined_x, combined_topk_weights, event)``: ``combined_x`` ``[N, H]`` of
            ``x``'s dtype: per token, the fp32 sum of what each rank holding one of its
            experts sent back (without expanding, that rank's row; expanded, the sum of
            its rows of the token, rounded there once unless
            ``allow_multiple_reduction=False``), added slot by slot in top-k order and
            rounded once; tokens of no expert, or only of failed ranks, read zero.
            ``combined_topk_weights``: None without ``topk_weights``; else float32
            ``[N, K]``, each slot's weight from the rank of its expert (0 for -1 slots
            and failed ranks). ``event``: nothing to wait for.

        Raises:
            ValueError: an argument breaks a rule above (a handle of another buffer or
                an earlier membership generation too), or the ranks' calls disagree;
                raised on every rank alike, and the buffer stays usable.
            RuntimeError: the buffer was destroyed.
            mooncake.LeftOutError: this rank was left out of the group.
        """
        self._alive("combine")
        num_sms = _checks.plain(num_sms)
        # A combine runs on its dispatch's path (a device handle of an earlier membership
        # generation goes to the portable path, which refuses it alike on every rank).
        path = self._portable
        if (
            isinstance(getattr(handle, "native_handle", None), DevicePlan)
            and self._device is not None
        ):
            path = self._device
        self.path, self.transport = path.name, path.transport
        return path.combine_call(self, x, handle, topk_weights, num_sms, async_with_compute_stream)
