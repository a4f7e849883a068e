"""Sigmoid output gate: the Triton twin (kernels and their launchers; CUDA, or CPU under
``TRITON_INTERPRET=1``). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .._triton_util import jit, tl
from .reference import _check


_BLOCK = 1024


@jit
def _gate_kernel(x_ptr, g_ptr, out_ptr, n_cols, stride_x, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    xr = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_o + cols, (xr.to(tl.float32) * s).to(xr.dtype), mask=ok)


def _as_rows(t):
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def sigmoid_gate_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """By the Triton schedule. CUDA, or CPU under the interpreter."""
    _check(x, gate)
    x2, g2 = _as_rows(x), _as_rows(gate)
    R, C = x2.shape
    out = torch.empty((R, C), dtype=x.dtype, device=x.device)
    if R and C:
        _gate_kernel[(R, -(-C // _BLOCK))](x2, g2, out, C, x2.stride(0), g2.stride(0), out.stride(0),
                                          BLOCK=_BLOCK, num_warps=4)
    return out.reshape(x.shape)
