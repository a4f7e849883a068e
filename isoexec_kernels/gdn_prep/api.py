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

from .. import _ref
from .._triton_util import want_triton
from .reference import _check, _eps32, _ROW_LEAF, _scale32, gdn_prep_reference
from .triton_kernels import gdn_prep_triton


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
