"""Deterministic per-rank inputs and fp64 / exact-integer references.

Imported both by the test process (to build references) and by the ranks (to build their
inputs), so both sides see bit-identical inputs for the same (rank, case) seed.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["int8", "int16", "int32", "int64", "uint8"]
REDUCE_DTYPES = FLOATS + INTS + ["bool"]
MOVE_DTYPES = REDUCE_DTYPES + ["complex64"]
SIXTEEN = ("float16", "bfloat16")

OPS_FLOAT = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
OPS_INT = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
OPS_BOOL = ["SUM", "PRODUCT", "MIN", "MAX"]
PREMUL_FACTOR = 0.5


def ops_for(dtype: str) -> list:
    if dtype in FLOATS:
        return OPS_FLOAT
    if dtype == "bool":
        return OPS_BOOL
    return OPS_INT


def dt(name: str) -> torch.dtype:
    return getattr(torch, name)


def redop(name: str, factor: float = PREMUL_FACTOR):
    """The ReduceOp for ``name``; PREMUL_SUM goes through ``dist._make_nccl_premul_sum``."""
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, name)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def make_input(rank: int, n, dtype: str, op: str = "SUM", case: str = "") -> torch.Tensor:
    """Deterministic tensor of shape ``n`` (int or tuple) for ``rank``.

    Value ranges are chosen so that integer reductions over <= 4 ranks never overflow and
    16-bit float products stay normal; the values are exactly representable in ``dtype``.
    """
    shape = (n,) if isinstance(n, int) else tuple(n)
    g = torch.Generator().manual_seed(_seed(rank, shape, dtype, op, case))
    numel = math.prod(shape)
    if dtype in FLOATS:
        if op == "PRODUCT":
            mag = torch.rand(numel, generator=g, dtype=torch.float64) + 0.5
            sign = torch.randint(0, 2, (numel,), generator=g) * 2 - 1
            x = mag * sign
        else:
            x = torch.rand(numel, generator=g, dtype=torch.float64) * 2 - 1
        return x.to(dt(dtype)).reshape(shape)
    if dtype == "complex64":
        x = torch.rand(numel, 2, generator=g, dtype=torch.float64) * 2 - 1
        return torch.view_as_complex(x.to(torch.float32).contiguous()).reshape(shape)
    if dtype == "bool":
        # a bit denser in True so AND is not always False
        return (torch.rand(numel, generator=g) < 0.7).reshape(shape)
    info = torch.iinfo(dt(dtype))
    if op in ("BAND", "BOR", "BXOR", "MIN", "MAX", "MOVE"):  # full range: random bytes
        size = torch.empty((), dtype=dt(dtype)).element_size()
        raw = torch.randint(0, 256, (numel * size,), generator=g, dtype=torch.uint8)
        return raw.view(dt(dtype)).reshape(shape).clone()
    if op == "PRODUCT":
        lo, hi = (0, 3) if dtype == "uint8" else (-3, 3)
    else:  # SUM / AVG
        lo, hi = (0, 20) if dtype == "uint8" else (-10, 10)
    x = torch.randint(lo, hi + 1, (numel,), generator=g, dtype=torch.int64)
    return x.to(dt(dtype)).reshape(shape)


# ---------------------------------------------------------------- references
def reference(inputs: Sequence[torch.Tensor], op: str, factor: float = PREMUL_FACTOR):
    """Exact (integers, bool, MIN/MAX) or fp64 (floats) reduction of ``inputs``.

    Returns (ref, scale) where ``scale`` is the elementwise magnitude bound used by the
    tolerance (sum |x| for sums, prod |x| for products; None for exact ops).
    """
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        st = torch.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return st.any(0), None
        if op in ("PRODUCT", "MIN", "BAND"):
            return st.all(0), None
        if op == "BXOR":
            return (st.to(torch.int64).sum(0) % 2).bool(), None
        raise ValueError(op)
    if dtype.is_floating_point:
        st = torch.stack([t.to(torch.float64) for t in inputs])
        n = len(inputs)
        if op == "SUM":
            return st.sum(0), st.abs().sum(0)
        if op == "AVG":
            return st.sum(0) / n, st.abs().sum(0) / n
        if op == "PREMUL_SUM":
            return (st * factor).sum(0), (st * factor).abs().sum(0)
        if op == "PRODUCT":
            return st.prod(0), st.abs().prod(0)
        if op == "MIN":
            return st.min(0).values, None
        if op == "MAX":
            return st.max(0).values, None
        raise ValueError(op)
    st = torch.stack([t.to(torch.int64) for t in inputs])
    if op == "SUM":
        r = st.sum(0)
    elif op == "PRODUCT":
        r = st.prod(0)
    elif op == "MIN":
        r = st.min(0).values
    elif op == "MAX":
        r = st.max(0).values
    elif op in ("BAND", "BOR", "BXOR"):
        f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        r = st[0]
        for t in st[1:]:
            r = f(r, t)
    else:
        raise ValueError(op)
    info = torch.iinfo(dtype)
    assert bool(((r >= info.min) & (r <= info.max)).all()), "test inputs overflow the dtype"
    return r.to(dtype), None


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (fp64 tensor), never below the smallest normal spacing."""
    fi = torch.finfo(dtype)
    ax = x.abs().clamp_min(fi.tiny)
    return torch.pow(2.0, torch.floor(torch.log2(ax))) * fi.eps


