"""RMSNorm: the fixed-order torch twin (runs on any device; the CPU path of the public API). The
rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


DW_ROW_LEAF = 64
"""Leaf width (rows) of the fixed-order sum that forms dweight in the backward."""


def _check(x, weight):
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm: weight must be [H] with H = x.shape[-1]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )


def _eps32(eps: float) -> float:
    # eps is applied as an fp32 number on every path.
    return float(torch.tensor(eps, dtype=torch.float32))


def _out_dtype(x, weight):
    return torch.promote_types(x.dtype, weight.dtype)


def _row_sum_ref(t: torch.Tensor) -> torch.Tensor:
    """Fixed-order sum over the last dim of a 2-D fp32 tensor (halves tree, whole row)."""
    return _ref.tree_sum0(t.t().contiguous())


def _ref_fwd(x2: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False):
    R, H = x2.shape
    xf = x2.float()
    ss = _row_sum_ref(xf * xf) if R else xf.new_zeros(0)
    var = ss / H
    s = torch.sqrt(var + _eps32(eps))
    rstd = torch.div(torch.ones_like(s), s)
    if zero_centred:
        return ((xf * rstd[:, None]) * (1.0 + weight.float())).to(x2.dtype), rstd
    y = (xf * rstd[:, None]).to(x2.dtype)
    out = (weight.float() * y.float()).to(_out_dtype(x2, weight))
    return out, rstd


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm by the reference schedule (api.py's docstring); forward only."""
    _check(x, weight)
    H = x.shape[-1]
    out, _ = _ref_fwd(x.reshape(-1, H), weight, eps, zero_centred)
    return out.reshape(x.shape)


def rms_norm_backward_reference(dy, x, weight, rstd, zero_centred: bool = False):
    """(dx, dweight) for 2-D ``dy, x`` [R, H] and the forward's fp32 ``rstd`` [R]."""
    R, H = x.shape
    xf = x.float()
    xhat = xf * rstd[:, None]
    g = dy.float() * ((1.0 + weight.float()) if zero_centred else weight.float())
    c = _row_sum_ref(g * xhat) / H if R else xf.new_zeros(0)
    dx = ((g - xhat * c[:, None]) * rstd[:, None]).to(x.dtype)
    y = xhat if zero_centred else xhat.to(x.dtype).float()
    dw = _ref.blocked_sum(dy.float() * y, 0, DW_ROW_LEAF).to(weight.dtype)
    return dx, dw


def _rows(t: torch.Tensor) -> torch.Tensor:
    H = t.shape[-1]
    t2 = t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
