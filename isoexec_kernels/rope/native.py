"""Rotary position embedding: the stock twin, transformers' default RoPE (the native composition and
the negative control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope_native(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor | None = None, *,
                      theta: float | None = None, rotary_dim: int | None = None) -> torch.Tensor:
    """transformers' default rotary embedding on ``x[T, ..., D]``, computed on x's device the way
    transformers does (fp32 phases, cos/sin cast to x.dtype, products in x.dtype). The invariant
    kernel's ``cos_sin_cache`` is accepted for a common signature and ignored: the stock path
    recomputes its phases."""
    if theta is None:
        raise ValueError("apply_rope_native: pass theta")
    R = rotary_dim or x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.int64, device=x.device).float() / R))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R,)
    cos = emb.cos().to(x.dtype).reshape(shape)
    sin = emb.sin().to(x.dtype).reshape(shape)
    xr, xp = x[..., :R], x[..., R:]
    out = xr * cos + _rotate_half(xr) * sin
    return torch.cat((out, xp), dim=-1) if R < x.shape[-1] else out
