"""Gated DeltaNet input preparation: the Triton twin (kernels and their launchers; CUDA, or CPU under
``TRITON_INTERPRET=1``). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .._triton_util import jit, next_pow2, tl
from .reference import _check, _eps32, _scale32, SOFTPLUS_THRESHOLD


@jit
def _l2_kernel(x_ptr, out_ptr, r_ptr, NH, D, stride_t, stride_h, eps, scale,
               APPLY_SCALE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = row // NH
    h = row % NH
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    x = tl.load(x_ptr + t * stride_t + h * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=0)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(ss + eps))
    y = x * r
    if APPLY_SCALE:
        y = y * scale
    tl.store(out_ptr + row * D + cols, y, mask=ok)
    tl.store(r_ptr + row, r)


@jit
def _gate_kernel(a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, N, H, stride_a, stride_b,
                 THRESH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    t = i // H
    h = i % H
    a = tl.load(a_ptr + t * stride_a + h, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t * stride_b + h, mask=ok, other=0.0).to(tl.float32)
    al = tl.load(alog_ptr + h, mask=ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + h, mask=ok, other=0.0).to(tl.float32)
    u = a + dt
    sp = tl.maximum(u, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(u)))
    sp = tl.where(u > THRESH, u, sp)
    g = -(tl.exp(al) * sp)
    beta = 1.0 / (1.0 + tl.exp(-b))
    tl.store(g_ptr + i, g, mask=ok)
    tl.store(beta_ptr + i, beta, mask=ok)


def _warps_for(D: int) -> int:
    return 1 if next_pow2(D) <= 256 else 4


def _l2_triton(x, eps, scale):
    T, NH, D = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((T, NH, D), dtype=torch.float32, device=x.device)
    r = torch.empty((T * NH,), dtype=torch.float32, device=x.device)
    if T * NH:
        _l2_kernel[(T * NH,)](x, out, r, NH, D, x.stride(0), x.stride(1), _eps32(eps),
                              scale if scale is not None else 1.0, APPLY_SCALE=scale is not None,
                              BLOCK_D=next_pow2(D), num_warps=_warps_for(D), enable_fp_fusion=False)
    return out


def _gates_triton(a, b, A_log, dt_bias):
    T, H = a.shape
    a2 = a if a.stride(1) == 1 else a.contiguous()
    b2 = b if b.stride(1) == 1 else b.contiguous()
    g = torch.empty((T, H), dtype=torch.float32, device=a.device)
    beta = torch.empty((T, H), dtype=torch.float32, device=a.device)
    N = T * H
    if N:
        BLOCK = 1024
        _gate_kernel[(-(-N // BLOCK),)](a2, b2, A_log.contiguous(), dt_bias.contiguous(), g, beta, N, H,
                                        a2.stride(0), b2.stride(0), THRESH=SOFTPLUS_THRESHOLD, BLOCK=BLOCK,
                                        num_warps=4, enable_fp_fusion=False)
    return g, beta


def gdn_prep_triton(q, k, a, b, A_log, dt_bias, eps: float = 1e-6):
    """(q_hat, k_hat, g, beta) by the Triton schedule. CUDA, or CPU under the interpreter."""
    _check(q, k, a, b, A_log, dt_bias)
    qn = _l2_triton(q, eps, _scale32(q.shape[-1]))
    kn = _l2_triton(k, eps, None)
    g, beta = _gates_triton(a, b, A_log, dt_bias)
    return qn, kn, g, beta
