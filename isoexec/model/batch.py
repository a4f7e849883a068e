"""What one forward pass needs besides token ids: the case and its attention metadata.

The trainer packs whole sequences (``cu_seqlens``: varlen attention over the pack); the engine
runs new tokens of each sequence against a paged KV cache (``cu_seqlens_q``, ``context_lens``,
``block_table``, ``slot_mapping``). Positions are always absolute token positions.

Families with recurrent layers (hybrid: Gated DeltaNet) also give the engine one state slot per
sequence: ``state_slots[b]`` indexes, in every recurrent layer, the gated-delta-rule state
``gdn_states[i]`` and the conv window ``conv_states[i]`` (i = ordinal of the recurrent layer). The
model reads and advances them in place; a fresh sequence needs its slot reset first (zeros). The
engine prefill also carries that layout on the host (``gdn_host``), so the recurrent layers plan
their launches without reading it back from the device. These fields stay None for dense models
and for the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from isoexec_kernels import upload
from isoexec_kernels.attention import compute_slot_mapping
from isoexec_kernels.gdn_core import HostPlan


@dataclass
class KVCache:
    """Paged KV cache of every layer: [num_pages, page_size, num_kv_heads, head_dim] each."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int

    @classmethod
    def allocate(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device) -> "KVCache":
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)], page_size)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]


@dataclass
class ForwardBatch:
    case: str
    positions: torch.Tensor                        # [T] int64, absolute positions
    cu_seqlens: Optional[torch.Tensor] = None      # trainer: [B+1] int32 over the pack
    max_seqlen: int = 0
    kv: Optional[KVCache] = None                   # engine
    block_table: Optional[torch.Tensor] = None     # [B, max_pages] int32
    cu_seqlens_q: Optional[torch.Tensor] = None    # [B+1] int32 new tokens per sequence
    context_lens: Optional[torch.Tensor] = None    # [B] int32 keys incl. the new tokens
    slot_mapping: Optional[torch.Tensor] = None    # [T] int64
    max_seqlen_q: int = 0
    gdn_states: Optional[list[Any]] = None         # engine, recurrent layers: GDNState per layer
    conv_states: Optional[list[torch.Tensor]] = None  # engine: [S, conv_dim, W-1] per recurrent layer
    state_slots: Optional[torch.Tensor] = None     # engine: [B] int32 state slot of each sequence
    gdn_host: Optional[HostPlan] = None            # engine prefill: cu_seqlens_q, the state slots and the
                                                   # tokens each slot holds, on the host (no readbacks)

    @property
    def is_engine(self) -> bool:
        return self.kv is not None

    @classmethod
    def packed(cls, lengths: Sequence[int], case: str, device) -> "ForwardBatch":
        """A trainer batch: whole sequences of ``lengths`` concatenated, positions from 0."""
        lens = torch.tensor(list(lengths), dtype=torch.int32)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]) if lengths else \
            torch.zeros(0, dtype=torch.int64)
        return cls(case=case, positions=positions.to(device), cu_seqlens=cu.to(device),
                   max_seqlen=int(max(lengths, default=0)))

    @classmethod
    def paged(cls, case: str, kv: KVCache, block_tables: Sequence[Sequence[int]], starts: Sequence[int],
              q_lens: Sequence[int], device, *, gdn_states: Optional[list[Any]] = None,
              conv_states: Optional[list[torch.Tensor]] = None,
              state_slots: Optional[Sequence[int]] = None) -> "ForwardBatch":
        """An engine batch: sequence b has ``starts[b]`` tokens cached and ``q_lens[b]`` new ones
        (recurrent families: and its recurrent state in slot ``state_slots[b]``)."""
        width = max((len(t) for t in block_tables), default=1) or 1
        bt = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for b, t in enumerate(block_tables):
            bt[b, :len(t)] = torch.tensor(list(t), dtype=torch.int32)
        ql = torch.tensor(list(q_lens), dtype=torch.int32)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(ql, 0)
        ctx = torch.tensor([s + n for s, n in zip(starts, q_lens)], dtype=torch.int32)
        positions = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, q_lens)])
        slots = compute_slot_mapping(bt, cu, ctx, kv.page_size)
        sslots = host = None
        if state_slots is not None:
            sslots = upload(torch.tensor(list(state_slots), dtype=torch.int32), device)
            host = HostPlan.of(q_lens, state_slots, starts)
        # non-blocking copies from pinned memory: a blocking one would wait for the work queued before
        return cls(case=case, positions=upload(positions, device), kv=kv, block_table=upload(bt, device),
                   cu_seqlens_q=upload(cu, device), context_lens=upload(ctx, device),
                   slot_mapping=upload(slots, device), max_seqlen_q=int(max(q_lens, default=0)),
                   gdn_states=gdn_states, conv_states=conv_states, state_slots=sslots, gdn_host=host)
