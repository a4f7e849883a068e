"""Gated output RMSNorm: the Triton twin (kernels and their launchers; CUDA, or CPU under
``TRITON_INTERPRET=1``). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .._triton_util import jit, next_pow2, tl
from .reference import _check, _eps32, _rows


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
