"""Rotary position embedding: the fixed-order torch twin (runs on any device; the CPU path of the
public API). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


def _inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """fp32 inverse frequencies, transformers' formula ``1 / theta ** (2i / R)`` with each fp32
    rounding of that formula kept, but the power evaluated in float64 from basic operations
    (so the table is the same on every machine and matches a correctly rounded fp32 pow)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim must be a positive even number, got {rotary_dim}")
    expo = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim  # fp32
    base = torch.tensor(theta, dtype=torch.float32).double()
    power = _ref.exp64(expo.double() * _ref.log64(base)).float()
    return torch.div(torch.ones_like(power), power)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """fp32 ``[T, rotary_dim]`` rows ``(cos | sin)`` for the given absolute positions; computed
    on the CPU element by element (api.py's docstring), returned on ``positions.device``."""
    pos = positions.detach().to("cpu", torch.int64).reshape(-1)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= 1 << 24):
        raise ValueError("rope: positions must lie in [0, 2^24)")
    phase = pos.float()[:, None] * _inv_freq(rotary_dim, theta)[None, :]
    sin, cos = _ref.sincos64(phase.double())
    table = torch.cat([cos.float(), sin.float()], dim=1)
    return table.to(positions.device)


def rope_cache(max_positions: int, rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """Rows 0..max_positions-1 of :func:`rope_cos_sin` (row p is bitwise the same whatever
    max_positions is)."""
    table = rope_cos_sin(torch.arange(max_positions), rotary_dim, theta)
    return table if device is None else table.to(device)


def _check(x, positions, cache):
    if x.dim() < 2:
        raise ValueError(f"apply_rope: x must be [T, ..., D], got {tuple(x.shape)}")
    if positions.shape != (x.shape[0],):
        raise ValueError(
            f"apply_rope: positions must be [T]={x.shape[0]}, got {tuple(positions.shape)}"
        )
    R = cache.shape[1]
    if cache.dim() != 2 or R % 2 or R > x.shape[-1]:
        raise ValueError(
            f"apply_rope: cache must be [P, R] with even R <= head_dim={x.shape[-1]}, "
            f"got {tuple(cache.shape)}"
        )
    if cache.dtype != torch.float32:
        raise TypeError("apply_rope: cos_sin_cache must be float32 (use rope_cache)")


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """RoPE by the fp32 schedule of api.py's docstring (torch ops)."""
    _check(x, positions, cos_sin_cache)
    R = cos_sin_cache.shape[1]
    h = R // 2
    rows = cos_sin_cache[positions.long()]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (h,)
    cos = rows[:, :h].reshape(shape)
    sin = rows[:, h:].reshape(shape)
    xf = x[..., :R].float()
    x1, x2 = xf[..., :h], xf[..., h:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out[..., :h] = o1.to(x.dtype)
    out[..., h:R] = o2.to(x.dtype)
    if R < x.shape[-1]:
        out[..., R:] = x[..., R:]
    return out
