"""Column-parallel linear (q/k/v, gate/up, lm_head under tensor parallelism).

Each rank holds a slice of the weight's output rows (N) and computes those output columns from the
whole input. Nothing is summed across ranks in the forward: an output column of the invariant GEMM
is a function of the input row and that column's weight row only, so a rank's slice is bit for bit
the same columns of the single-process output, as long as the rank runs the whole weight's
schedule. The one thing to carry over is the weight shape's K leaf count (``k_leaves_for(N, K)``
is keyed on the whole N; a shard's smaller N could select another), passed explicitly.

``gather_output=True`` gathers the slices along N (``all_gather`` of slices padded to the widest,
then the real columns side by side): the single-process output on every rank.
``gather_output=False`` leaves each rank its slice, the input a row-parallel layer expects when the
slices are cut in 64-column units (``unit=BLOCK_K``, partition.py says why they line up).

Autograd: the input is replicated, and each rank's slice contributes a part of its gradient, so the
input gradient is the sum over ranks; it is gathered and added in rank order (deterministic for a
given tp, not tp-invariant, which the backward need not be). With ``gather_output=True`` the
gradient of the gathered output is the same on every rank and each rank keeps its own columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from isoexec_kernels.gemm import k_leaves_for, linear

from .collectives import gather_in_rank_order, group_size_rank, sum_in_rank_order
from .partition import column_shard_range


class _ReplicatedInputFn(torch.autograd.Function):
    """Identity forward; backward: the input gradient summed over ranks in rank order."""

    @staticmethod
    def forward(ctx, x, group, tp):
        ctx.group, ctx.tp = group, tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return sum_in_rank_order(grad.contiguous(), ctx.group, ctx.tp), None, None


class _GatherColumnsFn(torch.autograd.Function):
    """This rank's columns [M, n1 - n0] -> all columns [M, N]; backward: this rank's columns."""

    @staticmethod
    def forward(ctx, y, group, tp, rank, bounds):
        width = max(b - a for a, b in bounds)
        padded = F.pad(y, (0, width - y.shape[-1]))
        every = gather_in_rank_order(padded, group, tp)
        ctx.mine = bounds[rank]
        return torch.cat([every[r, :, :b - a] for r, (a, b) in enumerate(bounds)], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.mine
        return grad[:, a:b].contiguous(), None, None, None, None


def replicated_input(x: torch.Tensor, group=None) -> torch.Tensor:
    """``x`` as the replicated input of column-parallel work the caller runs itself (a fused q/k/v
    shard through the contract's bound linear): the identity forward, and in the backward the
    ranks' input gradients summed in rank order (``column_parallel_linear`` does this itself)."""
    tp, _ = group_size_rank(group)
    if tp > 1 and torch.is_grad_enabled() and x.requires_grad:
        return _ReplicatedInputFn.apply(x, group, tp)
    return x


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                           out_features: int, group=None, gather_output: bool = True, unit: int = 1,
                           leaves: int | None = None) -> torch.Tensor:
    """This rank's output columns of ``x @ w_full.T (+ b_full)``, or (``gather_output``) all of
    them on every rank: the bits of ``isoexec_kernels.gemm.linear(x, w_full, b_full)`` either way.

    x: ``[..., K]`` the whole input, the same on every rank; weight: ``[n1 - n0, K]`` the rows
    ``(n0, n1) = column_shard_range(out_features, tp, rank, unit)``; bias: those ``[n1 - n0]``
    entries or None; leaves: the K leaves (default: those of the whole weight shape
    ``(out_features, K)``, never of the shard's)."""
    tp, rank = group_size_rank(group)
    n0, n1 = column_shard_range(out_features, tp, rank, unit)
    if weight.dim() != 2 or weight.shape[0] != n1 - n0:
        raise ValueError(f"column-parallel linear: rank {rank} of tp={tp} holds output rows [{n0}, {n1}) "
                         f"of {out_features} ({n1 - n0} rows), but the weight has shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (n1 - n0,):
        raise ValueError(f"column-parallel linear: rank {rank} of tp={tp} needs bias entries [{n0}, {n1}) "
                         f"as [{n1 - n0}], got shape {tuple(bias.shape)}")
    K = weight.shape[1]
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"column-parallel linear: x has shape {tuple(x.shape)} but the weight's K is {K}")
    leaves = k_leaves_for(out_features, K) if leaves is None else leaves
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if tp > 1 and torch.is_grad_enabled() and x.requires_grad:
        x2 = _ReplicatedInputFn.apply(x2, group, tp)
    y = linear(x2, weight, bias, leaves=leaves)
    if not gather_output:
        return y.reshape(*lead, n1 - n0)
    bounds = [column_shard_range(out_features, tp, r, unit) for r in range(tp)]
    return _GatherColumnsFn.apply(y, group, tp, rank, bounds).reshape(*lead, out_features)
