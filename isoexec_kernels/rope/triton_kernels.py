"""Rotary position embedding: the Triton twin (kernels and their launchers; CUDA, or CPU under
``TRITON_INTERPRET=1``). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import math

import torch

from .._triton_util import jit, next_pow2, tl
from .reference import _check


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
    x3 = x.reshape(T, math.prod(x.shape[1:-1]), D)   # heads named: no -1, which a tensor of no token cannot infer
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
