"""Stock twin of the expanded MLA attention: the same expansion and zero padding (what a stock
engine does to run MLA prefill on FlashAttention, whose q/k and v head dims must agree), then the
stock attention of ``isoexec_kernels.attention.native`` (SDPA over padded batches on the CPU,
FlashAttention-2 varlen on a GPU): batch-variant, the native composition's ``attn_core`` for the
mla_moe family. Same arguments as the functions of ``api.py``."""

from __future__ import annotations

import torch

from ..attention.native import attention_native_paged_prefill, attention_native_varlen
from .api import mla_width, pad_heads


def mla_native_varlen(q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
    w = mla_width(q.shape[-1], v.shape[-1])
    out = attention_native_varlen(pad_heads(q, w), pad_heads(k, w), pad_heads(v, w), cu_seqlens, max_seqlen, scale)
    return out[..., :v.shape[-1]]


def mla_native_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, scale: float,
                             max_seqlen_q: int | None = None, v_dim: int | None = None) -> torch.Tensor:
    out = attention_native_paged_prefill(pad_heads(q, k_cache.shape[-1]), k_cache, v_cache, block_table,
                                         cu_seqlens_q, context_lens, scale, max_seqlen_q=max_seqlen_q)
    return out if v_dim is None else out[..., :v_dim]


def mla_native_paged_decode(q, k_cache, v_cache, block_table, context_lens, scale: float,
                            v_dim: int | None = None) -> torch.Tensor:
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return mla_native_paged_prefill(q, k_cache, v_cache, block_table, cu, context_lens, scale, max_seqlen_q=1,
                                    v_dim=v_dim)
