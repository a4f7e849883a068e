"""Gated DeltaNet input preparation: the fixed-order torch twin (runs on any device; the CPU path of
the public API). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


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
    """(q_hat, k_hat, g, beta) by the reference schedule (api.py's docstring); forward only."""
    _check(q, k, a, b, A_log, dt_bias)
    D = q.shape[-1]
    qn, _ = _l2_rows_ref(q.reshape(-1, D).float(), eps)
    kn, _ = _l2_rows_ref(k.reshape(-1, D).float(), eps)
    g, beta = _gates_ref(a, b, A_log, dt_bias)
    return (qn * _scale32(D)).reshape(q.shape), kn.reshape(k.shape), g, beta
