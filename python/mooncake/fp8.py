"""FP8 (e4m3) per-token, per-128-channel quantisation, as EP dispatch sends it.

For a token ``x`` (one row of ``hidden`` channels), each block of 128 channels
gets one fp32 scale ``s = max(amax(block), 1e-4) / 448`` and is stored as
``saturate(x * (448 / max(amax, 1e-4)))`` in ``torch.float8_e4m3fn`` (448 is e4m3's largest finite
value; saturating means values are clamped to ``[-448, 448]`` before the cast,
so nothing becomes NaN). Dequantising is ``data.float() * s``.

Error bound: e4m3 keeps 3 mantissa bits, so a value ``v`` in a block with
scale ``s`` comes back within ``|v| * 2**-4 + s * 2**-9`` (half a unit in the
last place of a normal number, or of the smallest subnormal, 2**-9). The tests
check exactly this bound.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantises rows of ``x``.

    Args:
        x: ``[N, H]`` floating point (bf16, fp16 or fp32), ``H % 128 == 0``.

    Returns:
        ``(data, scales)``: ``data`` ``[N, H]`` ``torch.float8_e4m3fn`` and
        ``scales`` ``[N, H / 128]`` float32, on ``x``'s device.
    """
    n, h = x.shape
    blocks = x.float().reshape(n, h // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scales = amax / E4M3_MAX
    # x * (448 / amax), both IEEE fp32 operations, as the device kernel computes it
    # (a tensor divisor: `scalar / tensor` would take the reciprocal, then multiply).
    inv = torch.full_like(amax, E4M3_MAX) / amax
    data = (blocks * inv.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data.reshape(n, h), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize`, in float32.

    Args:
        data: ``[..., H]`` ``torch.float8_e4m3fn``.
        scales: ``[..., H / 128]`` float32.

    Returns:
        ``[..., H]`` float32.
    """
    shape = data.shape
    blocks = data.float().reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    return (blocks * scales.unsqueeze(-1)).reshape(shape)


def error_bound(reference: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per element, how far :func:`dequantize` may land from ``reference``.

    Args:
        reference: ``[..., H]`` the values that were quantised.
        scales: ``[..., H / 128]`` their scales.
    """
    ref = reference.float()
    shape = ref.shape
    s = scales.unsqueeze(-1).expand(*shape[:-1], shape[-1] // BLOCK, BLOCK).reshape(shape)
    return ref.abs() * 2.0**-4 + s * 2.0**-9
