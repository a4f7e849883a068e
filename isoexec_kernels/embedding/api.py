"""Token embedding lookup: ``table[ids]``.

Public API
  ``embedding(ids, table)``            dispatcher, differentiable in ``table``
  ``embedding_reference(ids, table)``  the same function (one implementation on all devices)

Why there is no Triton twin: a gather does no arithmetic. Each output element is a copy of one
table element, so it is bitwise the table value on every device, batch size and row position;
torch indexing (``torch.nn.functional.embedding``) is used on CPU and CUDA alike.

Rounding schedule: none (exact copy). Backward (``grad_table``): rows of the incoming gradient
are added into the table rows of their ids by torch's embedding backward -- on CPU sequentially
in token order, on CUDA by its sort-by-id segment reduction, both deterministic for a given
``ids``. It is not batch invariant (it is a sum over the batch, used only by the trainer).
"""

from __future__ import annotations

import torch

from .reference import embedding_reference


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Batch-invariant embedding lookup (see module docstring); differentiable in ``table``."""
    return embedding_reference(ids, table)
