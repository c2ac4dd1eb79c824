"""The sparse MoE blocks of transformers' Mixtral and Qwen2-MoE with their experts
spread over ranks by ``Buffer``, checked against the blocks themselves.

    python examples/hf_moe.py            # 4 local CPU ranks
    python examples/hf_moe.py --world 2

Needs ``transformers`` (``pip install -r requirements-dev.txt``). Nothing is
downloaded: each block is built from a small config with random weights, the
same in every process.

What an engine serving such a model with expert parallelism does, in
``ExpertParallelMoE``: every rank keeps ``E / R`` of the block's experts and
its own tokens. It runs the block's router on its tokens; ``Buffer.dispatch``
sends each token to the ranks holding its top-k experts; each rank runs its
experts on what it received; ``Buffer.combine`` sends the outputs back and sums
them with the router's weights. Dense parts (Qwen2-MoE's shared expert) run on
every rank, on its own tokens, without communication.

The parent then runs the unsharded block from transformers on each rank's
tokens, with the same weights, and compares. The exit code is 0 only when
every case agrees.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

try:
    import transformers
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
except ImportError as e:
    sys.exit(f"examples/hf_moe.py needs transformers (pip install -r requirements-dev.txt): {e}")
if int(transformers.__version__.split(".")[0]) < 5:  # 5 keeps experts as 3-D weights
    sys.exit(f"examples/hf_moe.py needs transformers 5, found {transformers.__version__}")

HIDDEN, EXPERTS, BATCH, SEQ = 256, 16, 2, 16
TOKENS = BATCH * SEQ  # per rank and forward: Buffer's T
SEED = 1234

# Two routers that differ where it matters: Mixtral renormalises its top-k
# probabilities and keeps them in fp32; Qwen2-MoE (norm_topk_prob=False) does
# not, casts them to the model's dtype, and adds a gated shared expert.
MODELS = {
    "Mixtral": lambda: MixtralSparseMoeBlock(
        MixtralConfig(
            hidden_size=HIDDEN,
            intermediate_size=512,
            num_local_experts=EXPERTS,
            num_experts_per_tok=2,
            experts_implementation="eager",
        )
    ),
    "Qwen2-MoE": lambda: Qwen2MoeSparseMoeBlock(
        Qwen2MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=512,
            num_experts=EXPERTS,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            experts_implementation="eager",
        )
    ),
}
# Errors are relative to the largest output value. fp32: the same products as
# the block, summed in another order (the block adds experts in id order,
# combine in top-k order): a few fp32 roundings (2**-24), far below 1e-5, which
# still catches any bf16 rounding (2**-9) or misrouted token (~1).
# bf16: the block rounds each weighted expert output to bf16 and adds in bf16;
# combine sums in fp32 and rounds once: with top-4, about ten roundings of at
# most 2**-9 each (2e-2) in the worst case.
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_block(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers block ``name`` with random weights, the same in every process."""
    block = MODELS[name]()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # outside from_pretrained, transformers leaves them uninitialised
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return block.to(dtype).eval()


