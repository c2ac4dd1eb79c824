"""Expert-parallel dispatch and combine that know which ranks are healthy.

``Buffer`` follows the DeepEP low-latency model, with upstream Mooncake's
API: ``dispatch`` sends each token to
the ranks holding its top-k experts and returns them packed per local expert;
``combine`` sends the experts' outputs back and sums them per token with the
top-k weights. It runs over a mooncake process group and stays usable when
ranks fail: a rank that dies is masked out (``active_ranks[rank] = 0``) and
treated as having sent nothing, within ``timeout_us``.

Two paths serve the same calls. The device path (``mooncake/_ep_device.py``)
runs CUDA kernels that store tokens straight into peers' mapped workspaces;
it serves CUDA tensors when every member is on this host and the Buffer has
a device workspace. The portable path (``mooncake/_ep_fallback.py``) is torch
ops over the process group, for CPU tensors and everything else.
``Buffer.path`` says which one ran last.

Shapes below: ``N`` tokens on this rank, ``K`` top-k, ``H`` hidden, ``R``
ranks (``group.size()``), ``E`` experts, ``E/R`` local experts per rank,
``T`` = ``num_max_dispatch_tokens_per_rank``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import _ep_device, pg
from . import _ep_fallback as fb
from ._ep_types import DispatchHandle, EventOverlap

__all__ = ["Buffer", "EventOverlap", "DispatchHandle"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_buffer_ids = itertools.count(1)


class _Pending:
    """The receive half of a call: wait for the exchange, then fill the outputs."""

    def __init__(self, work, finish: Callable[[], None]):
        self._work, self._finish, self._done = work, finish, False

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        if self._work is not None:
            self._work.wait()
        self._finish()


class _Rephrased:
    """A Work whose ValueError (the ranks' calls disagree) gets a message saying so."""

    def __init__(self, work, what: str):
        self._work, self._what = work, what

    def wait(self) -> None:
        try:
            self._work.wait()
        except ValueError as e:
            raise ValueError(f"{self._what}: {e}") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: The longest EP deadline, in microseconds (about 35 years; ``-1`` means none): a
#: longer one would overflow the nanosecond clocks the exchange computes deadlines with.
_MAX_TIMEOUT_US = 2**50
#: Bound of the shape arguments (``T``, ``E``), as in :meth:`Buffer.get_ep_buffer_size_hint`.
_MAX_SHAPE = 2**31


def _timeout_error(timeout_us) -> str | None:
    if _is_int(timeout_us) and (timeout_us == -1 or 0 < timeout_us <= _MAX_TIMEOUT_US):
        return None
    return f"timeout_us must be -1 (no deadline) or an int in [1, 2**50], got {timeout_us!r}"


def _flags_error(**flags) -> str | None:
    """The first of ``flags`` (name=value) that is not a bool, or None."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            return f"{name} must be a bool, got {v!r}"
    return None


def _tensor_error(name, t, dtypes, ndim, device=None, shape=None) -> str | None:
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


class Buffer:
    """The EP runtime of one mooncake process group.

    Args:
        group: a ``torch.distributed`` ProcessGroup with a mooncake backend
            (``mooncake-cpu`` or ``mooncake``); ``R = group.size()``.
        num_ep_buffer_bytes: the workspace to reserve, from
            :meth:`get_ep_buffer_size_hint`; 0 reserves none. When it is
            non-zero, a dispatch whose shape needs more raises ValueError
            instead of overflowing. The portable path allocates its tensors
            per call and needs no workspace; the device path needs one.
        device: where the device path's workspace lives: a CUDA device (an
            index or ``"cuda:N"``; ``"cuda"`` is the current one). ``None``:
            the current CUDA device when the group has a ``mooncake`` CUDA
            backend, else no device path. With a workspace on a device,
            dispatches of CUDA tensors there run the device path when every
            member is mapped (``MOONCAKE_EP_FORCE_FALLBACK=1`` turns it off).

    Collective: every rank of the group constructs its Buffer together (they
    check that they agree on the size), and a process that joined the group
    later constructs its Buffer while the others call
    :meth:`update_ep_member`.

    Raises:
        ValueError: ``group`` has no mooncake backend; ``num_ep_buffer_bytes``
            is not an int in ``[0, 2**63)``; the ranks disagree on it;
            ``device`` is not a CUDA device or this build has no CUDA.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_ep_buffer_bytes: int = 0,
        device: torch.device | str | int | None = None,
    ):
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(
                f"Buffer: group must be a torch.distributed ProcessGroup with a mooncake backend, "
                f"got {type(group).__name__}"
            )
        try:
            pg._backend_of(group)
        except ValueError:
            raise ValueError(
                "Buffer: group has no mooncake backend (create it with backend "
                '"mooncake-cpu" or "mooncake")'
            ) from None
        if not _is_int(num_ep_buffer_bytes) or not 0 <= num_ep_buffer_bytes < 2**63:
            raise ValueError(
                f"Buffer: num_ep_buffer_bytes must be an int in [0, 2**63), got "
                f"{num_ep_buffer_bytes!r}"
            )
        self.group = group
        self.rank = group.rank()
        self.num_ranks = group.size()
        self.num_ep_buffer_bytes = num_ep_buffer_bytes
        self.path = "portable"
        self._init_calls()
        workspace_device = self._workspace_device(device)
        self._sync_members("Buffer")
        if workspace_device is not None and num_ep_buffer_bytes > 0:
            self._device = _ep_device.DevicePath(
                group, num_ep_buffer_bytes, workspace_device, self.rank, self.num_ranks
            )

    def _workspace_device(self, device) -> torch.device | None:
        """The CUDA device of the device path's workspace, or None (portable only)."""
        if device is None:
            try:
                cuda = isinstance(self.group._get_backend(torch.device("cuda")), pg.MooncakeBackend)
            except (RuntimeError, ValueError):
                cuda = False
            if not cuda or not _ep_device.available():
                return None
            return torch.device("cuda", torch.cuda.current_device())
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"Buffer: device must be a CUDA device, got {device!r}") from None
        if dev.type != "cuda":
            raise ValueError(f"Buffer: device must be a CUDA device, got {dev}")
        if not _ep_device.available():
            raise ValueError(
                "Buffer: device: this build of mooncake has no CUDA device path (build it "
                "against a CUDA torch)"
            )
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)

    def _init_calls(self) -> None:
        self._id = next(_buffer_ids)
        self._seq = 0
        self._combine_buffers: list[torch.Tensor | None] = [None, None]
        self._device: _ep_device.DevicePath | None = None

    @classmethod
    def create_elastic(
        cls,
        rank: int,
        tcp_store_group: dist.Store,
        timeout_ms: int = 30000,
        metadata_timeout_ms: int = 300000,
        store_prefix: str = "mooncake-ep/",
    ) -> Buffer:
        """An elastic Buffer for global rank ``rank``: a fixed capacity of stable
        rank slots, peers connected, staged and masked one by one
        (upstream's elastic EP buffer design; ``mooncake._ep_elastic``).

        Call ``update_memory_buffers(num_ranks=capacity, num_experts_per_rank,
        num_rdma_bytes)`` next, then ``connect_ranks``/``update_mask_buffer``.
        ``dispatch``/``combine`` work as here, among the active slots.

        Args:
            rank: this process's slot (logical rank), below ``2**31``.
            tcp_store_group: the ``torch.distributed.Store`` (a TCPStore) through
                which peers exchange metadata.
            timeout_ms: the wait budget of each exchange phase (communication
                only), from the phase's start; a peer silent past it is masked.
                A dispatch runs two phases (counts, then tokens), so it may wait
                up to twice it; a combine or a barrier one. A call's
                ``timeout_us`` replaces it. -1: none; else below ``2**40``.
            metadata_timeout_ms: bound of store waits only (a peer's buffer or
                its side of a connection), in ``[1, 2**40)``.
            store_prefix: the store keys' namespace (one per set of buffers).

        Raises:
            ValueError: an argument breaks its rule (the message names it).
        """
        from ._ep_elastic import ElasticBuffer

        return ElasticBuffer(rank, tcp_store_group, timeout_ms, metadata_timeout_ms, store_prefix)

    # --- sizes -------------------------------------------------------------------------

    @staticmethod
    def get_ep_buffer_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """The workspace, in bytes, for dispatches of up to ``T`` tokens per rank.

        A closed formula (``src/ep/layout.h``): two halves (even and odd calls),
        each ``align128(2E * 4)`` signal bytes + a send region of
        ``max(T * M, E * T * 2H)`` + a receive region of ``E * T * M``, where
        ``M = align16(16 + max(2H, H + 4 * ceil(H / 128)))`` is one dispatch
        message (a 16-byte header and a BF16 or FP8 payload) and ``2H`` one
        combine message; every region is 128-byte aligned. For T=128, H=7168,
        R=8, E=288 that is about 2.1 GB.

        Raises:
            ValueError: an argument is < 1, ``num_experts % num_ranks != 0``, or
                the result would exceed 2**50 bytes.
        """
        for name, v in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            ("hidden", hidden),
            ("num_ranks", num_ranks),
            ("num_experts", num_experts),
        ):
            if not _is_int(v):
                raise ValueError(f"get_ep_buffer_size_hint: {name} must be an int, got {v!r}")
            if not -(2**31) < v < 2**31:
                raise ValueError(f"get_ep_buffer_size_hint: {name} must be below 2**31, got {v}")
        return pg._ext.ep_layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)[
            "total_bytes"
        ]

    # --- membership ----------------------------------------------------------------------

    def update_ep_member(self) -> None:
        """Refreshes the EP peers after the process group changed membership.

        Call it on every healthy rank after ``pg.recover_ranks`` admitted
        replacements (the replacements construct their Buffer at the same
        time: both sides run the same exchange). Afterwards a dispatch with
        ``active_ranks`` back at 1 for the recovered ranks (or
        ``active_ranks=None``) runs at full strength. A rank that died is
        masked by dispatch and combine themselves; no call is needed for that.

        Raises:
            ValueError: the members disagree on ``num_ep_buffer_bytes``.
        """
        self._sync_members("update_ep_member")
        if self._device is not None:
            self._device.connect()

    def _sync_members(self, what: str) -> None:
        try:
            cpu = isinstance(self.group._get_backend(torch.device("cpu")), pg.MooncakeBackend)
        except (RuntimeError, ValueError):
            cpu = False
        device = torch.device("cpu" if cpu else "cuda")
        mine = torch.tensor([1, self.num_ep_buffer_bytes, self.num_ranks], device=device)
        everyone = torch.zeros(self.num_ranks * 3, dtype=torch.int64, device=device)
        self._backend_for(device)._allgather_base(everyone, mine).wait()
        rows = everyone.reshape(self.num_ranks, 3).tolist()
        for r, (present, nbytes, size) in enumerate(rows):
            if present and (nbytes, size) != (self.num_ep_buffer_bytes, self.num_ranks):
                raise ValueError(
                    f"{what}: ranks disagree on num_ep_buffer_bytes: rank {r} has {nbytes}, "
                    f"rank {self.rank} has {self.num_ep_buffer_bytes}"
                )

    def _present(self, num_ranks: int) -> torch.Tensor:
        """bool [num_ranks], on CPU: the ranks that take part right now (here the
        process group's members)."""
        return pg.get_active_ranks(self.group)[:num_ranks].cpu().bool()

    # The hooks an elastic buffer (``mooncake._ep_elastic``) overrides: how many
    # ranks a call covers, its local experts, and the exchange itself.

    def _call_ranks(self, num_experts, what: str = "dispatch") -> int:
        """``R`` of a dispatch with ``num_experts`` experts (``what``: the calling method)."""
        return self.num_ranks

    def _local_experts(self, num_experts, num_ranks: int) -> int:
        """``E/R``: the width of the counts rows (0 when num_experts is invalid)."""
        valid = _is_int(num_experts) and num_ranks <= num_experts < _MAX_SHAPE
        return num_experts // num_ranks if valid else 0

    def _device_error(self, device: torch.device) -> str | None:
        """Why ``x`` may not live on ``device`` (None: it may)."""
        if self._device is not None and device == self._device.device:
            return None
        try:
            self._backend_for(device)
        except (RuntimeError, ValueError):
            return f"x is on {device}, but the group has no mooncake backend for {device.type}"
        return None

    def _experts_error(self, num_experts: int) -> str | None:
        if num_experts % self.num_ranks:
            return (
                f"num_experts ({num_experts}) must be divisible by the number of ranks "
                f"({self.num_ranks})"
            )
        return None

    def _all_to_all(self, device, out, inp, out_splits, in_splits, timeout_us):
        """Starts an uneven exchange of ``inp``'s rows (splits per rank); returns a Work.
        ``device`` None: this rank rejected its call and only takes part. ``timeout_us``
        is this exchange's own budget, from its start (-1: the group's, or the buffer's,
        timeout): a call of several exchanges gives each the whole ``timeout_us``."""
        return fb.all_to_all(self._backend_for(device), out, inp, out_splits, in_splits, timeout_us)

    def _backend_for(self, device: torch.device | None):
        if device is None or device.type == "cpu":
            return pg._backend_of(self.group)
        b = self.group._get_backend(torch.device(device.type))
        if not isinstance(b, pg.MooncakeBackend):
            raise ValueError(
                f"x is on {device}, but the group has no mooncake backend for {device.type}"
            )
        return b

    def _mark_failed(self, active_ranks, present: torch.Tensor) -> None:
        if active_ranks is None:
            return
        gone = (~present).nonzero().squeeze(1)
        if gone.numel():
            active_ranks[gone.to(active_ranks.device)] = 0

    # --- the device path -------------------------------------------------------------

    def mask_events(self) -> list[str]:
        """Why the device path's kernels masked peers so far (a peer silent past a
        deadline), oldest first. Reads what the kernels reported without waiting for the
        device: a call still running may add to it later."""
        return [] if self._device is None else self._device.mask_events()

    # --- dispatch ------------------------------------------------------------------------

    def _dispatch_error(
        self,
        x,
        topk_idx,
        active_ranks,
        max_tokens,
        num_experts,
        timeout_us,
        use_fp8,
        stats,
        modes,
        values: bool = True,
    ) -> str | None:
        """The first rule the arguments break, or None; ``values=False`` skips the rules
        on ``topk_idx``'s values, which need a host sync (the device path checks them in
        its kernel)."""
        R = self._call_ranks(num_experts)
        err = _tensor_error("x", x, _FLOAT_DTYPES, 2)
        if err:
            return err
        n, h = x.shape
        checks = [
            self._device_error(x.device),
            _tensor_error("topk_idx", topk_idx, (torch.int64, torch.int32), 2, x.device),
            None
            if _is_int(max_tokens) and 1 <= max_tokens < _MAX_SHAPE
            else f"num_max_dispatch_tokens_per_rank must be an int in [1, 2**31), got "
            f"{max_tokens!r}",
            None
            if _is_int(num_experts) and 1 <= num_experts < _MAX_SHAPE
            else f"num_experts must be an int in [1, 2**31), got {num_experts!r}",
            _timeout_error(timeout_us),
            _flags_error(use_fp8=use_fp8, async_finish=modes[0], return_recv_hook=modes[1]),
            None
            if not (modes[0] and modes[1])
            else "async_finish and return_recv_hook are exclusive: set one of them",
            None
            if active_ranks is None
            else _tensor_error("active_ranks", active_ranks, (torch.int32,), 1, x.device, [R]),
        ]
        for c in checks:
            if c:
                return c
        if topk_idx.shape[0] != n:
            return (
                f"topk_idx must have one row per token of x ({n}), got shape {list(topk_idx.shape)}"
            )
        err = self._experts_error(num_experts)
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
            err = _tensor_error(
                "cumulative_local_expert_recv_stats",
                stats,
                (torch.int32,),
                1,
                x.device,
                [num_experts // R],
            )
            if err:
                return err
        if self.num_ep_buffer_bytes:
            need = self.get_ep_buffer_size_hint(max_tokens, h, R, num_experts)
            if need > self.num_ep_buffer_bytes:
                return (
                    f"num_max_dispatch_tokens_per_rank={max_tokens}, hidden={h}, "
                    f"num_experts={num_experts} need {need} workspace bytes, but this Buffer has "
                    f"num_ep_buffer_bytes={self.num_ep_buffer_bytes} "
                    f"(see Buffer.get_ep_buffer_size_hint)"
                )
        return None

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        active_ranks: torch.Tensor | None,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        timeout_us: int,
        use_fp8: bool = True,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    ):
        """Sends every token to the ranks that hold its selected experts.

        Collective over the group's members: every healthy rank calls it, with
        the same ``T``, ``H``, ``E`` and ``use_fp8``.

        Args:
            x: ``[N, H]`` bf16 (fp16 and fp32 work too), ``N <= T``, on a
                device the group has a mooncake backend for.
            topk_idx: ``[N, K]`` int64 (or int32), expert ids in ``[0, E)``;
                ``-1`` marks a selection to skip.
            active_ranks: int32 ``[R]`` on ``x``'s device, 1 = healthy. Tokens go
                only to ranks marked 1 and are taken only from them (a pair of
                ranks exchanges tokens when each counts the other healthy). A
                rank that fails to deliver within ``timeout_us`` (it died) is
                set to 0 in place and counted as sending nothing. ``None``:
                the process group's view (``pg.get_active_ranks``).
            num_max_dispatch_tokens_per_rank: ``T``, the most tokens any rank
                sends in one call; sizes ``recv_x``; below ``2**31``.
            num_experts: ``E``, divisible by ``R``; below ``2**31``.
            timeout_us: the wait budget of each exchange phase, in
                microseconds, from the phase's start, at most ``2**50`` (about
                35 years); ``-1``: no EP deadline (the group's own timeout and
                failure detection still apply). The portable path's dispatch
                runs two phases (counts, then tokens), so it may wait up to
                twice ``timeout_us`` (plus, per phase, the group's grace of at
                most 0.5 s for the others to report when it leaves a rank out);
                each phase has the whole budget, so a rank that answered one
                phase is never masked because another rank was slow. A rank
                that is alive but misses a phase's deadline is left out of the
                process group, as the group does with any rank silent past an
                op's deadline.
            use_fp8: send FP8 e4m3 with one fp32 scale per token per 128
                channels (``mooncake.fp8``); ``H % 128 == 0``.
            async_finish: (bool) return at once; ``event.current_stream_wait()``
                finishes the receive and fills the outputs.
            return_recv_hook: (bool) return at once; ``hook()`` finishes the
                receive and fills the outputs (exclusive with ``async_finish``).
            cumulative_local_expert_recv_stats: optional int32 ``[E/R]``; the
                tokens each local expert received are added to it.

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``:

            * ``recv_x``: ``[E/R, R*T, H]`` of ``x``'s dtype, or with FP8 a
              pair ``(data float8_e4m3fn [E/R, R*T, H], scales float32
              [E/R, R*T, H/128])``. For local expert ``j``, rows
              ``[0, recv_count[j])`` hold its tokens grouped by source rank in
              rank order (token order within a source); later rows are
              undefined.
            * ``recv_count``: int32 ``[E/R]``.
            * ``handle``: a :class:`DispatchHandle` for :meth:`combine` and
              :meth:`get_next_combine_buffer`.
            * ``event``: an :class:`EventOverlap`.
            * ``hook``: with ``return_recv_hook=True`` a callable that
              finishes the receive; else None.

            Outputs are on ``x``'s device and valid on return, unless
            ``async_finish``/``return_recv_hook`` defer them.

        Raises:
            ValueError: an argument breaks a rule above (the message names it),
                or the ranks disagree on the call's shape; raised on every rank
                alike, and the group stays usable.
            mooncake.LeftOutError: this rank was left out of the group (a
                ``RuntimeError``; ``.ranks == [this rank]``).
        """
        R = self._call_ranks(num_experts)
        if self._device is not None and self._device.takes(x):
            return self._device.dispatch_call(
                self,
                x,
                topk_idx,
                active_ranks,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                timeout_us,
                use_fp8,
                async_finish,
                return_recv_hook,
                cumulative_local_expert_recv_stats,
            )
        self.path = "portable"
        error = self._dispatch_error(
            x,
            topk_idx,
            active_ranks,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            timeout_us,
            use_fp8,
            cumulative_local_expert_recv_stats,
            (async_finish, return_recv_hook),
        )
        ok = error is None
        device = x.device if ok else None
        epr = self._local_experts(num_experts, R)
        # Each exchange has the whole timeout_us from its own start: a peer that answered
        # the counts is not masked in the tokens exchange because the counts exchange spent
        # the budget waiting for another, silent, peer.
        budget = timeout_us if ok else -1
        mask = (
            (self._present(R) if active_ranks is None else active_ranks.cpu().bool())
            if ok
            else torch.zeros(R, dtype=torch.bool)
        )

        # 1. counts, shapes and consent
        meta = torch.zeros(R, fb.META_COLS + epr, dtype=torch.int64)
        if ok:
            T, H = num_max_dispatch_tokens_per_rank, x.shape[1]
            r = fb.route(topk_idx, R, epr)
            meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = T, H, num_experts, int(use_fp8)
            meta[:, fb.META_COLS :] = r.counts.cpu()
        meta[:, 4] = fb.STATUS_OK if ok else fb.STATUS_REJECTED
        meta[:, 5] = mask.long()
        meta = meta.to(device or "cpu")
        theirs = torch.zeros_like(meta)  # rows of ranks that send nothing stay 0
        try:
            self._all_to_all(device, theirs, meta, [1] * R, [1] * R, budget).wait()
        except ValueError as e:
            if error:
                raise ValueError(f"dispatch: {error}") from None
            raise ValueError(
                f"dispatch: ranks disagree on the call (a rank rejected its arguments, or they "
                f"pass different num_experts); nothing was sent: {e}"
            ) from None
        if error:
            raise ValueError(f"dispatch: {error}")
        theirs = theirs.cpu()
        present = self._present(R)
        self._check_peers(theirs, present, T, H, num_experts, use_fp8)
        mutual = mask & present & (theirs[:, 5] == 1)

        # 2. tokens
        sent = mutual.to(r.dest.device)[r.dest]
        rows, row_bytes = fb.pack_tokens(x, r, sent, use_fp8)
        buffer_counts = theirs[:, fb.META_COLS :] * mutual.unsqueeze(1).long()
        send_splits = (r.counts.cpu() * mutual.unsqueeze(1).long()).sum(1)
        recv_splits = buffer_counts.sum(1)
        recv = torch.empty(int(recv_splits.sum()), row_bytes, dtype=torch.uint8, device=device)
        work = self._all_to_all(device, recv, rows, recv_splits, send_splits, budget)

        if use_fp8:
            recv_x = (
                torch.empty(epr, R * T, H, dtype=torch.float8_e4m3fn, device=device),
                torch.empty(epr, R * T, H // 128, dtype=torch.float32, device=device),
            )
        else:
            recv_x = torch.empty(epr, R * T, H, dtype=x.dtype, device=device)
        recv_count = torch.zeros(epr, dtype=torch.int32, device=device)
        handle = DispatchHandle(
            torch.full((epr, R * T), -1, dtype=torch.int32, device=device),
            torch.zeros(epr, R, dtype=torch.int64, device=device),
            T,
            H,
            num_experts,
        )
        self._seq += 1
        handle._buffer, handle._seq = self._id, self._seq
        handle._route, handle._sent, handle._topk_idx = r, sent, topk_idx.clone()
        handle._send_splits, handle._recv_splits = send_splits, recv_splits
        handle._dtype = torch.bfloat16 if use_fp8 else x.dtype
        handle._num_tokens = x.shape[0]
        stats = cumulative_local_expert_recv_stats

        def finish() -> None:
            now = self._present(R)
            self._mark_failed(active_ranks, now)
            kept = (mutual & now).to(device)
            a = fb.place(recv, buffer_counts.to(device), kept, T)
            fb.unpack_tokens(recv, a, recv_x, x.dtype, H, use_fp8)
            handle.src_info[a.local_expert, a.column] = a.token.to(torch.int32)
            per_expert = a.counts.t()
            start = torch.cumsum(per_expert, 1) - per_expert
            handle.layout_range.copy_((start << 32) | per_expert)
            recv_count.copy_(per_expert.sum(1).to(torch.int32))
            if stats is not None:
                stats.add_(recv_count)
            handle._arrival, handle._recv_rows = a, recv.shape[0]

        pending = _Pending(work, finish)
        if not async_finish and not return_recv_hook:
            pending()
        event = EventOverlap(pending if async_finish else None)
        return recv_x, recv_count, handle, event, pending if return_recv_hook else None

    def _check_peers(self, theirs, present, T, H, E, use_fp8) -> None:
        """Raises ValueError, alike on every rank, when a member rejected its
        arguments or called with another shape; RuntimeError when a member's
        counts are out of range (corrupt data)."""
        for s in present.nonzero().squeeze(1).tolist():
            row = theirs[s].tolist()
            if row[4] == fb.STATUS_REJECTED:
                raise ValueError(
                    f"dispatch: rank {s} rejected its arguments (its ValueError says why); "
                    f"nothing was sent"
                )
            if row[:4] != [T, H, E, int(use_fp8)]:
                raise ValueError(
                    f"dispatch: ranks disagree on the call: rank {s} has "
                    f"num_max_dispatch_tokens_per_rank={row[0]}, hidden={row[1]}, "
                    f"num_experts={row[2]}, use_fp8={bool(row[3])}; rank {self.rank} has "
                    f"{T}, {H}, {E}, {use_fp8}"
                )
            # A source sends each of this rank's experts at most T tokens (a token
            # selects an expert once): more, or fewer than 0, is corrupt data, and
            # would size the receive buffers from it.
            counts = row[fb.META_COLS :]
            if counts and not (0 <= min(counts) and max(counts) <= T):
                raise RuntimeError(
                    f"dispatch: rank {s} announces between {min(counts)} and {max(counts)} "
                    f"tokens for this rank's experts, outside [0, "
                    f"num_max_dispatch_tokens_per_rank={T}]: its data is corrupt; nothing "
                    f"was received"
                )

    # --- combine -------------------------------------------------------------------------

    def get_next_combine_buffer(self, handle: DispatchHandle) -> torch.Tensor:
        """The tensor to write expert outputs into for ``combine(..., zero_copy=True)``.

        Args:
            handle: from this Buffer's latest or second-latest dispatch.

        Returns:
            ``[E/R, R*T, H]`` of the dispatch's dtype (bf16 with FP8), on the
            dispatch's device; one per half (even and odd calls), reused.

        Raises:
            ValueError: the handle is not from this Buffer, or two later
                dispatches have reused its half.
        """
        self._check_handle(handle, "get_next_combine_buffer")
        self._check_half(handle, "get_next_combine_buffer")
        half = handle._seq % 2
        shape = tuple(handle.src_info.shape) + (handle.hidden,)
        buf = self._combine_buffers[half]
        if (
            buf is None
            or tuple(buf.shape) != shape
            or buf.dtype != handle._dtype
            or buf.device != handle.src_info.device
        ):
            buf = torch.zeros(shape, dtype=handle._dtype, device=handle.src_info.device)
            self._combine_buffers[half] = buf
        return buf

    def _check_handle(self, handle, what: str) -> None:
        if not isinstance(handle, DispatchHandle) or not hasattr(handle, "_buffer"):
            raise ValueError(
                f"{what}: handle must be the DispatchHandle a dispatch returned, "
                f"got {type(handle).__name__}"
            )
        if handle._buffer != self._id:
            raise ValueError(f"{what}: handle comes from another Buffer's dispatch")
        if not hasattr(handle, "_arrival"):
            raise ValueError(
                f"{what}: handle's dispatch has not finished: call its hook() or "
                f"event.current_stream_wait() first"
            )

    def _check_half(self, handle, what: str) -> None:
        if self._seq - handle._seq >= 2:
            raise ValueError(
                f"{what}: handle is from dispatch #{handle._seq}, but dispatch #{self._seq} has "
                f"since reused its half of the buffer"
            )

    def _combine_error(
        self, x, topk_idx, topk_weights, active_ranks, timeout_us, handle, zero_copy, modes, out
    ) -> str | None:
        try:
            self._check_handle(handle, "combine")
        except ValueError as e:
            return str(e).removeprefix("combine: ")
        epr, cols = handle.src_info.shape
        device = handle.src_info.device
        n, k = handle._topk_idx.shape
        shape = [epr, cols, handle.hidden]
        checks = [
            _tensor_error("x", x, (handle._dtype,), 3, device, shape),
            _tensor_error("topk_idx", topk_idx, (torch.int64, torch.int32), 2, device, [n, k]),
            _tensor_error("topk_weights", topk_weights, _FLOAT_DTYPES, 2, device, [n, k]),
            None
            if active_ranks is None
            else _tensor_error(
                "active_ranks",
                active_ranks,
                (torch.int32,),
                1,
                device,
                [handle.layout_range.shape[1]],
            ),
            _timeout_error(timeout_us),
            _flags_error(zero_copy=zero_copy, async_finish=modes[0], return_recv_hook=modes[1]),
            None
            if not (modes[0] and modes[1])
            else "async_finish and return_recv_hook are exclusive: set one of them",
        ]
        for c in checks:
            if c:
                return c
        if not getattr(handle, "_on_device", False) and not torch.equal(
            topk_idx, handle._topk_idx.to(topk_idx.dtype)
        ):
            return "topk_idx differs from the one that handle's dispatch routed"
        if out is not None:
            err = _tensor_error("out", out, (x.dtype,), 2, device, [n, handle.hidden])
            if err:
                return err
        if zero_copy:
            try:
                self._check_half(handle, "combine")
            except ValueError as e:
                return str(e).removeprefix("combine: ")
            buf = self._combine_buffers[handle._seq % 2]
            if buf is None or x.data_ptr() != buf.data_ptr():
                return "with zero_copy=True, x must be get_next_combine_buffer(handle)"
        return None

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        active_ranks: torch.Tensor | None,
        timeout_us: int,
        handle: DispatchHandle,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
    ):
        """Sends expert outputs back and sums them per token with the top-k weights.

        Collective over the group's members, like :meth:`dispatch`.

        Args:
            x: ``[E/R, R*T, H]`` expert outputs in ``recv_x``'s layout (rows
                past ``recv_count`` are ignored); the dispatch's dtype.
            topk_idx: ``[N, K]``, the one passed to the dispatch.
            topk_weights: ``[N, K]`` float32 (bf16/fp16 accepted).
            active_ranks: int32 ``[R]`` as in :meth:`dispatch`. Outputs of
                experts on ranks marked 0 (or that die now) are skipped; ranks
                that die are set to 0. ``None``: the process group's view.
            timeout_us: as in :meth:`dispatch`; a combine is one exchange phase,
                so it waits at most ``timeout_us``.
            handle: the dispatch's :class:`DispatchHandle`.
            zero_copy: (bool) ``x`` is :meth:`get_next_combine_buffer` (handle).
            async_finish, return_recv_hook: as in :meth:`dispatch`.
            out: optional ``[N, H]`` of ``x``'s dtype, filled in place.

        Returns:
            ``(combined_x, event, hook)``: ``combined_x`` ``[N, H]`` of ``x``'s
            dtype (``out`` when given): per token, the sum over its top-k of
            ``weight * expert output``, skipping ``-1`` selections and experts
            on inactive ranks, accumulated in fp32 and rounded once.

        Raises:
            ValueError: an argument breaks a rule above (a handle from another
                Buffer, a ``topk_idx`` other than the dispatch's, wrong shapes,
                dtypes or devices); every rank takes part in the exchange, so
                the group stays usable.
            mooncake.LeftOutError: this rank was left out of the group (a
                ``RuntimeError``; ``.ranks == [this rank]``).
        """
        if isinstance(handle, DispatchHandle) and getattr(handle, "_on_device", False):
            return self._device.combine_call(
                self,
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
            )
        R = (
            handle.layout_range.shape[1]
            if isinstance(handle, DispatchHandle) and hasattr(handle, "_buffer")
            else self._call_ranks(None, "combine")
        )
        error = self._combine_error(
            x,
            topk_idx,
            topk_weights,
            active_ranks,
            timeout_us,
            handle,
            zero_copy,
            (async_finish, return_recv_hook),
            out,
        )
        if error:
            # Still take part in the exchange (sending and expecting nothing), so
            # that the others fail alike instead of waiting for this rank.
            empty = torch.empty(0, dtype=torch.uint8)
            try:
                self._all_to_all(None, empty, empty, [0] * R, [0] * R, -1).wait()
            except (ValueError, RuntimeError):
                pass
            raise ValueError(f"combine: {error}")
        device = x.device
        a = handle._arrival
        back = fb.gather_outputs(x, a, handle._recv_rows)
        sent_rows = int(handle._send_splits.sum())
        returned = torch.empty(sent_rows, x.shape[2], dtype=x.dtype, device=device)
        work = self._all_to_all(
            device, returned, back, handle._send_splits, handle._recv_splits, timeout_us
        )
        work = _Rephrased(
            work,
            "combine: ranks disagree on the call (a rank rejected its arguments, or they pass "
            "handles of different dispatches); nothing was combined",
        )
        mask = None if active_ranks is None else active_ranks.cpu().bool()
        result = (
            out
            if out is not None
            else torch.empty(handle._num_tokens, x.shape[2], dtype=x.dtype, device=device)
        )
        r, sent = handle._route, handle._sent

        def finish() -> None:
            now = self._present(R)
            self._mark_failed(active_ranks, now)
            alive = now if mask is None else now & mask
            used = alive.to(device)[r.dest[sent]]
            acc = fb.weighted_sum(returned, r, sent, used, topk_weights, handle._num_tokens)
            result.copy_(acc)

        pending = _Pending(work, finish)
        if not async_finish and not return_recv_hook:
            pending()
        event = EventOverlap(pending if async_finish else None)
        return result, event, pending if return_recv_hook else None
