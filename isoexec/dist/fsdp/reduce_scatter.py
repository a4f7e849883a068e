"""The gradient reduce-scatter of the FSDP2 trainer: the ranks' gradients added in rank order.

FSDP2 sums each unit's gradients over the ``dp`` ranks with one ``reduce_scatter``: rank r ends
with the sum, over ranks, of chunk r of every rank's flat gradient. The stock collective adds in
an order the backend picks from the group size, the message size and its algorithm (ring, tree,
halving-doubling). This one fixes the order itself, as ``collectives.sum_in_rank_order`` does for
the tensor-parallel backward: an ``all_to_all`` sends chunk r of every rank's gradient to rank r
(a copy, no arithmetic; the same bytes a ring reduce-scatter moves), and rank r adds the dp pieces
left to right in rank order, rank 0's taken as it is. So

- for a fixed dp the reduced gradient is a function of the ranks' gradients alone: run to run it
  has the same bits on any backend;
- it is the sum a single process makes when it accumulates the same per-rank gradients one after
  another (``MasterAdamW.accumulate_grads``: fp32, micro-batch order): a single process whose
  micro-batches are the ranks' shares gets the same bits (tests/dist/test_fsdp_trainer.py).

It is plugged in with ``FSDPModule.set_custom_reduce_scatter``, which takes any object with FSDP2's
``allocate`` and ``__call__`` (the ``ReduceScatter`` interface); only a plain sum is accepted, so
the trainer also sets a gradient divide factor of 1 and sum-only reductions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RankOrderReduceScatter:
    """FSDP2 reduce-scatter (``set_custom_reduce_scatter``): all_to_all, then a sum in rank order."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"RankOrderReduceScatter adds gradients only (ReduceOp.SUM), got {op}; the trainer "
                             "sets a divide factor of 1 and sum-only reductions on every FSDP unit")
        dp = group.size()
        if input_tensor.numel() != dp * output_tensor.numel():
            raise ValueError(f"reduce-scatter input of {input_tensor.numel()} elements is not dp={dp} times the "
                             f"output's {output_tensor.numel()}")
        # raw bytes: the backend copies bits whatever the dtype (as collectives.gather_in_rank_order)
        payload = input_tensor.contiguous().reshape(-1).view(torch.uint8)
        received = torch.empty_like(payload)
        dist.all_to_all_single(received, payload, group=group)
        parts = received.view(input_tensor.dtype).reshape(dp, -1)
        out = output_tensor.view(-1)
        out.copy_(parts[0])
        for r in range(1, dp):
            out.add_(parts[r])
        return None
