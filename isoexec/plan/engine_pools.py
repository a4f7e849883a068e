"""The engine's two pools, allocated once when the engine is built and kept for the whole run:
the paged KV cache and, for the hybrid families, the recurrent-state slots.

Their sizes come from the allocators the engine itself calls (``KVCache.allocate``,
``GDNState.allocate``), run on the ``meta`` device: the same shapes and dtypes, no memory. So a
change to what a page or a state slot holds changes the plan with it.

- KV (counted by ``isoexec.engine.kv_pool_bytes``, which the run's ``kv_cache_gib`` uses too): one cache per attention layer (``cfg.num_kv_layers``: every layer for dense and mla_moe,
  the full-attention layers of the hybrids), K and V each ``[num_pages, page_size, num_kv_heads,
  head_dim]`` in the model dtype (mla_moe caches the expanded K/V, ``num_heads`` rows of
  ``attn_width``).
- recurrent state (``ModelRunner``): ``num_state_slots + 1`` slots (one scratch slot for padded
  CUDA-graph lanes), per GDN layer a ``GDNState`` (fp32 state at the chunk boundary and after the
  last token, the open chunk's keys, values, decays and betas) and a conv window
  ``[conv_dim, kernel - 1]`` in the model dtype.
"""

from __future__ import annotations

import torch

from isoexec_kernels.gdn_core import GDNState

from ..engine.kv_pool_bytes import TORCH_DTYPES, kv_bytes_per_page, kv_pool_bytes  # noqa: F401 (the plan's API)
from ..model import FAMILY_MODELS
from ..model.tensor_parallel import rank_parameter_count
from ..model_config import HybridConfig


def engine_weight_elements(family: str, cfg, engine_tp: int) -> int:
    """Parameter elements of the engine on one GPU with ``engine_tp > 1``: the largest rank's
    shards, cut by the family's tensor-parallel model itself on the ``meta`` device."""
    model_cls = FAMILY_MODELS[family][0]
    model = model_cls(cfg, device="meta")
    return max(rank_parameter_count(model, engine_tp, r) for r in range(engine_tp))


def recurrent_state_bytes(cfg, num_state_slots: int, chunk: int, dtype: str, engine_tp: int = 1,
                          chunk_form: bool = False) -> int:
    """Bytes of the hybrid families' state slots (0 for families without GDN layers); a
    tensor-parallel engine's rank holds ``1 / engine_tp`` of the value heads and conv channels.
    ``chunk_form``: the GDN core keeps the open chunk's queries and rows of Vn and T too (CPR
    version 4, ``isoexec.model.hybrid.contract_gdn_chunk_form``)."""
    if not isinstance(cfg, HybridConfig) or not cfg.gdn_layers:
        return 0
    slots = num_state_slots + 1                 # + the scratch slot of padded graph lanes
    st = GDNState.allocate(slots, cfg.linear_num_value_heads // engine_tp, cfg.linear_key_head_dim,
                           cfg.linear_value_head_dim, "meta", chunk=chunk, with_q=chunk_form,
                           value_dtype=TORCH_DTYPES[dtype])
    per_layer = st.nbytes
    conv = torch.empty((slots, cfg.conv_dim // engine_tp, cfg.linear_conv_kernel_dim - 1),
                       dtype=TORCH_DTYPES[dtype], device="meta")
    return len(cfg.gdn_layers) * (per_layer + conv.nbytes)
