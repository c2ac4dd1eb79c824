"""Reference implementations the distributed results are compared against.

Everything here is local (no process group): deterministic per-rank inputs,
reductions that follow the library's documented arithmetic, and an exact
(bit-for-bit) comparison.

The arithmetic contract (what makes exact comparison possible):

* reductions combine contributions in rank order 0..N-1 on every rank;
* float32/float64 accumulate in their own precision; float16/bfloat16
  accumulate in float32 and are rounded once at the end;
* AVG is that sum divided by N, then rounded;
* integers wrap around (two's complement), as torch does;
* bool SUM/MAX/BOR are OR, PRODUCT/MIN/BAND are AND, BXOR is XOR;
* complex tensors are reduced as pairs of floats (SUM and AVG only).
"""

from __future__ import annotations

import operator
import zlib

import torch

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)
#: Every real dtype the backend supports.
DTYPES = (torch.bool, *INT_DTYPES, *FLOAT_DTYPES)

FLOAT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
INT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
COMPLEX_OPS = ("SUM", "AVG")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


def reduce_ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The reduce ops the backend defines for ``dtype`` (names of ``dist.ReduceOp``)."""
    if dtype.is_complex:
        return COMPLEX_OPS
    if dtype.is_floating_point:
        return FLOAT_OPS
    return INT_OPS


def unsupported_ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    """Reduce ops that must be rejected with ValueError for ``dtype``."""
    return tuple(op for op in (*FLOAT_OPS, *INT_OPS) if op not in reduce_ops_for(dtype))


def seed_of(*parts: object) -> int:
    """A stable 31-bit seed from any printable parts (case name, rank, tag)."""
    return zlib.crc32("|".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


_INT_RANGES = {
    torch.uint8: (0, 256),
    torch.int8: (-128, 128),
    torch.int16: (-(2**15), 2**15),
    torch.int32: (-(2**31), 2**31),
    torch.int64: (-(2**62), 2**62),
}


def make_tensor(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A deterministic contiguous CPU tensor of ``shape`` and ``dtype``.

    Integers span (most of) their type's range so that sums and products
    wrap; floats are standard normal (so products neither overflow nor
    vanish for the world sizes tested); bools are fair coin flips.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    if dtype in _INT_RANGES:
        lo, hi = _INT_RANGES[dtype]
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)
    if dtype.is_complex:
        real = torch.float64 if dtype == torch.complex128 else torch.float32
        return torch.randn((*shape, 2), generator=gen, dtype=real).view(dtype).reshape(shape)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


_ARITH = {"SUM": operator.add, "PRODUCT": operator.mul, "MIN": torch.minimum, "MAX": torch.maximum}
_BITWISE = {"BAND": operator.and_, "BOR": operator.or_, "BXOR": operator.xor}
#: Per kind of dtype, each op's element-wise combination (bool: SUM/MAX are OR, PRODUCT/MIN AND).
_COMBINE_BOOL = {"SUM": operator.or_, "MAX": operator.or_, "PRODUCT": operator.and_,
                 "MIN": operator.and_, **_BITWISE}  # fmt: skip
_COMBINE_FLOAT = {**_ARITH, "AVG": operator.add}
_COMBINE_OTHER = {**_ARITH, **_BITWISE}  # integers (and complex, where MIN/MAX fail)


def _combine(op: str, acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if acc.dtype == torch.bool:
        table = _COMBINE_BOOL
    elif acc.dtype.is_floating_point:
        table = _COMBINE_FLOAT
    else:
        table = _COMBINE_OTHER
    if op not in table:
        raise ValueError(f"reference: op {op} is not defined for {acc.dtype}")
    return table[op](acc, x)


def reduce_ref(contributions: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of ``contributions`` (rank order), as the backend computes it.

    Args:
        contributions: one tensor per rank, all of the same shape and dtype.
        op: a ``dist.ReduceOp`` name (``"SUM"``, ``"AVG"``, ...).

    Returns:
        A contiguous tensor of the contributions' shape and dtype.
    """
    dtype = contributions[0].dtype
    n = len(contributions)
    if dtype.is_complex:
        parts = [torch.view_as_real(c.contiguous()) for c in contributions]
        return torch.view_as_complex(reduce_ref(parts, op).contiguous())
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = contributions[0].to(acc_dtype).clone()
    for x in contributions[1:]:
        acc = _combine(op, acc, x.to(acc_dtype))
    if op == "AVG":
        acc = acc / torch.tensor(n, dtype=acc_dtype)
    return acc.to(dtype).contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.dtype.is_floating_point:
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.view(width)
    return t


def mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when ``actual`` equals ``expected`` bit for bit; else a description.

    When ``expected`` is 1-D and the element counts agree, ``actual`` is
    compared flattened (callers pass flat references for shaped outputs).
    """
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != expected {expected.dtype}"
    if actual.shape != expected.shape:
        if expected.dim() != 1 or actual.numel() != expected.numel():
            return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    n = expected.numel()
    if n == 0:
        return None
    a = _bits(actual).reshape(n, -1)
    e = _bits(expected).reshape(n, -1)
    differ = (a != e).any(dim=1)
    if not differ.any():
        return None
    bad = differ.nonzero().flatten().tolist()
    flat_a, flat_e = actual.reshape(-1), expected.reshape(-1)
    shown = ", ".join(f"[{i}] {flat_a[i].item()!r} != {flat_e[i].item()!r}" for i in bad[:4])
    return f"{len(bad)} of {n} elements differ: {shown}"
