"""Gated DeltaNet input preparation: q/k L2 norm, decay gate g and write strength beta.

Public API
  ``gdn_prep(q, k, a, b, A_log, dt_bias, eps=1e-6)``  dispatcher (CUDA -> Triton, else
      reference), differentiable; the same function for every case
  ``gdn_prep_reference(...)`` / ``gdn_prep_triton(...)``

Shapes: q, k [T, Hk, Dk] (any dtype, unit last-dim stride; views of the conv output are fine),
a, b [T, H], A_log, dt_bias [H]. Returns (q_hat, k_hat, g, beta), all float32:
  q_hat = l2norm(q) * Dk**-0.5 , k_hat = l2norm(k)           [T, Hk, Dk]
  g = -exp(A_log) * softplus(a + dt_bias)                   [T, H]  (log of the per-step decay)
  beta = sigmoid(b)                                         [T, H]

Rounding schedule (per row / element; pinned, no constant to choose)
  l2norm of a row x of Dk elements: xf = fp32(x); ss = sum(xf * xf) in fp32 by a fixed order;
    r = 1 / sqrt(ss + fp32(eps)) (IEEE sqrt and div); y = xf * r; for q then y * fp32(Dk**-0.5).
  g: u = fp32(a) + fp32(dt_bias); sp = softplus(u) (u itself above 20, like torch);
    e = exp(fp32(A_log)); g = -(e * sp) (one fp32 product).
  beta = 1 / (1 + exp(-fp32(b))).
  * reference (CPU): ss by the halves pairwise tree over the row; exp / softplus / sigmoid
    evaluated in float64 from basic operations (``_ref.exp64`` / ``_ref.log64``, log1p by its
    series below 1e-3) and rounded once to fp32 -- stock CPU transcendental ops are not a
    pure function of the element.
  * Triton (CUDA): one program per row, the row in one block of next_pow2(Dk), ``tl.sum`` with
    num_warps fixed by Dk; exp/log are Triton's fp32 ones; products compiled without FMA.
Every output element depends only on its own row / element, so the result is the same for any
batch, split or case.

Backward (torch ops, every device): dx = r * (dy' - y * sum(dy' * y)) with dy' = dq * scale for
q; du = dg * (-e * sigmoid(u)); dA_log = sum_t dg * g; ddt_bias = sum_t du; db = dbeta * beta *
(1 - beta); token sums by fixed 64-row leaves.
"""

from __future__ import annotations

import torch

from . import _ref
from ._triton_util import jit, next_pow2, tl, want_triton

__all__ = ["gdn_prep", "gdn_prep_reference", "gdn_prep_triton", "l2norm_reference", "IMPL",
           "SOFTPLUS_THRESHOLD"]

IMPL = "gdn_prep_fp32"
SOFTPLUS_THRESHOLD = 20.0
_ROW_LEAF = 64


def _eps32(eps: float) -> float:
    return float(torch.tensor(eps, dtype=torch.float32))


def _scale32(dk: int) -> float:
    return float(torch.tensor(dk ** -0.5, dtype=torch.float32))


def _check(q, k, a, b, A_log, dt_bias):
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"gdn_prep: q and k must be [T, Hk, Dk] of one shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    T = q.shape[0]
    if a.dim() != 2 or a.shape != b.shape or a.shape[0] != T:
        raise ValueError(f"gdn_prep: a and b must be [T={T}, H]; got {tuple(a.shape)}, {tuple(b.shape)}")
    H = a.shape[1]
    if A_log.shape != (H,) or dt_bias.shape != (H,):
        raise ValueError(f"gdn_prep: A_log and dt_bias must be [H={H}]; got {tuple(A_log.shape)}, "
                         f"{tuple(dt_bias.shape)}")


# ---------------------------------------------------------------------------------------------
# Reference twin
# ---------------------------------------------------------------------------------------------


def _log1p64(y: torch.Tensor) -> torch.Tensor:
    """log(1 + y) for float64 y >= 0: series below 1e-3 (no cancellation), log64 above."""
    s = torch.zeros_like(y)
    for k in range(9, 0, -1):  # y - y^2/2 + ... + y^9/9 (truncation < 1e-27 relative)
        s = (1.0 / k) - y * s
    small = y * s
    return torch.where(y < 1e-3, small, _ref.log64(1.0 + y))


def _softplus_ref(u: torch.Tensor) -> torch.Tensor:
    u64 = u.double()
    sp = torch.clamp(u64, min=0.0) + _log1p64(_ref.exp64(-u64.abs()))
    return torch.where(u > SOFTPLUS_THRESHOLD, u, sp.float())


