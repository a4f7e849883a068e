"""Batch-invariant RMSNorm (Qwen3 style), forward and backward.

Public API
  ``rms_norm(x, weight, eps, zero_centred=False, weight2=None, heads1=None)``
                                            dispatcher (CUDA -> Triton, else reference),
                                            differentiable; ``weight2``/``heads1``: two norms
                                            over the heads of one [T, heads, H] view
  ``rms_norm_reference(x, weight, eps)``   torch twin (forward only)
  ``rms_norm_triton(x, weight, eps)``      Triton twin (forward only)
  ``rms_norm_backward_reference(dy, x, weight, rstd)`` / ``rms_norm_backward_triton(...)``

``weight`` has shape [H] and applies to the last dim of ``x[..., H]`` (so the same function is
the model norm and the per-head q/k norm on ``x[T, heads, head_dim]``).

Rounding schedule (per row of H elements; identical for every row position and batch size)
  xf = fp32(x); ss = sum(xf * xf) in fp32 by a fixed order over H; var = ss / H (fp32 div);
  rstd = 1 / sqrt(var + eps) (IEEE sqrt, IEEE div; eps rounded to fp32 first);
  y = round_to_x_dtype(xf * rstd); out = round_to_out_dtype(fp32(weight) * fp32(y)),
  out_dtype = promote(x.dtype, weight.dtype). This is Qwen3RMSNorm's formula
  (``weight * (x.float() * rsqrt(var + eps)).to(input_dtype)``) with pinned reduction order.
  * reference (impl ``ref_rmsnorm``): ss by the halves pairwise tree over the whole row
    zero-padded to a power of two.
  * Triton (impl ``triton_rmsnorm``): one program per row, the row in one register block of
    ``next_pow2(H)``; ``tl.sum`` with num_warps chosen from H only.

Backward (straight-through the two casts, like torch autograd of the formula above):
  g = fp32(dy) * fp32(weight); c = sum(g * xhat) / H (same fixed order as forward), with
  xhat = xf * rstd in fp32; dx = (g - xhat * c) * rstd -> x.dtype;
  dweight = sum over rows of fp32(dy) * fp32(y) -> weight.dtype. The reference sums rows by
  fixed 64-row leaves (halves tree inside a leaf, leaves left to right); the Triton backward is
  one fused pass (dx and a per-program dweight partial over a fixed row range, tiles in row
  order), the partials then summed over programs by ``torch.sum``. Both are deterministic for a
  given shape; dweight is a sum over the batch and is not batch invariant (only forward bits
  must match between trainer and engine, ``docs/variance_sources.md``).

Zero-centred variant (``zero_centred=True``; Qwen3.5's ``Qwen3_5RMSNorm``, weights stored as
offsets from 1): same ss / rstd, then out = round_to_x_dtype((xf * rstd) * (1 + fp32(weight))),
all in fp32 with no intermediate rounding to x.dtype (``1 + w`` is one fp32 add). Backward: g =
fp32(dy) * (1 + fp32(weight)), dx as above, dweight = fixed-leaf row sum of fp32(dy) * xhat.
The default (``zero_centred=False``) path is unchanged, bit for bit.
"""

from __future__ import annotations

import torch

