"""The stock path: thin wrappers over the torch ops that transformers' Qwen3 code uses.

These are the "native" composition and the negative controls of the gates: same signatures as
the invariant kernels, no promise about reduction order (stock cuBLAS / CPU BLAS / torch
reductions pick their algorithm by shape, so a row's bits can change with the batch).

  ``linear_native(x, weight, bias=None)``          torch.nn.functional.linear
  ``rms_norm_native(x, weight, eps=1e-6, zero_centred=False)``  Qwen3RMSNorm's formula with
                                                   torch.mean/rsqrt (Qwen3_5RMSNorm's if zero_centred)
  ``apply_rope_native(x, positions, cos_sin_cache=None, *, theta, rotary_dim=None)``  transformers' default RoPE
                                                   (fp32 phases, cos/sin cast to x.dtype,
                                                   arithmetic in x.dtype)
  ``silu_and_mul_native(gate, up=None)``           F.silu(gate) * up (two roundings)
  ``embedding_native(ids, table)``                 F.embedding
  ``token_logprobs_native(logits, targets)``       torch.log_softmax(fp32) + gather
  ``log_softmax_native(logits)``                   torch.log_softmax(fp32)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "linear_native",
    "rms_norm_native",
    "apply_rope_native",
    "silu_and_mul_native",
    "embedding_native",
    "token_logprobs_native",
    "log_softmax_native",
    "IMPL",
]

IMPL = "native"


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    return F.linear(x, weight, bias)


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                    zero_centred: bool = False) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    if zero_centred:  # Qwen3.5: (x_normed * (1 + w)) in fp32, one cast at the end
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


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


def silu_and_mul_native(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    if up is None:
        i = gate.shape[-1] // 2
        gate, up = gate[..., :i], gate[..., i:]
    return F.silu(gate) * up


def embedding_native(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table)


def log_softmax_native(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs_native(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    ls = torch.log_softmax(logits.float(), dim=-1)
    return ls.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
