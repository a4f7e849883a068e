"""Rotary position embedding (neox / ``rotate_half`` style, as transformers' Qwen3), invariant.

Public API
  ``rope_cos_sin(positions, rotary_dim, theta)``  fp32 [T, rotary_dim] table rows (cos | sin)
  ``rope_cache(max_positions, rotary_dim, theta, device=None)``  the same rows for 0..max-1
  ``apply_rope(x, positions, cos_sin_cache=None, *, theta=None, rotary_dim=None)`` dispatcher
  ``apply_rope_reference(x, positions, cos_sin_cache)`` / ``apply_rope_triton(...)``

Layout: ``x[T, ..., D]`` (tokens first, any number of head dims, head_dim D last) and
``positions[T]`` (absolute positions, int). The first ``rotary_dim = cache.shape[1]`` channels
of each head are rotated (halves ``x1 = x[:R/2]``, ``x2 = x[R/2:R]``); channels ``R..D`` pass
through unchanged (partial rotary). A token's result depends only on its own values and its
absolute position.

Rounding schedule
  table (always built on the CPU, so every device gets the same bits):
    inv_freq[i] = fp32(1 / fp32(theta ** fp32(2i / R))), the power evaluated in float64
      (exp64/log64 of _ref) and rounded once (transformers' formula, machine-independent);
    phase = fp32(fp32(pos) * inv_freq[i])        (one fp32 product, as transformers does);
    cos, sin = fp32(cos64(phase)), fp32(sin64(phase)).
  apply (fp32, no FMA contraction, one rounding to x.dtype at the end):
    o1 = x1*cos - x2*sin ;  o2 = x2*cos + x1*sin  (each product and the sum rounded in fp32).
  The Triton kernel is compiled with ``enable_fp_fusion=False`` so it performs the same
  correctly rounded fp32 operations as the reference: both give the same bits
  (impl ``rope_fp32``; checked under the interpreter here and on the GPU by the gates).
  Backward (Triton path): the transposed rotation, dx1 = dy1*cos + dy2*sin, dx2 = dy2*cos -
  dy1*sin, by the same kernel with sin negated (exact), fp32 and one rounding; channels past R
  pass dy through. Reference path: torch autograd of the formula.
  Difference from transformers: it rounds cos/sin to x.dtype and each op to x.dtype; here
  the arithmetic stays in fp32 with a single final rounding.
"""

from __future__ import annotations


import torch

from . import _ref
from ._triton_util import jit, next_pow2, tl, want_triton

__all__ = [
    "rope_cos_sin",
    "rope_cache",
    "apply_rope",
    "apply_rope_reference",
    "apply_rope_triton",
    "IMPL",
]

IMPL = "rope_fp32"


