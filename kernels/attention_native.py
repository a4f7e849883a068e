"""Stock attention twins built on ``torch.nn.functional.scaled_dot_product_attention``.

They take the same arguments as the invariant API in ``attention.py`` and compute the same
function, the way a stock stack does it: sequences are padded into one [B, H, L, D] batch and
SDPA runs once with a boolean causal + padding mask (SDPA picks its backend and blocking from
the padded shape). They are the native composition and the negative control: their bits
depend on the batch (padding length, batch size) and on prefill vs decode shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _pad_rows(x: torch.Tensor, starts: list[int], lens: list[int], width: int) -> torch.Tensor:
    """[T, H, D] rows of B segments -> [B, width, H, D] zero padded (differentiable)."""
    b = len(lens)
    index = torch.cat([torch.arange(n, device=x.device) + i * width for i, n in enumerate(lens)])
    src = torch.cat([torch.arange(s, s + n, device=x.device) for s, n in zip(starts, lens)])
    flat = x.new_zeros((b * width,) + tuple(x.shape[1:]))
    flat = flat.index_copy(0, index, x.index_select(0, src))
    return flat.view(b, width, *x.shape[1:])


def _unpad_rows(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """[B, width, H, D] -> [sum(lens), H, D]."""
    width = x.shape[1]
    index = torch.cat([torch.arange(n, device=x.device) + i * width for i, n in enumerate(lens)])
    return x.reshape(-1, *x.shape[2:]).index_select(0, index)


def _sdpa_padded(q_pad, k_pad, v_pad, q_lens, ctx_lens, scale, causal):
    """q_pad [B, Lq, Hq, D], k/v_pad [B, Lk, Hkv, D]; query i of sequence b sits at absolute
    position ctx_b - q_len_b + i and sees keys j < ctx_b (and j <= its position if causal)."""
    dev = q_pad.device
    lq, lk = q_pad.shape[1], k_pad.shape[1]
    q_len = torch.tensor(q_lens, device=dev)[:, None, None]
    ctx = torch.tensor(ctx_lens, device=dev)[:, None, None]
    i = torch.arange(lq, device=dev)[None, :, None]
    j = torch.arange(lk, device=dev)[None, None, :]
    mask = j < ctx
    if causal:
        mask = mask & (j <= ctx - q_len + i)
    mask = mask | (j == 0)  # padded query rows see key 0 (no all-masked rows); discarded later
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k_pad.transpose(1, 2), v_pad.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def attention_native_varlen(q, k, v, cu_seqlens, max_seqlen: int, scale: float,
                            causal: bool = True) -> torch.Tensor:
    """Stock twin of ``varlen_attention`` (autograd through SDPA)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    starts, lens = cu[:-1], [e - s for s, e in zip(cu[:-1], cu[1:])]
    width = max(max(lens, default=0), 1)
    out = _sdpa_padded(_pad_rows(q, starts, lens, width), _pad_rows(k, starts, lens, width),
                       _pad_rows(v, starts, lens, width), lens, lens, scale, causal)
    return _unpad_rows(out, lens)


def attention_native_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens,
                                   scale: float, max_seqlen_q: int | None = None) -> torch.Tensor:
    """Stock twin of ``paged_prefill_attention``: gather each sequence's keys from its pages,
    pad, one SDPA call."""
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    ctx_lens = [int(x) for x in context_lens.tolist()]
    starts, q_lens = cu[:-1], [e - s for s, e in zip(cu[:-1], cu[1:])]
    page_size = k_cache.shape[1]
    width_k = max(max(ctx_lens, default=0), 1)
    k_pad = k_cache.new_zeros((len(q_lens), width_k) + tuple(k_cache.shape[2:]))
    v_pad = torch.zeros_like(k_pad)
    for b, n in enumerate(ctx_lens):
        pages = block_table[b, : -(-n // page_size)].long()
        k_pad[b, :n] = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n]
        v_pad[b, :n] = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n]
    q_pad = _pad_rows(q, starts, q_lens, max(max(q_lens, default=0), 1))
    out = _sdpa_padded(q_pad, k_pad, v_pad, q_lens, ctx_lens, scale, True)
    return _unpad_rows(out, q_lens)


def attention_native_paged_decode(q, k_cache, v_cache, block_table, context_lens,
                                  scale: float) -> torch.Tensor:
    """Stock twin of ``paged_decode_attention`` (q [B, Hq, D])."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return attention_native_paged_prefill(q, k_cache, v_cache, block_table, cu, context_lens,
                                          scale)
