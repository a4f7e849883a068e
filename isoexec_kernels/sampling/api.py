"""Gumbel-max next-token choice: one fused pass over each logits row, no float64 on the GPU.

Public API
  ``gumbel_argmax(logits[R, V], temperature fp32[R], cut fp32[R], keys int64[R]) -> int64[R]``
      dispatcher (CUDA -> Triton, else the reference twin)
  ``gumbel_argmax_reference`` (``reference.py``) / ``gumbel_argmax_triton`` (``triton_kernels.py``)
  twins, ``mix32``, ``noise_uniform``, ``BLOCK_V``, ``CHUNKS``
Not a contract region: the sampled token's logprob comes from the ``logprob`` op; sampling only
has to be a pure function of the row, so it has no stock twin and no ``IMPLS``.

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

from .._triton_util import want_triton
from .reference import gumbel_argmax_reference
from .triton_kernels import gumbel_argmax_triton


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor,
                  keys: torch.Tensor) -> torch.Tensor:
    """The next token of every row (module docstring): Triton on CUDA, the reference elsewhere."""
    if want_triton(logits):
        return gumbel_argmax_triton(logits, temperature, cut, keys)
    return gumbel_argmax_reference(logits, temperature, cut, keys)
