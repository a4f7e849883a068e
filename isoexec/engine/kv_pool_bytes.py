"""Bytes of the engine's paged KV cache, from the allocator the engine itself calls
(``KVCache.allocate``) on the ``meta`` device: the same shapes and dtypes, no memory. The run sizes
a ``kv_cache_gib`` budget in pages with it, and the memory plan (``isoexec.plan.engine_pools``) its
KV column, so a change to what a page holds changes both.

One cache per attention layer (``cfg.num_kv_layers``: every layer for dense and mla_moe, the
full-attention layers of the hybrids), K and V each ``[num_pages, page_size, num_kv_heads,
head_dim]`` in the model dtype (mla_moe caches the expanded K/V, ``num_heads`` rows of
``attn_width``).
"""

from __future__ import annotations

import torch

from ..model import KVCache

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def kv_pool_bytes(cfg, num_pages: int, page_size: int, dtype: str, engine_tp: int = 1) -> int:
    """Bytes of the engine's KV cache on one GPU: every attention layer's K and V pages, of the
    ``num_kv_heads / engine_tp`` heads a tensor-parallel engine's rank caches."""
    n_layers = getattr(cfg, "num_kv_layers", cfg.num_layers)
    if n_layers == 0:
        return 0
    kv = KVCache.allocate(n_layers, num_pages, page_size, cfg.num_kv_heads // engine_tp, cfg.head_dim,
                          TORCH_DTYPES[dtype], "meta")
    return sum(t.nbytes for t in kv.k + kv.v)


def kv_bytes_per_page(cfg, page_size: int, dtype: str, engine_tp: int = 1) -> int:
    """What one more KV page costs (all layers): the unit in which a pool can be shrunk."""
    return kv_pool_bytes(cfg, 1, page_size, dtype, engine_tp)
