"""Gumbel-max sampling: the torch twin and the integer hash it shares with the Triton kernel (any
device; the CPU path of the public API). The rounding schedule is the docstring of ``api.py`` in
this folder."""

from __future__ import annotations

import torch

from .. import _ref

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for 0 <= x < 2**32 without leaving int64 (Python ints or int64 tensors)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """lowbias32 (C. Wellons): a 32-bit integer hash with good avalanche (ints or int64 tensors)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def noise_uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 [R, V] uniforms u_v of the module docstring (exact), from int64 keys [R]."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    h = mix32(keys[:, None] ^ mix32(v ^ 0x9E3779B9)[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def gumbel_argmax_reference(logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor,
                            keys: torch.Tensor) -> torch.Tensor:
    """The reference twin (module docstring); rows processed in chunks, which changes no bit."""
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    step = _ref.rows_per_chunk(V)
    for r0 in range(0, R, step):
        z = logits[r0:r0 + step].to(torch.float32)
        t = temperature[r0:r0 + step].to(torch.float32)
        sampled = t > 0
        scores = z
        if bool(sampled.any()):
            u = noise_uniform(keys[r0:r0 + step], V).to(torch.float64)
            g = (-_ref.log64(-_ref.log64(u))).to(torch.float32)
            tt = torch.where(sampled, t, torch.ones_like(t))
            scores = torch.where(sampled[:, None], z / tt[:, None] + g, z)
        scores = torch.where(z >= cut[r0:r0 + step, None].to(torch.float32), scores,
                             torch.full_like(scores, float("-inf")))
        out[r0:r0 + step] = torch.argmax(scores, dim=-1)
    return out