def tokens_of(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s hidden states, [BATCH, SEQ, H] as the block takes them."""
    g = torch.Generator().manual_seed(SEED + 100 + rank)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype)


class SpreadExperts(torch.nn.Module):
    """A transformers sparse MoE block whose experts are spread over ``buffer``'s
    ranks: this rank keeps experts ``[rank * E/R, (rank + 1) * E/R)``; a subclass's
    forward moves the tokens to them and back (hf_moe_prefill.py has another)."""

    def __init__(self, block, buffer, rank: int, world_size: int):
        super().__init__()
        # The block's own router: the same softmax, top-k, renormalisation and
        # weight dtype as the block, so the two route every token alike.
        self.gate = block.gate
        self.num_experts = block.experts.num_experts
        self.num_local = self.num_experts // world_size
        mine = slice(rank * self.num_local, (rank + 1) * self.num_local)
        # transformers keeps all experts in two 3-D weights, [E, 2F, H] (gate and
        # up, concatenated) and [E, H, F]; a real engine loads only its slice.
        self.gate_up_proj = block.experts.gate_up_proj[mine].detach().clone()
        self.down_proj = block.experts.down_proj[mine].detach().clone()
        self.act_fn = block.experts.act_fn
        self.shared_expert = getattr(block, "shared_expert", None)
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)
        self.buffer = buffer

    def with_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the block's shared expert on ``x``, where it has one (dense: every
        rank, its own tokens)."""
        if self.shared_expert is None:
            return y
        return y + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class ExpertParallelMoE(SpreadExperts):
    """SpreadExperts through the low-latency ``Buffer``: at most ``max_tokens`` tokens
    per rank and call."""

    def __init__(self, block, buffer, rank: int, world_size: int, max_tokens: int):
        super().__init__(block, buffer, rank, world_size)
        self.max_tokens = max_tokens

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [N, H]: Buffer moves tokens as rows
        # The router returns (logits, top-k weights, top-k ids). idx: int64 [N, K] global
        # expert ids; weights: [N, K] fp32 (Mixtral) or the model's dtype (Qwen2-MoE):
        # combine takes either.
        _, weights, idx = self.gate(x)
        # use_fp8=False moves x in its own dtype, so the check below can be tight.
        # timeout_us=-1: no EP deadline. An engine sets one (say 2_000_000) so that
        # a dead rank is masked instead of stalling the step; a loaded test machine
        # could stall a healthy rank that long.
        recv_x, recv_count, handle, _, _ = self.buffer.dispatch(
            x,
            idx,
            active_ranks=None,  # the group's health mask
            num_max_dispatch_tokens_per_rank=self.max_tokens,
            num_experts=self.num_experts,
            timeout_us=-1,
            use_fp8=False,
        )
        # recv_x is [E/R, R*T, H]: for local expert j, rows [0, recv_count[j]) are
        # its tokens from every rank; combine ignores the rows past them.
        out = torch.empty_like(recv_x)
        for j in range(self.num_local):
            n = int(recv_count[j])  # an engine's grouped GEMM would take the counts as they are
            gate, up = F.linear(recv_x[j, :n], self.gate_up_proj[j]).chunk(2, dim=-1)
            out[j, :n] = F.linear(self.act_fn(gate) * up, self.down_proj[j])
        # Back to the tokens' ranks, each token's K outputs summed with its weights.
        y, _, _ = self.buffer.combine(
            out, idx, weights, active_ranks=None, timeout_us=-1, handle=handle
        )
        return self.with_shared(x, y).reshape(shape)


def rank_main(rank: int, world_size: int, port: int) -> dict:
    """One rank: every model in both dtypes; returns the outputs for its tokens."""
    import torch.distributed as dist

    from mooncake.launch import init_rank
    from mooncake.mooncake_ep_buffer import Buffer

    init_rank(rank, world_size, port)
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, world_size, EXPERTS)
    buffer = Buffer(dist.group.WORLD, size)  # one per process, reused by every layer
    outputs = {}
    with torch.inference_mode():
        for name in MODELS:
            for dtype in BOUNDS:
                layer = ExpertParallelMoE(make_block(name, dtype), buffer, rank, world_size, TOKENS)
                outputs[name, dtype] = layer(tokens_of(rank, dtype))
    dist.destroy_process_group()
    return outputs


def main() -> int:
    from mooncake.launch import run_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="number of local ranks (default 4)")
    args = parser.parse_args()
    got = run_local(rank_main, args.world, env={"OMP_NUM_THREADS": "1"})
    return 0 if check_against_blocks(got, args.world, tokens_of) else 1


def check_against_blocks(got, world: int, tokens_of, device: str = "cpu", shape: str = "") -> bool:
    """Runs each unsharded block (the ranks' weights) on every rank's tokens
    (``tokens_of(rank, dtype)``) on ``device``, compares with the ranks' outputs
    ``got[rank][name, dtype]`` and prints a line per case (``shape`` after the ranks);
    True when every case is within its bound."""
    ok = True
    torch.set_num_threads(1)  # as in the ranks: at this size more threads only contend
    # (by 100x on a busy machine)
    with torch.inference_mode():
        for name in MODELS:
            for dtype, bound in BOUNDS.items():
                block = make_block(name, dtype).to(device)  # unsharded, the ranks' weights
                err = 0.0
                for rank in range(world):
                    ref = block(tokens_of(rank, dtype)).float().cpu()
                    diff = (got[rank][name, dtype].float() - ref).abs().max()
                    err = max(err, (diff / ref.abs().max()).item())
                good = err <= bound
                ok &= good
                print(
                    f"{name} block, {EXPERTS} experts over {world} ranks{shape}, "
                    f"{str(dtype).removeprefix('torch.')}: max error vs transformers {err:.2e} "
                    f"(bound {bound:g}) {'OK' if good else 'FAILED'}"
                )
    return ok


if __name__ == "__main__":
    sys.exit(main())
