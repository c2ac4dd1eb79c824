"""Prefill through ``ElasticBuffer``: the sparse MoE blocks of transformers' Mixtral and
Qwen2-MoE on 1,024 tokens per rank, their experts spread over the ranks, checked
against the blocks themselves.

    python examples/hf_moe_prefill.py                  # 4 local CPU ranks
    python examples/hf_moe_prefill.py --world 2
    python examples/hf_moe_prefill.py --device cuda    # the ranks share the GPU(s)

The prefill sibling of ``examples/hf_moe.py``, with the same blocks (small configs,
random weights, the same in every process; nothing is downloaded; needs
``transformers`` 5). Where ``hf_moe.py`` serves decode through the low-latency
``Buffer`` (``recv_x`` padded to ``[E/R, R*T, H]``), this runs a prefill-sized batch
through the high-throughput ``ElasticBuffer`` (``docs/elastic-buffer.md``), which
receives one row per token:

1. each rank runs the block's router on its own tokens (``[N, H]``, N = 1,024);
2. ``ElasticBuffer.dispatch`` sends each token once to every rank holding one of its
   top-k experts: ``recv_x`` ``[M, H]``, ``recv_topk_idx`` ``[M, K]`` (local expert
   ids, -1 for experts elsewhere) and ``recv_topk_weights`` ``[M, K]``;
3. each rank runs its local experts on the rows that selected them and applies the
   router's weights itself (``combine`` does not);
4. ``ElasticBuffer.combine`` sends each row back to its token's rank and sums there.

Dense parts (Qwen2-MoE's shared expert) run on each rank on its own tokens. With
``--device cuda`` the ranks join a ``mooncake`` group and move CUDA tensors (the
CUDA backend's exchange); run several ranks on one GPU under MPS. The parent then
runs the unsharded block on each rank's tokens, on the same device, and compares
(bounds as ``hf_moe.py``'s). The exit code is 0 only when every case agrees.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn.functional as F

# The blocks, their weights and the error bounds are hf_moe.py's (this directory is on
# sys.path when the example runs, and in its ranks).
from hf_moe import BOUNDS, HIDDEN, MODELS, SEED, SpreadExperts, check_against_blocks, make_block

BATCH, SEQ = 4, 256
TOKENS = BATCH * SEQ  # per rank and forward: 1,024, the ElasticBuffer's T
TOPK = 4  # the largest top-k of the two blocks (Mixtral 2, Qwen2-MoE 4): the buffer's num_topk


def tokens_of(rank: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rank ``rank``'s hidden states, ``[BATCH, SEQ, H]``, the same in every process."""
    g = torch.Generator().manual_seed(SEED + 200 + rank)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype).to(device)


class PrefillMoE(SpreadExperts):
    """SpreadExperts through ``ElasticBuffer``: one row per token and destination rank
    (the prefill layout)."""

    def experts(self, recv_x, recv_idx, recv_w) -> torch.Tensor:
        """This rank's experts on the rows it received. ``recv_x`` ``[M, H]``, ``recv_idx``
        ``[M, K]`` local ids (-1: elsewhere), ``recv_w`` float32 ``[M, K]``. Returns
        ``[M, H]`` in ``recv_x``'s dtype: per row, the weighted sum of its local experts'
        outputs (summed in fp32, rounded once)."""
        out = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
        for j in range(self.num_local):
            rows, slots = (recv_idx == j).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue  # an engine's grouped GEMM takes every expert's rows at once
            gate, up = F.linear(recv_x[rows], self.gate_up_proj[j]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[j])
            out.index_add_(0, rows, y.float() * recv_w[rows, slots].unsqueeze(1))
        return out.to(recv_x.dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [N, H]
        # idx: int64 [N, K] global expert ids; weights: [N, K] fp32 (Mixtral) or the
        # model's dtype (Qwen2-MoE): the buffer carries float32 weights.
        _, weights, idx = self.gate(x)
        # x moves in its own dtype (no FP8), so the check below can be tight. The default
        # do_cpu_sync=True sizes the outputs exactly (M rows).
        recv_x, recv_idx, recv_w, handle, _ = self.buffer.dispatch(
            x, idx, weights.float(), num_experts=self.num_experts
        )
        y, _, _ = self.buffer.combine(self.experts(recv_x, recv_idx, recv_w), handle)
        return self.with_shared(x, y).reshape(shape)


def rank_main(rank: int, world_size: int, port: int, device: str) -> dict:
    """One rank: every model in both dtypes; returns its outputs (on the CPU)."""
    import torch.distributed as dist

    from mooncake.launch import init_rank
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    init_rank(rank, world_size, port, "mooncake" if device == "cuda" else "mooncake-cpu")
    # One buffer per process, reused by every layer. Collective.
    buffer = ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK
    )
    outputs = {}
    with torch.inference_mode():
        for name in MODELS:
            for dtype in BOUNDS:
                layer = PrefillMoE(make_block(name, dtype).to(device), buffer, rank, world_size)
                outputs[name, dtype] = layer(tokens_of(rank, dtype, device)).cpu()
    buffer.destroy()
    dist.destroy_process_group()
    return outputs


def main() -> int:
    from mooncake.launch import run_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="number of local ranks (default 4)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("examples/hf_moe_prefill.py --device cuda: no CUDA GPU visible to torch")
    got = run_local(
        rank_main, args.world, args=(args.device,), env={"OMP_NUM_THREADS": "1"}, timeout_s=600
    )
    tokens = functools.partial(tokens_of, device=args.device)
    shape = f", {TOKENS} tokens per rank"
    return 0 if check_against_blocks(got, args.world, tokens, args.device, shape) else 1


if __name__ == "__main__":
    sys.exit(main())
