"""Float64 reference of MLA attention in transformers' own form (no padding, no expansion trick):
the correctness yardstick of the expanded kernels (tests, gates). Not on any invariant path."""

from __future__ import annotations

import torch


def mla_attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v per packed sequence in float64; q/k [T, H, d_qk], v [T, H, d_v]."""
    out = torch.zeros(q.shape[:2] + (v.shape[-1],), dtype=torch.float64)
    cu = [int(x) for x in cu_seqlens.tolist()]
    for s, e in zip(cu[:-1], cu[1:]):
        if e == s:
            continue
        qs, ks, vs = (t[s:e].double().cpu().transpose(0, 1) for t in (q, k, v))
        att = (qs @ ks.transpose(1, 2)) * scale
        n = e - s
        att = att.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        out[s:e] = (att.softmax(-1) @ vs).transpose(0, 1)
    return out
