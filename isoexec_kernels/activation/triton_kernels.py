"""SwiGLU activation: the Triton twin (kernels and their launchers; CUDA, or CPU under
``TRITON_INTERPRET=1``). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .._triton_util import jit, tl
from .reference import _split


_BLOCK = 1024


@jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g_raw = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(g_raw.dtype), mask=ok)


@jit
def _silu_mul_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, stride_dy, stride_g,
                         stride_u, stride_dg, stride_du, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g_raw = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    s = g / (1.0 + tl.exp(-g))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + row * stride_dg + cols, dg.to(g_raw.dtype), mask=ok)
    tl.store(du_ptr + row * stride_du + cols, (dy * s).to(g_raw.dtype), mask=ok)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _triton_fwd(g, u):
    shape = g.shape
    g2, u2 = _as_rows(g), _as_rows(u)
    R, C = g2.shape
    out = torch.empty((R, C), dtype=g.dtype, device=g.device)
    if R and C:
        grid = (R, (C + _BLOCK - 1) // _BLOCK)
        _silu_mul_kernel[grid](g2, u2, out, C, g2.stride(0), u2.stride(0), out.stride(0),
                               BLOCK=_BLOCK, num_warps=4)
    return out.reshape(shape)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` in Triton (api.py's docstring). CUDA, or CPU under the interpreter."""
    g, u, _ = _split(gate, up)
    return _triton_fwd(g, u)


def _bwd_triton(dy, g, u):
    shape = g.shape
    dy2, g2, u2 = _as_rows(dy), _as_rows(g), _as_rows(u)
    R, C = g2.shape
    dg = torch.empty((R, C), dtype=g.dtype, device=g.device)
    du = torch.empty((R, C), dtype=u.dtype, device=g.device)
    if R and C:
        grid = (R, (C + _BLOCK - 1) // _BLOCK)
        _silu_mul_bwd_kernel[grid](dy2, g2, u2, dg, du, C, dy2.stride(0), g2.stride(0),
                                   u2.stride(0), dg.stride(0), du.stride(0), BLOCK=_BLOCK,
                                   num_warps=4)
    return dg.reshape(shape), du.reshape(shape)
