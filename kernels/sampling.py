"""Gumbel-max next-token choice: one fused pass over each logits row, no float64 on the GPU.

Public API
  ``gumbel_argmax(logits[R, V], temperature fp32[R], cut fp32[R], keys int64[R]) -> int64[R]``
      dispatcher (CUDA -> Triton, else the reference twin)
  ``gumbel_argmax_reference`` / ``gumbel_argmax_triton`` twins, ``mix32``, ``noise_uniform``,
  ``BLOCK_V``, ``CHUNKS``

For row r with logits z (any float dtype, read exactly as fp32), temperature T (0 = greedy), a
support cut c (-inf = every token) and a 32-bit key k (in [0, 2**32)):

    h_v   = mix32(k ^ mix32(v ^ 0x9E3779B9))           lowbias32 integer hash, exact
    u_v   = ((h_v >> 9) + 0.5) * 2**-23                23-bit uniform in (0, 1), exact in fp32
    g_v   = -log(-log(u_v))                            Gumbel(0, 1) noise
    s_v   = z_v / T + g_v   if T > 0,   z_v   if T == 0
    token = the first v maximising s_v over {v : z_v >= c}

so the choice is ``argmax`` of tempered logits plus Gumbel noise (an exact sample of the tempered
softmax restricted to the support), and greedy rows are plain ``argmax`` (first index on ties).

Rounding schedule
  * z_v / T: one correctly rounded fp32 division; + g_v: one correctly rounded fp32 addition.
  * reference (CPU): g_v in float64 from basic operations (``_ref.log64``, position-free, so a
    row's noise does not depend on where it sits in the tensor or on the thread count), rounded
    once to fp32. float64 is used on the CPU only.
  * Triton: g_v with the device's fp32 ``log``: a pure function of (k, v), so still independent
    of the batch, but a few ulps away from the reference's; the two choose the same token except
    where two scores of a row are within those ulps.
  * argmax: exact. The Triton kernel cuts a row into ``CHUNKS`` stretches of ``BLOCK_V``-wide
    steps; each lane keeps its first maximum (strict ``>``), the row's token is the smallest index
    among the lanes and stretches holding the maximum. Max and min are exact and order-free, so
    the token is the first maximiser whatever the grid: no reduction crosses rows, and a row's
    token depends only on (its logits, T, c, k).
"""

from __future__ import annotations

import torch

from . import _ref
from ._triton_util import jit, tl, want_triton

__all__ = ["gumbel_argmax", "gumbel_argmax_reference", "gumbel_argmax_triton", "mix32", "noise_uniform",
           "BLOCK_V", "CHUNKS"]

BLOCK_V = 1024
"""Vocabulary step of the Triton kernel (lanes per program)."""
CHUNKS = 16
"""Programs per row in the Triton kernel (each scans one stretch of the vocabulary)."""

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


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor,
                  keys: torch.Tensor) -> torch.Tensor:
    """The next token of every row (module docstring): Triton on CUDA, the reference elsewhere."""
    if want_triton(logits):
        return gumbel_argmax_triton(logits, temperature, cut, keys)
    return gumbel_argmax_reference(logits, temperature, cut, keys)
