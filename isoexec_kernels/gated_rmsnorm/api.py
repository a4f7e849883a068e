"""Gated output RMSNorm of Gated DeltaNet: ``rmsnorm(x) * weight * silu(gate)`` (norm, then gate).

Public API
  ``gated_rms_norm(x, gate, weight, eps)``            dispatcher (CUDA -> Triton, else
                                                       reference), differentiable
  ``gated_rms_norm_reference(...)`` / ``gated_rms_norm_triton(...)``

Shapes: x, gate [..., H] (same shape), weight [H]; output has x's shape and dtype.

Rounding schedule (per row of H elements; the formula of transformers' Qwen3_5RMSNormGated with a
pinned reduction order)
  xf = fp32(x); ss = sum(xf * xf) in fp32 by a fixed order over H; var = ss / H;
  rstd = 1 / sqrt(var + fp32(eps)) (IEEE sqrt and div);
  n = round_to_x_dtype(xf * rstd); wn = round_to(promote(x, weight))(fp32(weight) * fp32(n));
  out = round_to_x_dtype(fp32(wn) * silu(fp32(gate))).
  * reference (CPU): ss by the halves pairwise tree; silu = fp32(g / (1 + exp64(-g))) in float64
    from basic operations (stock CPU silu bits depend on an element's tensor position).
  * Triton (CUDA): one program per row in one block of next_pow2(H), ``tl.sum`` with num_warps
    fixed by H; silu = g / (1 + exp(-g)) with Triton's fp32 exp.
A row's result depends only on that row.

Backward (torch ops, every device): s = silu(g); dwn = dy * s; dgate = dy * wn * s'(g);
dweight = sum over rows of dwn * n (fixed 64-row leaves); dxhat = dwn * w;
dx = rstd * (dxhat - xhat * mean(dxhat * xhat)).
"""

from __future__ import annotations

import torch

from .. import _ref
from .._triton_util import want_triton
from .reference import _check, _eps32, _ROW_LEAF, _rows, gated_rms_norm_reference
from .triton_kernels import gated_rms_norm_triton


def _forward(x, gate, weight, eps):
    if want_triton(x):
        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_reference(x, gate, weight, eps)


class _GatedNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        ctx.save_for_backward(x, gate, weight)
        ctx.eps = eps
        return _forward(x, gate, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight = ctx.saved_tensors
        H = x.shape[-1]
        xf, gf, dyf = _rows(x).float(), _rows(gate).float(), _rows(dy).float()
        rstd = torch.rsqrt((xf * xf).sum(-1) / H + _eps32(ctx.eps))
        xhat = xf * rstd[:, None]
        n = xhat.to(x.dtype).float()
        wf = weight.float()
        wn = (wf * n).to(torch.promote_types(x.dtype, weight.dtype)).float()
        sig = torch.sigmoid(gf)
        s = gf * sig
        dwn = dyf * s
        dgate = dyf * wn * sig * (1.0 + gf * (1.0 - sig))
        dw = _ref.batch_sum0(dwn * n, _ROW_LEAF)
        dxhat = dwn * wf
        c = (dxhat * xhat).sum(-1, keepdim=True) / H
        dx = (dxhat - xhat * c) * rstd[:, None]
        return (dx.reshape(x.shape).to(x.dtype), dgate.reshape(gate.shape).to(gate.dtype),
                dw.to(weight.dtype), None)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Batch-invariant gated RMSNorm (module docstring); Triton on CUDA, reference elsewhere;
    differentiable."""
    _check(x, gate, weight)
    if torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad or weight.requires_grad):
        return _GatedNormFn.apply(x, gate, weight, eps)
    return _forward(x, gate, weight, eps)