def tolerance(ref: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype, n: int,
              op: str, strict16: bool) -> torch.Tensor:
    """Allowed |result - ref| for a float reduction over ``n`` ranks.

    fp32/fp64: (n-1) * eps(dtype) * scale (+ one rounding of the final value for AVG/PREMUL).
    16-bit, strict (xirang, SUM/AVG/PREMUL_SUM): the fp32 result rounded once ->
        (n-1) * eps(fp32) * scale + 1 ulp(dtype).
    16-bit otherwise (gloo, or PRODUCT): every hop rounds to the 16-bit type ->
        n * eps(dtype) * scale + 1 ulp(dtype).
    """
    if scale is None:
        return torch.zeros_like(ref)
    if dtype in (torch.float16, torch.bfloat16):
        u = ulp(ref, dtype)
        if strict16 and op in ("SUM", "AVG", "PREMUL_SUM"):
            return (n - 1) * torch.finfo(torch.float32).eps * scale + u
        return n * torch.finfo(dtype).eps * scale + u
    eps = torch.finfo(dtype).eps
    extra = 1 if op in ("AVG", "PREMUL_SUM") else 0
    return (max(n - 1, 0) + extra) * eps * scale + (extra * eps * ref.abs())


def assert_reduced(result: torch.Tensor, inputs: Sequence[torch.Tensor], op: str, *,
                   strict16: bool, what: str = "") -> None:
    """``result`` equals the reduction of ``inputs`` under ``op`` within the suite's bounds."""
    ref, scale = reference(inputs, op)
    assert result.dtype == inputs[0].dtype, f"{what}: dtype {result.dtype} != {inputs[0].dtype}"
    assert result.shape == inputs[0].shape, f"{what}: shape {tuple(result.shape)} != {tuple(inputs[0].shape)}"
    if scale is None:
        if not torch.equal(result, ref):
            bad = (result != ref).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{what}: {op} not exact at {bad}: got {result.flatten()[bad].tolist()} "
                                 f"want {ref.flatten()[bad].tolist()}")
        return
    tol = tolerance(ref, scale, result.dtype, len(inputs), op, strict16)
    err = (result.to(torch.float64) - ref).abs()
    if not bool((err <= tol).all()):
        i = int(torch.argmax(err - tol))
        raise AssertionError(
            f"{what}: {op} {result.dtype} ws={len(inputs)} off by {err.flatten()[i].item():.3g} "
            f"> tol {tol.flatten()[i].item():.3g} at [{i}] (got {result.flatten()[i].item()!r}, "
            f"ref {ref.flatten()[i].item()!r})")


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a, b = a.contiguous(), b.contiguous()
    return torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                       b.view(torch.uint8) if b.dtype != torch.bool else b)


def assert_identical_across_ranks(results: Sequence[torch.Tensor], what: str = "") -> None:
    for r, t in enumerate(results[1:], 1):
        assert bitwise_equal(results[0], t), f"{what}: rank {r} result differs bitwise from rank 0"


# ---------------------------------------------------------------- what gloo (torch 2.13) serves
def gloo_unsupported(coll: str, dtype: str, op: Optional[str] = None) -> Optional[str]:
    """Why gloo cannot be the reference for this case, or None.  Found by probing torch 2.13.0."""
    if dtype == "int16":
        return "gloo: int16 is not supported ('Invalid scalar type')"
    if op == "PREMUL_SUM":
        return "gloo: 'Cannot use ReduceOp.PREMUL_SUM with Gloo'"
    if op == "AVG" and dtype not in FLOATS:
        return "gloo: AVG on integers fails inside gloo's sum-then-divide"
    if coll == "all_to_all_uneven":
        return "gloo: list all_to_all needs equal-sized tensors ('invalid tensor size at index')"
    if coll == "gather" and dtype.startswith("complex"):
        return "gloo: gather of complex tensors ('Invalid scalar type')"
    return None
