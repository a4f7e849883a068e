"""Gated output RMSNorm: the stock twin, Qwen3_5RMSNormGated's formula (the native composition and the
negative control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm_native(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)
