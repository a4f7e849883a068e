"""The global gradient norm of sharded gradients, in a fixed order.

The clip coefficient multiplies every gradient, so its norm must not drift in its last bit from
run to run (``isoexec/train/optim.py``). With the gradients sharded over ``dp`` no rank holds a
whole tensor: each rank takes the fp32 sum of squares of its shard of every parameter by the fixed
halves tree (``sum_of_squares``), the per-parameter sums of all ranks are gathered (a copy, as raw
bytes), and every rank adds them in one order: for each parameter in order, its ranks' sums left
to right in rank order, then that onto the running total (the first parameter's taken as it is,
as ``global_grad_norm`` does); then the correctly rounded square root. Same bits on every rank
and from run to run at a fixed dp.

Not the single process's bits: there each parameter's squares are summed by one tree over the
whole tensor, here by one tree per shard and then across shards, a different order of the same
fp32 additions (a relative difference of a few fp32 ulps).

Parameters held in another layout (``counted``): the expert-parallel trainer's expert slices are
not dp shards. Rank r holds a slice of its ep group, and after the replica sum every rank of an
``ep_replica`` column holds the same slice with the same gradient bits (``ep_adamw.py``). Summing
every rank's squares would count each slice N / ep times, so such a parameter counts the ranks of
the first ep group only (ranks 0 .. ep - 1, which hold every slice once), in rank order, at its
place in the parameter order.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from isoexec.dist.collectives import gather_in_rank_order
from isoexec.train.optim import sum_of_squares


def sharded_grad_norm(grads: Sequence[Optional[torch.Tensor]], group, dp: int,
                      counted: Optional[Sequence[Optional[range]]] = None) -> torch.Tensor:
    """fp32 L2 norm of the gradients ``grads`` (DTensors sharded over ``group`` of size ``dp``;
    None counts as zero, and must be None on every rank alike). ``counted[i]``: the ranks whose
    squares of ``grads[i]`` are added (None, or ``counted`` None: all ``dp``; module docstring)."""
    local, ranks = [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        shard = g.to_local() if hasattr(g, "to_local") else g
        local.append(sum_of_squares(shard))
        c = None if counted is None else counted[i]
        ranks.append(range(dp) if c is None else c)
    if not local:
        return torch.zeros((), dtype=torch.float32)
    parts = gather_in_rank_order(torch.stack(local), group, dp)   # [dp, params]
    total = None
    for i, rs in enumerate(ranks):
        s = parts[rs[0], i]
        for r in rs[1:]:
            s = s + parts[r, i]
        total = s if total is None else total + s
    return torch.sqrt(total)
