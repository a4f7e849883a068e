"""Stock paged decode on torch's ``flex_attention``: the paged K/V cache read in place through a
BlockMask built from the block table (the pattern of torch's
``torch.nn.attention.experimental._paged_attention.PagedAttention``), no page gather.

Same arguments and function as ``attention_native_paged_decode`` (``native.py``): q [B, Hq, D],
caches [P, page, Hkv, D], block_table [B, W] int32, context_lens [B] (keys including the new
token), the scale given; GQA with Hq a multiple of Hkv. It is the engine-decode half of the
``torch_flex_decode`` stock implementation (``__init__.py``); ``isoexec bench attention`` times it
next to the page gather + FlashAttention-2 path of ``torch_sdpa``.

Layout. Each cache is viewed, without a copy, as ONE key sequence of N = P * page rows shared by
the whole batch ([1, Hkv, N, D]; flex broadcasts a key batch of 1). The BlockMask's KV block is
one page, so a block index is a physical page id: sequence b lists the first
n_b = ceil(ctx_b / page) entries of its block-table row, and the kernel reads those pages in
place. Every listed page but the last is complete; in the last page only the first
rem_b = ctx_b - (n_b - 1) * page rows are context. Hence the mask

    mask_mod(b, kv) = page(kv) != last_b  or  offset(kv) < rem_b

is exact on the listed pages, and the kernel visits nothing else. No physical-to-logical page
table is needed (torch's PagedAttention keeps one of [batch, P] entries; building it per call
would cost B x P writes per layer).

Every listed page is a partial flex block (mask_mod evaluated on it). A layout with the complete
pages as flex "full" blocks (mask_mod skipped) and only the last page partial computes the same
function on the CPU, but on the H200 (torch 2.11, commit 5dbab7f) the compiled decode kernel gave
wrong outputs with it (max |diff| 0.12-0.27 against the gather path; the GPU test failed), so it
was removed.

Eager flex (CPU, or any call without ``torch.compile``) evaluates mask_mod on every key of N and
ignores the block lists; there the exact dense mask ``flex_paged_dense_mask`` (key n of the cache
is visible to sequence b) replaces the mask_mod. The tests check, on scattered pages, that the
block lists with the page mask give exactly that dense mask.

CUDA: ``torch.compile(flex_attention, dynamic=False)``, built once. flex's decode kernel needs a
static batch (and a power-of-two GQA group; Qwen3's 16/8 and 32/8 are), so the batch is padded
on the device to the next power of two (padded lanes: page 0, one key; sliced off): an eager
engine compiles at most log2(max batch) + 1 variants, the engine's decode graphs (batch buckets
1, 2, 4, ...) one each. Block tables and context lengths are tensors, so a new step recompiles
nothing; the BlockMask is a few device ops on them (no host sync), so the step is capturable
in the engine's decode graphs. The recompile limit of dynamo is raised to ``RECOMPILE_LIMIT``
(a process-wide setting) so that the bucket variants never fall back to eager flex.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .native import attention_native_paged_decode

Q_BLOCK = 128
"""The BlockMask's query block (the one decode row sits in block 0); a multiple of every
BLOCK_M flex's decode kernel uses."""

RECOMPILE_LIMIT = 64

_NO_Q_BLOCKS = ({"compute_q_blocks": False}
                if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {})
# the transposed (query-block) lists serve the backward only, and torch builds them densely over
# the index width, which physical page ids overrun


def _pages(block_table: torch.Tensor, context_lens: torch.Tensor, page_size: int):
    """Per sequence: pages holding context n_b, the physical id of the last one, and the context
    rows in it rem_b in [1, page] (int64, on the device)."""
    ctx = context_lens.long().clamp(min=1)   # a sequence always has its new token
    n = (ctx + page_size - 1) // page_size
    last_col = (n - 1).clamp(max=block_table.shape[1] - 1)
    last = block_table.long().gather(1, last_col[:, None]).squeeze(1)
    return n, last, ctx - (n - 1) * page_size


def flex_paged_block_mask(block_table: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                          num_pages: int, index_width: int | None = None,
                          dense_mask: torch.Tensor | None = None) -> BlockMask:
    """The decode BlockMask over a cache of ``num_pages`` pages (module docstring): one query row
    of ``Q_BLOCK``, KV blocks = pages, every listed page a partial block. ``index_width`` pads the
    index lists with zeros to that many columns (flex's CPU kernel wants width x page >= the cache
    length); ``dense_mask`` [B, N] replaces the page mask (eager flex)."""
    n, last, rem = _pages(block_table, context_lens, page_size)
    kv_num, kv_idx = n.to(torch.int32)[:, None, None], block_table.to(torch.int32)[:, None, None, :]
    if index_width is not None:
        kv_idx = torch.nn.functional.pad(kv_idx, (0, index_width - kv_idx.shape[-1]))

    if dense_mask is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            return dense_mask[b, kv_idx]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx // page_size != last[b]) | (kv_idx % page_size < rem[b])

    return BlockMask.from_kv_blocks(kv_num, kv_idx, None, None, BLOCK_SIZE=(Q_BLOCK, page_size),
                                    mask_mod=mask_mod, seq_lengths=(1, num_pages * page_size), **_NO_Q_BLOCKS)


