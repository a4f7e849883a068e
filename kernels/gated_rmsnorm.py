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

from . import _ref
from ._triton_util import jit, next_pow2, tl, want_triton

__all__ = ["gated_rms_norm", "gated_rms_norm_reference", "gated_rms_norm_triton", "IMPL"]

IMPL = "gated_rmsnorm_fixed"
_ROW_LEAF = 64


def _eps32(eps: float) -> float:
    return float(torch.tensor(eps, dtype=torch.float32))


def _check(x, gate, weight):
    if x.shape != gate.shape:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and gate {tuple(gate.shape)} must match")
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"gated_rms_norm: weight must be [H] with H = x.shape[-1]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")


def _rows(t):
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _silu_ref(g):
    g64 = g.double()
    return (g64 / (1.0 + _ref.exp64(-g64))).float()


def _ref_fwd(x2, g2, weight, eps):
    R, H = x2.shape
    xf = x2.float()
    ss = _ref.tree_sum0((xf * xf).t().contiguous()) if R else xf.new_zeros(0)
    s = torch.sqrt(ss / H + _eps32(eps))
    rstd = torch.div(torch.ones_like(s), s)
    n = (xf * rstd[:, None]).to(x2.dtype)
    wn = (weight.float() * n.float()).to(torch.promote_types(x2.dtype, weight.dtype))
    return (wn.float() * _silu_ref(g2.float())).to(x2.dtype)


def gated_rms_norm_reference(x, gate, weight, eps: float = 1e-6) -> torch.Tensor:
    """By the reference schedule (module docstring); forward only."""
    _check(x, gate, weight)
    return _ref_fwd(_rows(x), _rows(gate), weight, eps).reshape(x.shape)


@jit
def _gated_kernel(x_ptr, g_ptr, w_ptr, out_ptr, H, stride_x, stride_g, stride_o, eps,
                  WN_FP32: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    ss = tl.sum(xf * xf, axis=0)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(ss / H + eps))
    n = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    wn = w.to(tl.float32) * n.to(tl.float32)
    if not WN_FP32:
        wn = wn.to(x.dtype)
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_o + cols, (wn.to(tl.float32) * s).to(x.dtype), mask=ok)


def _warps_for(H: int) -> int:
    block = next_pow2(H)
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def gated_rms_norm_triton(x, gate, weight, eps: float = 1e-6) -> torch.Tensor:
    """By the Triton schedule. CUDA, or CPU under the interpreter. ``weight`` must be x's dtype
    or float32 (the intermediate product is rounded to promote(x, weight))."""
    _check(x, gate, weight)
    if weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"gated_rms_norm_triton: weight dtype {weight.dtype} must be x's ({x.dtype}) or float32")
    x2, g2 = _rows(x), _rows(gate)
    R, H = x2.shape
    out = torch.empty((R, H), dtype=x.dtype, device=x.device)
    if R:
        _gated_kernel[(R,)](x2, g2, weight.contiguous(), out, H, x2.stride(0), g2.stride(0), out.stride(0),
                            _eps32(eps), WN_FP32=weight.dtype == torch.float32, BLOCK_H=next_pow2(H), num_warps=_warps_for(H), enable_fp_fusion=False)
    return out.reshape(x.shape)


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
