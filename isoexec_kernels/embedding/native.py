"""Token embedding: the stock twin, ``F.embedding`` (the native composition and the negative control of
the gates; no promise about reduction order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_native(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table)