def flex_paged_dense_mask(block_table: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                          num_pages: int) -> torch.Tensor:
    """[B, num_pages * page_size] bool: cache row n is one of sequence b's first context_lens[b]
    keys (logical key j sits on page block_table[b, j // page] at row j % page)."""
    b, w = block_table.shape
    ctx = context_lens.long().clamp(min=1)
    j = torch.arange(w * page_size, device=block_table.device)
    valid = j[None, :] < ctx[:, None]
    slot = block_table.long().repeat_interleave(page_size, dim=1) * page_size + (j % page_size)[None, :]
    slot = torch.where(valid, slot, num_pages * page_size)          # a spare column takes the rest
    mask = torch.zeros(b, num_pages * page_size + 1, dtype=torch.bool, device=block_table.device)
    return mask.scatter_(1, slot, valid)[:, :-1]


def _cache_as_sequence(cache: torch.Tensor) -> torch.Tensor:
    """[P, page, H, D] -> [1, H, P * page, D], a view."""
    p, page, h, d = cache.shape
    return cache.view(1, p * page, h, d).transpose(1, 2)


@functools.lru_cache(maxsize=None)
def compiled_flex_attention(backend: str = "inductor"):
    """``torch.compile(flex_attention, dynamic=False)``, once per backend (tests trace it with
    the ``eager`` backend on CPU to count compiles)."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=False, backend=backend)


def padded_batch(n: int) -> int:
    """The static batch the compiled kernel runs for n sequences: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def flex_paged_decode_compiled(q, k_cache, v_cache, block_table, context_lens, scale: float,
                               backend: str = "inductor") -> torch.Tensor:
    """The CUDA path on any device: batch padded to ``padded_batch``, block-list BlockMask, compiled
    flex. On CPU only the ``inductor`` backend honours the block lists (its kernel also wants the
    index lists padded to the cache's page count, done here)."""
    n = q.shape[0]
    bp = padded_batch(n)
    if bp != n:   # padded lanes: page 0 (block-table zeros), one key
        q = torch.cat([q, q.new_zeros((bp - n,) + tuple(q.shape[1:]))])
        block_table = torch.cat([block_table, block_table.new_zeros((bp - n, block_table.shape[1]))])
        context_lens = torch.cat([context_lens, context_lens.new_ones(bp - n)])
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    mask = flex_paged_block_mask(block_table, context_lens, page_size, num_pages,
                                 index_width=None if q.is_cuda else num_pages)
    out = compiled_flex_attention(backend)(q[:, :, None], _cache_as_sequence(k_cache), _cache_as_sequence(v_cache),
                                           block_mask=mask, scale=scale, enable_gqa=True)
    return out[:n, :, 0]


def flex_paged_decode_eager(q, k_cache, v_cache, block_table, context_lens, scale: float) -> torch.Tensor:
    """flex_attention without compile (dense over the whole cache, exact dense mask): the CPU
    reference of the same call."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    dense = flex_paged_dense_mask(block_table, context_lens, page_size, num_pages)
    mask = flex_paged_block_mask(block_table, context_lens, page_size, num_pages, dense_mask=dense)
    out = flex_attention(q[:, :, None], _cache_as_sequence(k_cache), _cache_as_sequence(v_cache), block_mask=mask,
                         scale=scale, enable_gqa=True)
    return out[:, :, 0]


def attention_flex_paged_decode(q, k_cache, v_cache, block_table, context_lens, scale: float) -> torch.Tensor:
    """Stock twin of ``paged_decode_attention`` on flex_attention (q [B, Hq, D] -> [B, Hq, Dv]):
    compiled on CUDA, eager elsewhere (module docstring)."""
    if q.shape[0] == 0:
        return q.new_zeros((0, q.shape[1], v_cache.shape[-1]))
    if q.is_cuda:
        return flex_paged_decode_compiled(q, k_cache, v_cache, block_table, context_lens, scale)
    return flex_paged_decode_eager(q, k_cache, v_cache, block_table, context_lens, scale)


def attention_stock_paged_decode(q, k_cache, v_cache, block_table, context_lens, scale: float) -> torch.Tensor:
    """The engine decode of impl ``torch_flex_decode``: the fastest stock paged decode per device.
    CUDA: compiled flex over the pages in place (:func:`attention_flex_paged_decode`; 2.0-3.1x
    faster than the page gather + FlashAttention-2 on the H200, ``bench attention`` at 5dbab7f).
    Elsewhere: the page gather of ``native.py``, since uncompiled flex is a dense pass over the
    whole cache (a correctness reference, not a stock fast path)."""
    if q.is_cuda:
        return attention_flex_paged_decode(q, k_cache, v_cache, block_table, context_lens, scale)
    return attention_native_paged_decode(q, k_cache, v_cache, block_table, context_lens, scale)