from .._triton_util import want_triton
from .reference import _check, _ref_fwd, _rows, rms_norm_backward_reference
from .triton_kernels import _triton_fwd, rms_norm_backward_triton, triton_rows


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centred=False):
        x2 = _rows(x)
        if want_triton(x2):
            out, rstd = _triton_fwd(x2, weight, eps, zero_centred)
        else:
            out, rstd = _ref_fwd(x2, weight, eps, zero_centred)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        ctx.zero_centred = zero_centred
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = _rows(dy)
        if want_triton(x2):
            dx, dw = rms_norm_backward_triton(dy2, x2, weight, rstd, ctx.zero_centred)
        else:
            dx, dw = rms_norm_backward_reference(dy2, x2, weight, rstd, ctx.zero_centred)
        return dx.reshape(ctx.x_shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, zero_centred: bool = False,
             weight2: torch.Tensor | None = None, heads1: int | None = None) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim (Triton on CUDA, reference elsewhere);
    differentiable. Rounding schedule: module docstring (``zero_centred``: weight is an offset
    from 1, Qwen3.5 style).

    ``weight2`` with ``heads1``: ``x`` is [T, heads, H] and heads ``heads1..`` are normed with
    ``weight2``, the others with ``weight`` -- the q and k norms of a fused qkv output's
    [T, q heads + kv heads, head_dim] slice in one launch. Every row's arithmetic is the
    one-weight call's, so the bits are those of the two separate calls."""
    _check(x, weight)
    if weight2 is not None:
        return _two_weight_rms_norm(x, weight, eps, zero_centred, weight2, heads1)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(x, weight, eps, zero_centred)
    if want_triton(x):
        out, _ = _triton_fwd(triton_rows(x), weight, eps, zero_centred)
    else:
        out, _ = _ref_fwd(_rows(x), weight, eps, zero_centred)
    return out.reshape(x.shape)


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, H] as the Triton kernels read it in place (unit column stride, heads
    H apart), else a contiguous copy."""
    return x if x.stride(-1) == 1 and x.stride(1) == x.shape[-1] else x.contiguous()


class _TwoWeightRMSNormFn(torch.autograd.Function):
    """The two-weight call on CUDA under autograd: one forward launch, one backward launch
    (dx, and both dweights' partials, summed in one pass); the same forward bits as without
    autograd. The backward is deterministic, not the two separate calls' bits (dweight sums
    other row ranges)."""

    @staticmethod
    def forward(ctx, x, weight, weight2, eps, zero_centred, heads1):
        x3 = _heads_view(x)
        out, rstd = _triton_fwd(x3, weight, eps, zero_centred, weight2, heads1)
        ctx.save_for_backward(x3, weight, weight2, rstd)
        ctx.zero_centred, ctx.heads1 = zero_centred, heads1
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x3, weight, weight2, rstd = ctx.saved_tensors
        dx, dw, dw2 = rms_norm_backward_triton(_rows(dy), x3, weight, rstd, ctx.zero_centred,
                                               weight2=weight2, heads1=ctx.heads1)
        return dx.reshape(x3.shape), dw, dw2, None, None, None


def _two_weight_rms_norm(x, weight, eps, zero_centred, weight2, heads1):
    _check(x, weight2)
    if weight2.dtype != weight.dtype:
        raise TypeError(f"rms_norm: weight2 is {weight2.dtype} but weight is {weight.dtype}")
    if x.dim() != 3 or heads1 is None or not 0 < int(heads1) < x.shape[1]:
        raise ValueError(f"rms_norm: weight2 needs x [T, heads, H] and 0 < heads1 < heads; got x "
                         f"{tuple(x.shape)}, heads1 {heads1}")
    heads1 = int(heads1)
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or weight2.requires_grad)
    if want_triton(x):
        if grad:
            return _TwoWeightRMSNormFn.apply(x, weight, weight2, eps, zero_centred, heads1)
        out, _ = _triton_fwd(_heads_view(x), weight, eps, zero_centred, weight2, heads1)
        return out.reshape(x.shape)
    if grad:
        # the reference under autograd: the two norms as two differentiable calls (same bits)
        return torch.cat([rms_norm(x[:, :heads1], weight, eps, zero_centred),
                          rms_norm(x[:, heads1:], weight2, eps, zero_centred)], dim=1)
    H = x.shape[-1]
    first, _ = _ref_fwd(_rows(x[:, :heads1]), weight, eps, zero_centred)
    second, _ = _ref_fwd(_rows(x[:, heads1:]), weight2, eps, zero_centred)
    T = x.shape[0]
    return torch.cat([first.reshape(T, heads1, H), second.reshape(T, x.shape[1] - heads1, H)], dim=1)
