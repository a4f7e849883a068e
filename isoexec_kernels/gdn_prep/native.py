"""Gated DeltaNet input preparation: the stock twin, rsqrt L2 norm, softplus and sigmoid in torch (the
native composition and the negative control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(dim=-1, keepdim=True) + eps)


def gdn_prep_native(q, k, a, b, A_log, dt_bias, eps: float = 1e-6):
    qn = _l2norm(q, eps) * (q.shape[-1] ** -0.5)
    kn = _l2norm(k, eps)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.sigmoid().float()
    return qn, kn, g, beta
