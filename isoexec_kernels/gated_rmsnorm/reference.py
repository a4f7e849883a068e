"""Gated output RMSNorm: the fixed-order torch twin (runs on any device; the CPU path of the public
API). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


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
    """By the reference schedule (api.py's docstring); forward only."""
    _check(x, gate, weight)
    return _ref_fwd(_rows(x), _rows(gate), weight, eps).reshape(x.shape)
