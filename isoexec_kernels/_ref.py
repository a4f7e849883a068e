"""Building blocks of the CPU reference twins: fixed-order sums and position-free math.

Why this file exists: on CPU, stock torch reductions (``matmul``, ``sum``) change their order
with the batch size, and even stock elementwise transcendental ops are not a pure function of
one element: ``torch.sigmoid``/``silu`` take a SIMD path for most elements and a scalar libm
path for a vector's tail, and the two can differ by an ULP, so an element's bits depend on its
index in the tensor (measured on this project's CPU machines). The references are therefore
built only from IEEE basic operations (``+ - * /``, ``sqrt``, ``round``, ``floor``, compares,
exact casts and bit manipulation), which are correctly rounded and give the same bits whatever
path computes them, plus fixed reduction trees written with slicing.

Fixed sums
  :func:`tree_sum0` sums dim 0 by a pairwise "halves" tree: zero-pad to a power of two ``2^p``,
  then ``t = t[:h] + t[h:]`` until one row is left. Element ``i`` meets ``i + h`` at each level.
  :func:`blocked_sum` splits a dim into fixed-width leaves (``leaf`` elements, last leaf
  zero-padded), tree-sums each leaf, and accumulates the leaf sums left to right starting from
  ``+0.0``: ``acc = ((+0 + L0) + L1) + ...``. Padding a leaf with more zeros only turns ``-0``
  terms into ``+0``; the ``+0`` start of ``acc`` absorbs that, so the padding width never shows.

Position-free math (float64 in, float64 out; callers round once to float32)
  :func:`exp64`, :func:`log64`, :func:`sincos64`: range reduction plus a polynomial, all in
  basic float64 operations. Error below 1e-13 relative, so the final rounding to float32
  is almost always the correctly rounded one, and always the same bits for the same input.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "tree_sum0",
    "tree_sum0_",
    "blocked_sum",
    "exp64",
    "log64",
    "sincos64",
    "rows_per_chunk",
    "batch_sum0",
]


def _pad0(t: torch.Tensor, n: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``t`` to length ``n``."""
    if t.shape[0] == n:
        return t
    pad = t.new_zeros((n - t.shape[0],) + tuple(t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def tree_sum0(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by the fixed halves tree (see module docstring). Returns ``t.shape[1:]``.

    Empty dim 0 sums to ``+0``."""
    n = t.shape[0]
    if n == 0:
        return t.new_zeros(t.shape[1:])
    p = 1 << (n - 1).bit_length()
    t = _pad0(t, p)
    while t.shape[0] > 1:
        h = t.shape[0] // 2
        t = t[:h] + t[h:]
    return t[0]


def tree_sum0_(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """In-place :func:`tree_sum0` for a contiguous ``t`` whose dim 0 is a power of two
    (overwrites ``t``; returns a view of ``t[0]``, or ``out`` when given: the last level's add is
    written there instead of into ``t[0]``). Same bits as :func:`tree_sum0`."""
    n = t.shape[0]
    assert n > 0 and n & (n - 1) == 0, "tree_sum0_: dim 0 must be a power of two"
    while n > 2 or (n == 2 and out is None):
        h = n // 2
        t[:h].add_(t[h:n])
        n = h
    if out is None:
        return t[0]
    return torch.add(t[0], t[1], out=out) if n == 2 else out.copy_(t[0])


def blocked_sum(t: torch.Tensor, dim: int, leaf: int) -> torch.Tensor:
    """Sum ``t`` over ``dim`` with fixed leaves of width ``leaf`` (a power of two), each leaf by
    :func:`tree_sum0`, leaves accumulated left to right from ``+0.0``. The order depends only
    on ``t.shape[dim]`` and ``leaf``."""
    assert leaf > 0 and leaf & (leaf - 1) == 0, "leaf must be a power of two"
    t = t.movedim(dim, 0)
    n = t.shape[0]
    acc = t.new_zeros(t.shape[1:])
    for k0 in range(0, n, leaf):
        acc = acc + tree_sum0(t[k0:k0 + leaf].contiguous())
    return acc


def batch_sum0(t: torch.Tensor, leaf: int) -> torch.Tensor:
    """Sum over dim 0 for a backward's reduction over the batch (a weight gradient): on CUDA one
    ``torch.sum`` (deterministic for a given shape, one kernel), elsewhere :func:`blocked_sum`.
    Such sums need to be deterministic, not batch invariant (docs/variance_sources.md), and a
    Python loop of leaf sums has no place on the GPU path."""
    if t.is_cuda:
        return t.sum(0)
    return blocked_sum(t, 0, leaf)


def rows_per_chunk(elems_per_row: int, budget: int = 1 << 20) -> int:
    """Rows to process at once so a temporary holds about ``budget`` elements. Rows are
    independent in every reference, so the chunk size never changes bits."""
    return max(1, budget // max(1, elems_per_row))


# ---------------------------------------------------------------------------------------------
# Position-free float64 math
# ---------------------------------------------------------------------------------------------

# ln 2 split so that n * _LN2_HI is exact for |n| < 2^11 (the high part has trailing zeros).
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
# Taylor coefficients 1/k! for exp on |r| <= ln2/2 (degree 11: truncation < 1e-14 relative,
# far below the float32 rounding every caller applies).
_EXP_COEF = [1.0 / math.factorial(k) for k in range(12)]


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp of a float64 tensor, as float64 (relative error ~2e-16).

    Overflows to +inf above ~709.78 and underflows to 0 below ~-745 like a float64 exp; NaN
    stays NaN. The scale 2^n is applied as two exact power-of-two factors so the whole float64
    range is reached."""
    assert x.dtype == torch.float64
    xc = x.clamp(-800.0, 800.0)
    n = torch.round(xc * _INV_LN2)
    r = (xc - n * _LN2_HI).sub_(n * _LN2_LO)
    # Horner, in place (the same roundings as p * r + c), its first step r * c11 without a filled
    # tensor (c11 * r: a product of two numbers, either order the same bits)
    p = torch.mul(r, _EXP_COEF[-1]).add_(_EXP_COEF[-2])
    for c in reversed(_EXP_COEF[:-2]):
        p.mul_(r).add_(c)
    # 2^n as 2^n1 * 2^(n - n1), n1 = floor(n / 2), each factor built from its exponent bits (both
    # exponents in [-578, 578]). On the integer n (|n| <= 1155 after the clamp, exact in int64) an
    # arithmetic shift is that floor, much cheaper than a float floor division. A NaN n makes
    # garbage exponents here; the NaN is put back below
    ni = n.to(torch.int64)
    n1 = ni >> 1
    out = p.mul_(((n1 + 1023) << 52).view(torch.float64)).mul_(((ni - n1).add_(1023) << 52).view(torch.float64))
    return torch.where(torch.isnan(x), x, out)


# atanh series: log(m) = 2 f (1 + f^2/3 + f^4/5 + ...), f = (m-1)/(m+1), |f| <= 0.1716.
_LOG_COEF = [1.0 / (2 * k + 1) for k in range(10)]  # truncation < 1e-15
_SQRT_HALF = 0.70710678118654752440


def log64(x: torch.Tensor) -> torch.Tensor:
    """Natural log of a float64 tensor of positive normal numbers (callers pass sums >= 1);
    +inf gives +inf, 0 gives -inf, NaN/negative give NaN."""
    assert x.dtype == torch.float64
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    e = torch.where(small, e - 1, e).to(torch.float64)
    f = (m - 1.0) / (m + 1.0)
    f2 = f * f
    s = torch.full_like(f, _LOG_COEF[-1])
    for c in reversed(_LOG_COEF[:-1]):
        s = s * f2 + c
    out = (e * _LN2_HI + (e * _LN2_LO + 2.0 * f * s))
    out = torch.where(x == 0, torch.full_like(x, -math.inf), out)
    out = torch.where(torch.isinf(x) & (x > 0), x, out)
    return torch.where(torch.isnan(x) | (x < 0), torch.full_like(x, math.nan), out)


# pi/2 split in 33-bit pieces (fdlibm): k * _PIO2_1 and k * _PIO2_2 are exact for |k| < 2^20.
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
_SIN_COEF = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(10)]
_COS_COEF = [(-1.0) ** k / math.factorial(2 * k) for k in range(10)]


def sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) for float64 ``x`` with |x| < 2^20 * pi/2 (about 1.6e6: RoPE phases)."""
    assert x.dtype == torch.float64
    if x.numel() and float(x.abs().max()) >= 1.6e6:
        raise ValueError("sincos64: |phase| >= 1.6e6 is outside the exact range reduction")
    k = torch.round(x * _TWO_OVER_PI)
    r = ((x - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3
    r2 = r * r
    s = torch.full_like(r, _SIN_COEF[-1])
    for c in reversed(_SIN_COEF[:-1]):
        s = s * r2 + c
    s = s * r
    c_ = torch.full_like(r, _COS_COEF[-1])
    for c in reversed(_COS_COEF[:-1]):
        c_ = c_ * r2 + c
    q = k.to(torch.int64) & 3
    sin = torch.where(q == 0, s, torch.where(q == 1, c_, torch.where(q == 2, -s, -c_)))
    cos = torch.where(q == 0, c_, torch.where(q == 1, -s, torch.where(q == 2, -c_, s)))
    return sin, cos