def _sigmoid_ref(x: torch.Tensor) -> torch.Tensor:
    return (1.0 / (1.0 + _ref.exp64(-x.double()))).float()


def _l2_rows_ref(x: torch.Tensor, eps: float):
    """(y, r) for fp32 rows [R, D]: ss by the halves tree, r = 1/sqrt(ss + eps)."""
    ss = _ref.tree_sum0((x * x).t().contiguous()) if x.shape[0] else x.new_zeros(0)
    s = torch.sqrt(ss + _eps32(eps))
    r = torch.div(torch.ones_like(s), s)
    return x * r[:, None], r


def l2norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp32 l2norm over the last dim by the reference schedule."""
    D = x.shape[-1]
    y, _ = _l2_rows_ref(x.reshape(-1, D).float(), eps)
    return y.reshape(x.shape)


def _gates_ref(a, b, A_log, dt_bias):
    u = a.float() + dt_bias.float()
    e = _ref.exp64(A_log.float().double()).float()
    g = -(e * _softplus_ref(u))
    beta = _sigmoid_ref(b.float())
    return g, beta


def gdn_prep_reference(q, k, a, b, A_log, dt_bias, eps: float = 1e-6):
    """(q_hat, k_hat, g, beta) by the reference schedule (module docstring); forward only."""
    _check(q, k, a, b, A_log, dt_bias)
    D = q.shape[-1]
    qn, _ = _l2_rows_ref(q.reshape(-1, D).float(), eps)
    kn, _ = _l2_rows_ref(k.reshape(-1, D).float(), eps)
    g, beta = _gates_ref(a, b, A_log, dt_bias)
    return (qn * _scale32(D)).reshape(q.shape), kn.reshape(k.shape), g, beta


# ---------------------------------------------------------------------------------------------
# Triton twin
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Autograd and dispatcher
# ---------------------------------------------------------------------------------------------


def _forward(q, k, a, b, A_log, dt_bias, eps):
    if want_triton(q):
        return gdn_prep_triton(q, k, a, b, A_log, dt_bias, eps)
    return gdn_prep_reference(q, k, a, b, A_log, dt_bias, eps)


def _l2_backward(dy, x, eps):
    D = x.shape[-1]
    xf = x.reshape(-1, D).float()
    ss = (xf * xf).sum(-1)
    r = torch.rsqrt(ss + _eps32(eps))
    y = xf * r[:, None]
    dyf = dy.reshape(-1, D).float()
    dx = r[:, None] * (dyf - y * (dyf * y).sum(-1, keepdim=True))
    return dx.reshape(x.shape).to(x.dtype)


class _PrepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, a, b, A_log, dt_bias, eps):
        qn, kn, g, beta = _forward(q, k, a, b, A_log, dt_bias, eps)
        ctx.save_for_backward(q, k, a, A_log, dt_bias, g, beta)
        ctx.eps = eps
        ctx.b_dtype = b.dtype
        return qn, kn, g, beta

    @staticmethod
    def backward(ctx, dq, dk, dg, dbeta):
        q, k, a, A_log, dt_bias, g, beta = ctx.saved_tensors
        eps = ctx.eps
        dq_in = dk_in = da = db = dA = ddt = None
        if dq is not None and ctx.needs_input_grad[0]:
            dq_in = _l2_backward(dq.float() * _scale32(q.shape[-1]), q, eps)
        if dk is not None and ctx.needs_input_grad[1]:
            dk_in = _l2_backward(dk, k, eps)
        if dg is not None:
            u = a.float() + dt_bias.float()
            e = torch.exp(A_log.float())
            du = dg.float() * (-e) * torch.sigmoid(u)
            if ctx.needs_input_grad[2]:
                da = du.to(a.dtype)
            if ctx.needs_input_grad[4]:
                dA = _ref.batch_sum0(dg.float() * g, _ROW_LEAF).to(A_log.dtype)
            if ctx.needs_input_grad[5]:
                ddt = _ref.batch_sum0(du, _ROW_LEAF).to(dt_bias.dtype)
        if dbeta is not None and ctx.needs_input_grad[3]:
            db = (dbeta.float() * beta * (1.0 - beta)).to(ctx.b_dtype)
        return dq_in, dk_in, da, db, dA, ddt, None


def gdn_prep(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
             dt_bias: torch.Tensor, eps: float = 1e-6):
    """(q_hat, k_hat, g, beta) in fp32 (module docstring); Triton on CUDA, reference elsewhere;
    differentiable."""
    _check(q, k, a, b, A_log, dt_bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, a, b, A_log, dt_bias)):
        return _PrepFn.apply(q, k, a, b, A_log, dt_bias, eps)
    return _forward(q, k, a, b, A_log, dt_bias, eps)
