"""The engine's two pools, allocated once when the engine is built and kept for the whole run:
the paged KV cache and, for the hybrid families, the recurrent-state slots.

Their sizes come from the allocators the engine itself calls (``KVCache.allocate``,
``GDNState.allocate``), run on the ``meta`` device: the same shapes and dtypes, no memory. So a
change to what a page or a state slot holds changes the plan with it.

- KV: one cache per attention layer (``cfg.num_kv_layers``: every layer for dense and mla_moe,
  the full-attention layers of the hybrids), K and V each ``[num_pages, page_size, num_kv_heads,
  head_dim]`` in the model dtype (mla_moe caches the expanded K/V, ``num_heads`` rows of
  ``attn_width``).
- recurrent state (``ModelRunner``): ``num_state_slots + 1`` slots (one scratch slot for padded
  CUDA-graph lanes), per GDN layer a ``GDNState`` (fp32 state at the chunk boundary and after the
  last token, the open chunk's keys, values, decays and betas) and a conv window
  ``[conv_dim, kernel - 1]`` in the model dtype.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from isoexec_kernels.gdn_core import GDNState

from ..model import FAMILY_MODELS, KVCache
from ..model.tensor_parallel import rank_parameter_count
from ..model_config import HybridConfig

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


def engine_weight_elements(family: str, cfg, engine_tp: int) -> int:
    """Parameter elements of the engine on one GPU with ``engine_tp > 1``: the largest rank's
    shards, cut by the family's tensor-parallel model itself on the ``meta`` device."""
    model_cls = FAMILY_MODELS[family][0]
    model = model_cls(cfg, device="meta")
    return max(rank_parameter_count(model, engine_tp, r) for r in range(engine_tp))


def recurrent_state_bytes(cfg, num_state_slots: int, chunk: int, dtype: str, engine_tp: int = 1) -> int:
    """Bytes of the hybrid families' state slots (0 for families without GDN layers); a
    tensor-parallel engine's rank holds ``1 / engine_tp`` of the value heads and conv channels."""
    if not isinstance(cfg, HybridConfig) or not cfg.gdn_layers:
        return 0
    slots = num_state_slots + 1                 # + the scratch slot of padded graph lanes
    st = GDNState.allocate(slots, cfg.linear_num_value_heads // engine_tp, cfg.linear_key_head_dim,
                           cfg.linear_value_head_dim, "meta", chunk=chunk)
    per_layer = sum(getattr(st, f.name).nbytes for f in fields(st))
    conv = torch.empty((slots, cfg.conv_dim // engine_tp, cfg.linear_conv_kernel_dim - 1),
                       dtype=TORCH_DTYPES[dtype], device="meta")
    return len(cfg.gdn_layers) * (per_layer + conv.nbytes)
