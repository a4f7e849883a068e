"""Gumbel-max sampling: the Triton twin (CUDA, or CPU under ``TRITON_INTERPRET=1``). The rounding
schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .._triton_util import jit, tl

BLOCK_V = 1024
"""Vocabulary step of the Triton kernel (lanes per program)."""
CHUNKS = 16
"""Programs per row in the Triton kernel (each scans one stretch of the vocabulary)."""


@jit
def _gumbel_argmax_kernel(z_ptr, temp_ptr, cut_ptr, key_ptr, val_ptr, idx_ptr, V, stride_z, span,
                          BLOCK: tl.constexpr, CHUNKS_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    c = tl.load(cut_ptr + row)
    key = tl.load(key_ptr + row).to(tl.uint32)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = chunk * span + lanes
    base = z_ptr + row * stride_z
    lo = chunk * span
    hi = tl.minimum(lo + span, V)
    sampled = t > 0.0
    tt = tl.where(sampled, t, 1.0)
    for v0 in range(lo, hi, BLOCK):
        v = v0 + lanes
        ok = v < hi
        z = tl.load(base + v, mask=ok, other=float("-inf")).to(tl.float32)
        # lowbias32 of v ^ 0x9E3779B9, then of key ^ that (uint32 arithmetic wraps mod 2**32)
        x = v.to(tl.uint32) ^ 0x9E3779B9
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        x = key ^ x
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        u = ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        # -log(u) >= 6e-8 for every u here; the floor only guards a device log that is
        # approximate near u = 1 against returning 0 (then log(0) = -inf, a certain win)
        g = -tl.log(tl.maximum(-tl.log(u), 1.0e-30))
        s = tl.where(sampled, tl.math.div_rn(z, tt) + g, z)
        s = tl.where(ok & (z >= c), s, float("-inf"))
        take = s > best
        best = tl.where(take, s, best)
        best_i = tl.where(take, v, best_i)
    m = tl.max(best, axis=0)
    first = tl.min(tl.where(best == m, best_i, 2147483647), axis=0)
    tl.store(val_ptr + row * CHUNKS_ + chunk, m)
    tl.store(idx_ptr + row * CHUNKS_ + chunk, first)


@jit
def _first_max_kernel(val_ptr, idx_ptr, out_ptr, CHUNKS_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, CHUNKS_)
    val = tl.load(val_ptr + row * CHUNKS_ + k)
    idx = tl.load(idx_ptr + row * CHUNKS_ + k)
    m = tl.max(val, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(val == m, idx, 2147483647), axis=0).to(tl.int64))


def gumbel_argmax_triton(logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor,
                         keys: torch.Tensor) -> torch.Tensor:
    """The Triton schedule. CUDA, or CPU under the interpreter."""
    R, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    span = -(-V // CHUNKS)
    span = -(-span // BLOCK_V) * BLOCK_V               # whole steps per stretch
    vals = torch.empty(R, CHUNKS, dtype=torch.float32, device=logits.device)
    idx = torch.empty(R, CHUNKS, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(R, CHUNKS)](logits, temperature.to(torch.float32).contiguous(),
                                       cut.to(torch.float32).contiguous(), keys.contiguous(), vals, idx, V,
                                       logits.stride(0), span, BLOCK=BLOCK_V, CHUNKS_=CHUNKS, num_warps=4)
    _first_max_kernel[(R,)](vals, idx, out, CHUNKS_=CHUNKS, num_warps=1)
    return out
