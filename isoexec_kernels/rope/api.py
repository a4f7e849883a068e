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

from .._triton_util import want_triton
from .reference import _check, apply_rope_reference, rope_cos_sin
from .triton_kernels import _rope_triton


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
