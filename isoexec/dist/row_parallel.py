"""Row-parallel linear (o_proj, down_proj under tensor parallelism) with the bits of one process.

A row-parallel linear gives each rank a slice of the input columns (K) and the matching columns of
the weight; the output is the sum over ranks of their partial products. Summing those partials
with ``all_reduce`` makes the result depend on tp twice over: each rank's partial is a different
slice of the K loop (one K loop of the whole shard), and the collective adds the partials in an
order of its own. Here neither happens, because the cut follows the invariant GEMM's own schedule
(``isoexec_kernels/gemm/api.py``): K in 64-wide blocks, the blocks in L contiguous K leaves, each
leaf accumulated from +0 in K order, the leaves added left to right in fp32 (the first as it is),
then the bias in fp32, then one rounding. L is fixed by the caller (a contract constant, the same
at every tp) and tp must divide it:

  1. rank r holds leaves ``r*L/tp .. (r+1)*L/tp - 1`` whole (``partition.row_shard_leaves``);
  2. it computes each of its leaves' fp32 partial alone, all in one call
     (``isoexec_kernels.gemm.leaf_partials``: one launch on CUDA, the reference twin's leaves on
     CPU): each leaf is the invariant linear on the leaf's K columns with one leaf and an fp32
     output, which is the leaf's accumulator unrounded. Leaf bounds fall on block boundaries, so
     the slice holds the same blocks, zero-padded the same way, as the leaf inside the whole K
     loop: the same bits;
  3. the L/tp partials of every rank are gathered (``all_gather``, a copy) into all L partials in
     leaf order, and every rank adds them left to right, adds the bias and rounds once, exactly
     the single-process epilogue. (``combine="owners"``: each rank receives only its block of the
     output columns of every rank's partials (``all_to_all``, a copy), runs that epilogue on the
     block, and the rounded blocks are gathered; the epilogue is elementwise, so the same bits
     with less traffic and one more collective: ``COMBINES``.)

At tp = 1 the one rank calls ``linear(x, w, b, leaves=L)`` itself: the Triton kernel walks the L
leaves in one launch with the same arithmetic (``row_parallel_linear_by_partials`` keeps the
three steps above callable at any size, to compare).

So every tp dividing L gives ``linear(x, w, b, leaves=L)`` of one process, bit for bit, on every
rank (the output is replicated, as after Megatron's all-reduce). The price is traffic: each rank
receives L partials of [M, N] fp32 instead of one all-reduced [M, N]; a chain (rank r adds its
leaves to rank r-1's running sum and passes it on) would keep the order with one [M, N] per hop,
at tp serial hops. Not built.

Device: on CPU the leaf partials are the reference twin's. On CUDA they are one launch of the
Triton split-K kernel over the rank's leaves, a program per (output tile, leaf) running the leaf's
K loop: the arithmetic of a one-leaf linear of the leaf, and the one the split-K path and the leaf
walk use for each leaf. On the H200 the walk equalled partials made by one-leaf linears, one launch
a leaf, at M 1 to 8192 (a GPU test, which now compares the walk with the one launch; neither it
nor the GPU gate comparing the one launch with those one-leaf linears has run on a GPU since),
and the world-size-1 NCCL topology gates pass; ``isoexec bench tp_linear`` times the walk against
the plain invariant GEMM.

Autograd: the backward is correct and deterministic, not tp-invariant (only forward bits must match
between trainer and engine). The output is replicated, so each rank's gradient of it is the same
and the gradient of each leaf partial is that gradient (in fp32): no communication. The input
gradient stays sharded like the input; the weight gradient is each rank's own columns; the bias
gradient is a fixed-leaf sum over tokens, as in the single-process linear. On CPU the reference's
output columns are independent of one another, so these gradients also equal the single-process
ones (tests/dist/ checks it); that is a fact of the CPU twin, not a promise.

``all_reduce_row_parallel_linear`` is the stock way, partials summed by ``all_reduce``: what the
native tensor-parallel composition runs (``configs/compositions/native_tp4.yaml``, bits that depend
on tp), and the negative control of the tests and gates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from isoexec_kernels import _ref
from isoexec_kernels.gemm import leaf_partials, leaf_sum, linear
from isoexec_kernels.gemm.reference import _GRAD_BIAS_LEAF

from .collectives import all_to_all_rows, gather_columns_in_rank_order, gather_in_rank_order, group_size_rank
from .partition import row_shard_leaves


#: how the ranks' leaf partials become the output (``row_parallel_linear``'s ``combine``), both the
#: same bits: ``gather``, every rank receives all L partials and sums every column (one
#: ``all_gather`` of L/tp fp32 [M, N] a rank); ``owners``, rank q receives every rank's partials of
#: its own block of the N columns only (``all_to_all``), sums that block and the rounded blocks are
#: gathered (``all_gather`` of [M, N/tp] in the output dtype): two collectives instead of one, but
#: at tp = 2 and L = 4 a rank receives 4 + 1 bytes per output element instead of 8 (fp32 partials,
#: then bf16 outputs), against a bf16 ring all-reduce's 2. Which is faster at which M is for the
#: 2-GPU run to measure (``isoexec bench tp_dist`` times both); ``gather`` stays the default.
COMBINES = ("gather", "owners")


def _column_blocks(N: int, tp: int) -> list[tuple[int, int]]:
    """Rank q's block of the N output columns, ``[q N / tp, (q + 1) N / tp)``."""
    return [(q * N // tp, (q + 1) * N // tp) for q in range(tp)]


class _LeafSumFn(torch.autograd.Function):
    """This rank's leaf partials [L/tp, M, N] -> the rounded output [M, N], the same on every rank
    (``combine``: ``COMBINES``)."""

    @staticmethod
    def forward(ctx, partials, bias, group, tp, out_dtype, combine="gather"):
        per, M, N = partials.shape
        ctx.per = per
        ctx.bias_dtype = None if bias is None else bias.dtype
        if combine == "owners" and tp > 1:
            return _sum_by_column_owners(partials, bias, group, tp, out_dtype)
        every = gather_in_rank_order(partials, group, tp).reshape(tp * per, M, N)  # leaf order
        # left to right from the first leaf as it is, the bias, one rounding (one launch on CUDA)
        return leaf_sum(every, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        # the rounding passes the gradient through; every leaf enters the sum with weight 1
        g = grad.float()
        g_partials = g.unsqueeze(0).expand(ctx.per, *g.shape)
        g_bias = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[1]:
            g_bias = _ref.batch_sum0(g, _GRAD_BIAS_LEAF).to(ctx.bias_dtype)
        return g_partials, g_bias, None, None, None, None


def _sum_by_column_owners(partials, bias, group, tp: int, out_dtype):
    """``combine="owners"``: every rank's partials of rank q's column block go to rank q
    (``all_to_all``, raw bytes), which adds its block's L partials in leaf order, adds the bias and
    rounds once (``leaf_sum``: elementwise, so a block's elements get the bits the whole [M, N]
    would), then the rounded blocks are gathered in rank order (a copy)."""
    per, M, N = partials.shape
    _, rank = group_size_rank(group)
    blocks = _column_blocks(N, tp)
    a, b = blocks[rank]
    send = torch.cat([partials[:, :, c0:c1].reshape(-1) for c0, c1 in blocks])   # rank order
    recv = all_to_all_rows(send, [per * M * (c1 - c0) for c0, c1 in blocks], [per * M * (b - a)] * tp, group, tp)
    mine = leaf_sum(recv.reshape(tp * per, M, b - a), None if bias is None else bias[a:b], out_dtype)  # leaf order
    return gather_columns_in_rank_order(mine, [c1 - c0 for c0, c1 in blocks], group, tp)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        in_features: int, leaves: int, group=None, combine: str = "gather") -> torch.Tensor:
    """``x_full @ w_full.T (+ bias)`` from this rank's K shard, the bits of
    ``isoexec_kernels.gemm.linear(x_full, w_full, bias, leaves=leaves)`` on every rank whatever the
    group size (module docstring).

    x: ``[..., k1 - k0]`` this rank's input columns, ``(k0, k1) = row_shard_range(in_features,
    leaves, tp, rank)`` (the output of a column-parallel layer cut in 64-column units fits);
    weight: ``[N, k1 - k0]`` the same columns of the weight; bias: ``[N]``, the same on every rank,
    or None; in_features: the whole K; leaves: L, the K leaves of the schedule, divisible by tp;
    group: the tensor-parallel process group (None: the default group, or one process if none is
    initialised); combine: how the ranks' partials are brought together at tp > 1 (``COMBINES``:
    the same bits either way). Returns ``[..., N]`` in x's dtype, replicated. Differentiable
    (deterministic, not tp-invariant backward)."""
    if combine not in COMBINES:
        raise ValueError(f"row-parallel linear: unknown combine {combine!r}; expected one of {', '.join(COMBINES)}")
    tp, rank = _rank_leaves(x, weight, bias, in_features, leaves, group)
    if tp == 1:
        # one rank holds every leaf: the invariant linear's own walk of the L leaves is this
        # schedule in one launch (each leaf from +0, the sums left to right, the bias, one
        # rounding), without L fp32 partials written, stacked and read back
        return linear(x, weight, bias, leaves=leaves)
    return _by_leaf_partials(x, weight, bias, in_features, leaves, group, tp, rank, combine)


def row_parallel_linear_by_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                                    in_features: int, leaves: int, group=None) -> torch.Tensor:
    """:func:`row_parallel_linear` the way a group of more than one rank computes it, at any size:
    each leaf's fp32 partial alone, the partials gathered in leaf order and added left to right.
    At tp = 1 it gives the bits of the one-launch walk that ``row_parallel_linear`` runs there
    (the tests and ``isoexec bench tp_linear`` compare the two)."""
    tp, rank = _rank_leaves(x, weight, bias, in_features, leaves, group)
    return _by_leaf_partials(x, weight, bias, in_features, leaves, group, tp, rank)


def _rank_leaves(x, weight, bias, in_features, leaves, group):
    """(tp, rank) after checking that x, weight and bias are this rank's shard."""
    tp, rank = group_size_rank(group)
    mine = row_shard_leaves(in_features, leaves, tp, rank)
    k0, k1 = mine[0][0], mine[-1][1]
    if x.dim() < 1 or x.shape[-1] != k1 - k0:
        raise ValueError(f"row-parallel linear: rank {rank} of tp={tp} holds input columns [{k0}, {k1}) "
                         f"of {in_features} ({k1 - k0} wide), but x has shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != k1 - k0:
        raise ValueError(f"row-parallel linear: rank {rank} of tp={tp} needs the weight's columns "
                         f"[{k0}, {k1}) as [N, {k1 - k0}], got shape {tuple(weight.shape)}")
    N = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"row-parallel linear: bias must be [N]=[{N}], got shape {tuple(bias.shape)}")
    return tp, rank


def _by_leaf_partials(x, weight, bias, in_features, leaves, group, tp, rank, combine="gather"):
    N = weight.shape[0]
    per = leaves // tp
    # this rank's leaves, each alone with an fp32 output (the leaf's accumulator as the whole K
    # loop holds it), in one launch on CUDA
    partials = leaf_partials(x.reshape(-1, x.shape[-1]), weight, in_features=in_features, leaves=leaves,
                             first_leaf=rank * per, count=per)
    out = _LeafSumFn.apply(partials, bias, group, tp, x.dtype, combine)
    return out.reshape(*x.shape[:-1], N)


class _AllReduceSumFn(torch.autograd.Function):
    """This rank's partial [M, N] -> the ranks' partials summed by ``all_reduce(SUM)`` (the backend's
    order), the same on every rank. Backward as ``_LeafSumFn``'s: the output is replicated and every
    partial enters the sum with weight 1, so each rank's partial gets the output's gradient as it is
    (Megatron's reduce-from-the-tensor-parallel-region); no communication."""

    @staticmethod
    def forward(ctx, part, group):
        total = part.clone()   # all_reduce works in place; the partial stays what autograd saw
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce_row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                                   in_features: int | None = None, leaves: int | None = None, group=None,
                                   linear=linear) -> torch.Tensor:
    """The stock row-parallel linear, Megatron's and vLLM's ``RowParallelLinear`` (same call as
    :func:`row_parallel_linear`): ``linear`` on this rank's K shard, in x's dtype, the ranks'
    partials summed by ``all_reduce(SUM)`` in that dtype, then the bias. Its bits depend on tp
    twice: each rank's partial is one K loop over its own shard, and the collective adds the
    partials in an order of its own. The tensor-parallel models run it for a row-parallel region
    whose contract entry pins no ``K_LEAVES`` (the native composition's ``torch_linear``, passed as
    ``linear``: the region's bound kernel), which only a tp claim of kind ``variant`` allows at
    tp > 1 (isoexec/model/tp_dense.py); with the default ``linear``, the invariant GEMM's plain K
    loop of the shard, it is the negative control of the kernel tests. ``in_features`` and
    ``leaves`` are not used (any K cut works: the caller's shards match). Differentiable: the
    backward needs no communication (``_AllReduceSumFn``). A group of one sends nothing."""
    tp, _ = group_size_rank(group)
    part = linear(x.reshape(-1, x.shape[-1]), weight)
    if tp > 1:
        part = _AllReduceSumFn.apply(part, group)
    out = part if bias is None else part + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
