"""Stock attention twins built on ``torch.nn.functional.scaled_dot_product_attention``.

They take the same arguments as the invariant API in ``attention.py`` and compute the same
function, the way a stock stack does it. The trainer's varlen attention on a GPU (fp16/bf16) is
torch's FlashAttention-2 varlen kernel on the packed rows (``aten::_flash_attention_forward`` with
cumulative sequence lengths, GQA native, autograd through its own backward): the fastest stock
path torch offers, the one a stock RL trainer uses, with no padding and no host round trip.
The engine's paged cases on a GPU gather each sequence's pages into one packed K/V and run the
same FlashAttention-2 varlen kernel with per-sequence used-key counts (a page gather, then flash:
a stock engine without a paged flash kernel does this; the other stock decode, torch's
flex_attention reading the pages in place, is ``flex_paged.py``, impl ``torch_flex_decode``).
Elsewhere (CPU, fp32) sequences are padded into one [B, H, L, D] batch and SDPA runs once with
a boolean causal + padding mask (SDPA picks its backend and blocking from the padded shape).
They are the native composition and the negative control: their bits depend on the batch
(padding length, batch size, the flash kernel's scheduling) and on prefill vs decode shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._empty import no_token


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


def _flash_varlen_usable(q: torch.Tensor, v: torch.Tensor) -> bool:
    d = max(q.shape[-1], v.shape[-1])
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0
            and d <= 256 and hasattr(torch.ops.aten, "_flash_attention_forward"))


def _same_head_dim(q, k, v):
    """Flash needs one head dim for q, k and v; MLA has a value head dim unlike the query's.
    Zero-pad the narrower side to the wider (a stock engine does this for MLA): zero query/key
    columns add nothing to a score (the scale is passed explicitly), zero value columns give zero
    output columns, dropped by the caller through the returned value width."""
    dq, dv = q.shape[-1], v.shape[-1]
    if dv < dq:
        v = F.pad(v, (0, dq - dv))
    elif dq < dv:
        q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
    return q, k, v, dv


def attention_native_varlen(q, k, v, cu_seqlens, max_seqlen: int, scale: float,
                            causal: bool = True) -> torch.Tensor:
    """Stock twin of ``varlen_attention``: FlashAttention-2 varlen on a GPU (module docstring),
    padded SDPA elsewhere; differentiable either way. No token (an FSDP2 rank's empty pass): no
    kernel, an empty output that gives q, k and v zero gradients (``_empty.no_token``)."""
    if q.shape[0] == 0:
        return no_token((0, q.shape[1], v.shape[-1]), q.dtype, q, k, v)
    if _flash_varlen_usable(q, v):
        cu = cu_seqlens.to(torch.int32)
        n = max(int(max_seqlen), 1)
        q, k, v, dv = _same_head_dim(q, k, v)
        out = torch.ops.aten._flash_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, n, n, 0.0, causal, False, scale=scale)[0]
        return out[..., :dv]
    cu = [int(x) for x in cu_seqlens.tolist()]
    starts, lens = cu[:-1], [e - s for s, e in zip(cu[:-1], cu[1:])]
    width = max(max(lens, default=0), 1)
    out = _sdpa_padded(_pad_rows(q, starts, lens, width), _pad_rows(k, starts, lens, width),
                       _pad_rows(v, starts, lens, width), lens, lens, scale, causal)
    return _unpad_rows(out, lens)


def _gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[B, P] page ids -> every sequence's keys [B, P * page_size, H, D] (pages in table order).
    Rows past a sequence's context are garbage and masked out by the caller."""
    b, p = block_table.shape
    return cache[block_table.long()].reshape(b, p * cache.shape[1], *cache.shape[2:])


def attention_native_paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens,
                                   scale: float, max_seqlen_q: int | None = None) -> torch.Tensor:
    """Stock twin of ``paged_prefill_attention``: gather every sequence's pages, pad the queries,
    one masked SDPA call (on a GPU in fp16/bf16: FlashAttention-2 varlen over the gathered pages,
    ``_flash_paged``). Vectorised on the device (no per-sequence loop, no host sync when
    ``max_seqlen_q`` is given), so it is CUDA-graph capturable and a fair speed baseline. No new
    token: an empty output, no kernel."""
    if q.shape[0] == 0:
        return q.new_zeros((0, q.shape[1], v_cache.shape[-1]))
    dev = q.device
    n_seq = block_table.shape[0]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    if max_seqlen_q is None:
        max_seqlen_q = int(q_lens.max().item()) if n_seq else 0
    if _flash_varlen_usable(q, v_cache) and n_seq:
        return _flash_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, scale,
                            max(int(max_seqlen_q), 1))
    lq = max(int(max_seqlen_q), 1)
    t = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(n_seq, device=dev), q_lens, output_size=t)
    row = seq * lq + torch.arange(t, device=dev) - cu_seqlens_q[:-1].long()[seq]
    q_pad = q.new_zeros((n_seq * lq,) + tuple(q.shape[1:])).index_copy(0, row, q).view(n_seq, lq, *q.shape[1:])
    k_pad, v_pad = _gather_pages(k_cache, block_table), _gather_pages(v_cache, block_table)
    i = torch.arange(lq, device=dev)[None, :, None]
    j = torch.arange(k_pad.shape[1], device=dev)[None, None, :]
    ctx = context_lens.long()[:, None, None]
    mask = (j < ctx) & (j <= ctx - q_lens[:, None, None] + i)
    mask = mask | (j == 0)  # padded query rows see key 0 (no all-masked rows); discarded below
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k_pad.transpose(1, 2), v_pad.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=True).transpose(1, 2)
    return out.reshape(n_seq * lq, *out.shape[2:]).index_select(0, row)


def _flash_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, scale, max_seqlen_q):
    """FlashAttention-2 varlen over the gathered pages: sequence b's keys are the W = pages x
    page_size rows starting at b * W, of which the first context_lens[b] are used (``seqused_k``);
    causal alignment is bottom-right, so query i of a q_len chunk sits at ctx - q_len + i. Shapes
    are static (W from the block table's width), so a decode step is CUDA-graph capturable."""
    b, p = block_table.shape
    width = p * k_cache.shape[1]
    k = _gather_pages(k_cache, block_table).reshape(b * width, *k_cache.shape[2:])
    v = _gather_pages(v_cache, block_table).reshape(b * width, *v_cache.shape[2:])
    cu_k = torch.arange(0, (b + 1) * width, width, dtype=torch.int32, device=q.device)
    q, k, v, dv = _same_head_dim(q, k, v)
    return torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q.to(torch.int32), cu_k, max_seqlen_q, width,
        0.0, True, False, scale=scale, seqused_k=context_lens.to(torch.int32))[0][..., :dv]


def attention_native_paged_decode(q, k_cache, v_cache, block_table, context_lens,
                                  scale: float) -> torch.Tensor:
    """Stock twin of ``paged_decode_attention`` (q [B, Hq, D])."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return attention_native_paged_prefill(q, k_cache, v_cache, block_table, cu, context_lens,
                                          scale, max_seqlen_q=1)
