"""RMSNorm: the stock twin, Qwen3RMSNorm's formula with torch.mean / rsqrt (the native composition and
the negative control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                    zero_centred: bool = False) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    if zero_centred:  # Qwen3.5: (x_normed * (1 + w)) in fp32, one cast at the end
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)
