"""A mixture-of-experts layer over expert parallelism, checked against a dense reference.

    python examples/moe_layer.py            # 4 local CPU ranks, BF16 and FP8 dispatch
    python examples/moe_layer.py --world 2

Each rank holds ``E / R`` experts (two-layer SiLU MLPs) and its own tokens. A
router picks the top-k experts of every token; ``Buffer.dispatch`` sends each
token to the ranks holding its experts; every rank runs its local experts on
what it received; ``Buffer.combine`` sends the outputs back and sums them with
the router's weights. A single process then computes the same layer densely
(every expert on every token it selected) and the two must agree: exactly up
to the order of an fp32 sum with BF16 dispatch, and within FP8's rounding with
FP8 dispatch. The exit code is 0 only when both agree.
"""

from __future__ import annotations

import argparse
import sys

import torch

HIDDEN, FFN, EXPERTS_PER_RANK, TOP_K, TOKENS = 256, 512, 4, 3, 24
SEED = 1234


def make_experts(num_experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every expert's weights (w1 [H, F], w2 [F, H]), the same in every process."""
    g = torch.Generator().manual_seed(SEED)
    scale1, scale2 = HIDDEN**-0.5, FFN**-0.5
    return [
        (
            torch.randn(HIDDEN, FFN, generator=g) * scale1,
            torch.randn(FFN, HIDDEN, generator=g) * scale2,
        )
        for _ in range(num_experts)
    ]


def make_router(num_experts: int) -> torch.Tensor:
    return torch.randn(HIDDEN, num_experts, generator=torch.Generator().manual_seed(SEED + 1))


def tokens_of(rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens, bf16 [TOKENS, H]."""
    g = torch.Generator().manual_seed(SEED + 100 + rank)
    return torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)


def route(x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids (int64 [N, K]) and their softmax weights (float32 [N, K])."""
    scores = x.float() @ router
    top = torch.topk(scores, TOP_K, dim=-1)
    return top.indices, torch.softmax(top.values, dim=-1)


def expert_mlp(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One expert on bf16 tokens: computed in fp32, returned in bf16."""
    w1, w2 = w
    return (torch.nn.functional.silu(x.float() @ w1) @ w2).to(torch.bfloat16)


def dense_reference(
    x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts
) -> torch.Tensor:
    """The layer without any communication: every selected expert on every token."""
    out = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for k in range(TOP_K):
            e = int(idx[t, k])
            out[t] += weights[t, k] * expert_mlp(x[t : t + 1], experts[e])[0].float()
    return out.to(torch.bfloat16)


def moe_rank(rank: int, world_size: int, port: int) -> list[torch.Tensor]:
    """One rank: route, dispatch, run the local experts, combine; with BF16, then FP8
    dispatch. Returns the layer's output for this rank's tokens, once per format."""
    import torch.distributed as dist

    from mooncake import fp8
    from mooncake.launch import init_rank
    from mooncake.mooncake_ep_buffer import Buffer

    init_rank(rank, world_size, port)
    num_experts = EXPERTS_PER_RANK * world_size
    experts = make_experts(num_experts)
    x = tokens_of(rank)
    idx, weights = route(x, make_router(num_experts))

    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, world_size, num_experts)
    buffer = Buffer(dist.group.WORLD, size)
    outputs = []
    for use_fp8 in (False, True):
        recv_x, recv_count, handle, event, _ = buffer.dispatch(
            x, idx, None, TOKENS, num_experts, timeout_us=-1, use_fp8=use_fp8
        )
        event.current_stream_wait()
        if use_fp8:  # an FP8-aware expert kernel would take (data, scales) as they are
            recv_x = fp8.dequantize(*recv_x).to(torch.bfloat16)
        expert_out = torch.zeros(recv_x.shape, dtype=torch.bfloat16)
        for j in range(EXPERTS_PER_RANK):
            n = int(recv_count[j])
            expert_out[j, :n] = expert_mlp(recv_x[j, :n], experts[rank * EXPERTS_PER_RANK + j])
        combined, event, _ = buffer.combine(expert_out, idx, weights, None, -1, handle)
        event.current_stream_wait()
        outputs.append(combined)
    dist.destroy_process_group()
    return outputs


def run(world_size: int) -> list[float]:
    """Runs the layer on ``world_size`` local ranks; returns, for BF16 and FP8 dispatch,
    the largest error relative to the dense reference's largest value."""
    from mooncake.launch import run_local

    got = run_local(moe_rank, world_size, env={"OMP_NUM_THREADS": "1"})
    experts = make_experts(EXPERTS_PER_RANK * world_size)
    router = make_router(EXPERTS_PER_RANK * world_size)
    worst = [0.0, 0.0]
    for rank in range(world_size):
        x = tokens_of(rank)
        idx, weights = route(x, router)
        ref = dense_reference(x, idx, weights, experts).float()
        for f in range(2):
            err = (got[rank][f].float() - ref).abs().max().item() / ref.abs().max().item()
            worst[f] = max(worst[f], err)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="number of local ranks (default 4)")
    args = parser.parse_args()
    # BF16: the same roundings as the reference, only the fp32 sum order differs.
    # FP8: 3 mantissa bits on the way in (relative error up to 2**-4 per value).
    ok = True
    for name, err, bound in zip(("BF16", "FP8 "), run(args.world), (1e-2, 0.15), strict=True):
        good = err <= bound
        ok &= good
        print(
            f"MoE layer over {args.world} ranks, {EXPERTS_PER_RANK * args.world} experts, "
            f"top-{TOP_K}, {name} dispatch: max error vs dense reference {err:.2e} "
            f"(bound {bound:g}) {'OK' if good else 'FAILED'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
