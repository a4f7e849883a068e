"""Token embedding: the fixed-order torch twin (runs on any device; the CPU path of the public API).
The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_reference(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[ids]`` -> ``[*ids.shape, H]``; exact copy of rows."""
    if table.dim() != 2:
        raise ValueError(f"embedding: table must be [V, H], got {tuple(table.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding: ids must be int32/int64, got {ids.dtype}")
    return F.embedding(ids, table)