def _inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """fp32 inverse frequencies, transformers' formula ``1 / theta ** (2i / R)`` with each fp32
    rounding of that formula kept, but the power evaluated in float64 from basic operations
    (so the table is the same on every machine and matches a correctly rounded fp32 pow)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim must be a positive even number, got {rotary_dim}")
    expo = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim  # fp32
    base = torch.tensor(theta, dtype=torch.float32).double()
    power = _ref.exp64(expo.double() * _ref.log64(base)).float()
    return torch.div(torch.ones_like(power), power)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """fp32 ``[T, rotary_dim]`` rows ``(cos | sin)`` for the given absolute positions; computed
    on the CPU element by element (module docstring), returned on ``positions.device``."""
    pos = positions.detach().to("cpu", torch.int64).reshape(-1)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= 1 << 24):
        raise ValueError("rope: positions must lie in [0, 2^24)")
    phase = pos.float()[:, None] * _inv_freq(rotary_dim, theta)[None, :]
    sin, cos = _ref.sincos64(phase.double())
    table = torch.cat([cos.float(), sin.float()], dim=1)
    return table.to(positions.device)


def rope_cache(max_positions: int, rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """Rows 0..max_positions-1 of :func:`rope_cos_sin` (row p is bitwise the same whatever
    max_positions is)."""
    table = rope_cos_sin(torch.arange(max_positions), rotary_dim, theta)
    return table if device is None else table.to(device)


def _check(x, positions, cache):
    if x.dim() < 2:
        raise ValueError(f"apply_rope: x must be [T, ..., D], got {tuple(x.shape)}")
    if positions.shape != (x.shape[0],):
        raise ValueError(
            f"apply_rope: positions must be [T]={x.shape[0]}, got {tuple(positions.shape)}"
        )
    R = cache.shape[1]
    if cache.dim() != 2 or R % 2 or R > x.shape[-1]:
        raise ValueError(
            f"apply_rope: cache must be [P, R] with even R <= head_dim={x.shape[-1]}, "
            f"got {tuple(cache.shape)}"
        )
    if cache.dtype != torch.float32:
        raise TypeError("apply_rope: cos_sin_cache must be float32 (use rope_cache)")


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """RoPE by the fp32 schedule of the module docstring (torch ops)."""
    _check(x, positions, cos_sin_cache)
    R = cos_sin_cache.shape[1]
    h = R // 2
    rows = cos_sin_cache[positions.long()]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (h,)
    cos = rows[:, :h].reshape(shape)
    sin = rows[:, h:].reshape(shape)
    xf = x[..., :R].float()
    x1, x2 = xf[..., :h], xf[..., h:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out[..., :h] = o1.to(x.dtype)
    out[..., h:R] = o2.to(x.dtype)
    if R < x.shape[-1]:
        out[..., R:] = x[..., R:]
    return out


@jit
def _rope_kernel(x_ptr, pos_ptr, cache_ptr, out_ptr, NH, stride_xt, stride_xh, stride_ot,
                 stride_oh, stride_c, HALF: tl.constexpr, BLOCK_NH: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, TRANSPOSE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_NH)
    cols = tl.arange(0, BLOCK_HALF)
    ok = (heads[:, None] < NH) & (cols[None, :] < HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cache_ptr + pos * stride_c + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + cols, mask=cols < HALF, other=0.0)
    if TRANSPOSE:
        # the backward applies the transposed rotation (sin -> -sin; negation is exact)
        sin = -sin
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1r = tl.load(base, mask=ok, other=0.0)
    x2r = tl.load(base + HALF, mask=ok, other=0.0)
    x1 = x1r.to(tl.float32)
    x2 = x2r.to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    obase = out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    tl.store(obase, o1.to(x1r.dtype), mask=ok)
    tl.store(obase + HALF, o2.to(x1r.dtype), mask=ok)


def _rope_triton(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 transpose: bool) -> torch.Tensor:
    T = x.shape[0]
    D = x.shape[-1]
    R = cos_sin_cache.shape[1]
    x3 = x.reshape(T, -1, D)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    NH = x3.shape[1]
    out = torch.empty((T, NH, D), dtype=x.dtype, device=x.device)
    if R < D:
        out[..., R:] = x3[..., R:]
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    if T and NH:
        _rope_kernel[(T,)](
            x3, positions.contiguous(), cache, out, NH, x3.stride(0), x3.stride(1),
            out.stride(0), out.stride(1), cache.stride(0), HALF=R // 2,
            BLOCK_NH=next_pow2(NH), BLOCK_HALF=next_pow2(R // 2), TRANSPOSE=transpose,
            num_warps=4, enable_fp_fusion=False,
        )
    return out.reshape(x.shape)


def apply_rope_triton(x: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """RoPE by the same fp32 schedule in Triton (no FMA contraction): one program per token,
    all heads of that token in one block. CUDA tensors, or CPU under TRITON_INTERPRET=1."""
    _check(x, positions, cos_sin_cache)
    return _rope_triton(x, positions, cos_sin_cache, transpose=False)


class _RopeFn(torch.autograd.Function):
    """Triton RoPE with a Triton backward: the gradient of a rotation is the transposed rotation
    (dx1 = dy1*cos + dy2*sin, dx2 = dy2*cos - dy1*sin, fp32, one rounding), one pass; channels
    past rotary_dim pass the gradient through."""

    @staticmethod
    def forward(ctx, x, positions, cos_sin_cache):
        ctx.save_for_backward(positions, cos_sin_cache)
        return _rope_triton(x, positions, cos_sin_cache, transpose=False)

    @staticmethod
    def backward(ctx, dy):
        positions, cache = ctx.saved_tensors
        return _rope_triton(dy, positions, cache, transpose=True), None, None


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor | None = None,
               *, theta: float | None = None, rotary_dim: int | None = None) -> torch.Tensor:
    """Apply RoPE to ``x[T, ..., D]`` at absolute ``positions[T]``.

    Pass a table from :func:`rope_cache` (preferred; keep it on x's device), or ``theta`` (and
    optionally ``rotary_dim``, default D) to build the rows for these positions on the fly.
    Differentiable: the reference path through torch autograd, the Triton path by
    :class:`_RopeFn` (Triton forward, transposed-rotation Triton backward)."""
    if cos_sin_cache is None:
        if theta is None:
            raise ValueError("apply_rope: pass cos_sin_cache or theta")
        R = rotary_dim or x.shape[-1]
        cos_sin_cache = rope_cos_sin(positions, R, theta).to(x.device)
        positions = torch.arange(x.shape[0], device=x.device)
    if want_triton(x):
        _check(x, positions, cos_sin_cache)
        if torch.is_grad_enabled() and x.requires_grad:
            return _RopeFn.apply(x, positions, cos_sin_cache)
        return _rope_triton(x, positions, cos_sin_cache, transpose=False)
    return apply_rope_reference(x, positions, cos_sin_cache)
