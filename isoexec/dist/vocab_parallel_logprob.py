"""Vocabulary-parallel token logprob with the bits of the single-process reference kernel.

Under tensor parallelism the lm_head is column-parallel over the vocabulary, so each rank holds a
slice of every row's logits, and a token's logprob needs the whole row's max and sum-exp. A stock
vocabulary-parallel cross-entropy all-reduces a max, then all-reduces a sum of exp over each
rank's slice: a sum whose order depends on tp twice (each rank sums its own slice in one go, the
collective adds the ranks' sums in its order). Here the sum keeps the reference schedule of
``isoexec_kernels/logprob`` (its api.py docstring), which is reproducible piece by piece:

  * m = max(z) is exact, so the row max is the max of the ranks' maxes (gathered and combined on
    every rank; ``all_reduce(MAX)`` would also be exact for numbers, but how a backend orders a NaN
    or a -0 against +0 is its own business), then ``m + 0.0`` as in the reference;
  * the sum-exp is, in the reference, a halves tree inside each leaf of ``REF_LEAF_V`` (1024)
    logits and the leaves accumulated left to right from +0. The vocabulary is sharded by whole
    leaves (``partition.vocab_shard_range``), each rank computes its leaves' tree sums under the
    row max (``isoexec_kernels.logprob.shards.leaf_sums``: the reference's own operations), the
    leaf sums are gathered (one fp32 per leaf and row) and every rank runs the left-to-right
    chain over all leaves and the log (``shards.lse_from_leaf_sums``);
  * the target's ``z_t - m`` comes from the rank whose slice holds the target, gathered and picked
    by owner (not summed with zeros from the others: a -0 would become +0).

So TP = 1, 2 and 4 all give ``token_logprobs_reference`` of one process, bit for bit, on every rank
(and ``token_logprobs`` on CPU, which runs that reference). TP = 1 needs no process group.

Not the Triton kernel's bits. On CUDA ``token_logprobs`` runs the Triton schedule (chunks of
BLOCK_V = 4096 with an online max/sum), whose running sum is rescaled at each chunk by the running
max, so a rank cannot add its chunks alone. It can still be reproduced piece by piece: gather the
chunk maxes, take the prefix maxes (exact), let each rank sum its chunks under their prefix max,
gather those chunk sums and run the rescaling chain with the kernel's own exp on every rank. That
needs a Triton kernel of its own and a GPU gate; until then CUDA tensors are refused here rather
than given bits that the engine's kernel does not produce.

Autograd: d logits = (onehot(target) - softmax) * dy is elementwise once a row's (m, lse_rel) are
known, and every rank holds them after the forward, so the backward needs no communication and each
rank's slice of the gradient is bit for bit that slice of the single-process reference gradient
(``dy`` must be the same on every rank, as it is when the loss is computed on every rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from isoexec_kernels import _ref
from isoexec_kernels.logprob import REF_LEAF_V
from isoexec_kernels.logprob.shards import leaf_sums, lse_from_leaf_sums, row_max, token_grad

from .collectives import gather_in_rank_order, group_size_rank
from .partition import vocab_shard_range


def _leaf_count(a: int, b: int) -> int:
    return -(-(b - a) // REF_LEAF_V)


class _VocabLogprobFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, tp, rank, bounds):
        v0, v1 = bounds[rank]
        z2 = logits.reshape(-1, v1 - v0)
        tg = targets.reshape(-1).long()
        R = z2.shape[0]
        # rows are independent: chunks only bound the fp32/fp64 temporaries, never the bits
        rows = _ref.rows_per_chunk(v1 - v0, budget=1 << 19)
        chunks = [(r0, min(R, r0 + rows)) for r0 in range(0, R, rows)]
        local_max = torch.cat([row_max(z2[a:b].float()) for a, b in chunks]) if R else z2.new_empty(0).float()
        m = gather_in_rank_order(local_max, group, tp).max(dim=0).values + 0.0  # exact; -0 -> +0

        counts = [_leaf_count(a, b) for a, b in bounds]
        mine = torch.cat([leaf_sums(z2[a:b].float(), m[a:b]) for a, b in chunks], dim=1) if R else \
            m.new_zeros((counts[rank], 0))
        every = gather_in_rank_order(F.pad(mine, (0, 0, 0, max(counts) - counts[rank])), group, tp)
        all_sums = torch.cat([every[r, :counts[r]] for r in range(tp)])  # every leaf, vocabulary order
        lse_rel = lse_from_leaf_sums(all_sums)

        own = (tg >= v0) & (tg < v1)
        local_t = torch.where(own, tg - v0, torch.full_like(tg, -1))
        zt_mine = torch.zeros(R, dtype=torch.float32, device=z2.device)
        rows_own = own.nonzero()[:, 0]
        zt_mine[rows_own] = z2[rows_own, local_t[rows_own]].float() - m[rows_own]
        starts = torch.tensor([a for a, _ in bounds[1:]], dtype=torch.long, device=tg.device)
        owner = (tg[:, None] >= starts[None, :]).sum(dim=1)
        zt = gather_in_rank_order(zt_mine, group, tp)[owner, torch.arange(R, device=tg.device)]

        ctx.save_for_backward(logits, m, lse_rel, local_t)
        return (zt - lse_rel).reshape(targets.shape)

    @staticmethod
    def backward(ctx, dy):
        logits, m, lse_rel, local_t = ctx.saved_tensors
        z2 = logits.reshape(-1, logits.shape[-1]).float()
        g = token_grad(z2, m, lse_rel, local_t, dy.reshape(-1), logits.dtype)
        return g.reshape(logits.shape), None, None, None, None, None


def vocab_parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                                  group=None) -> torch.Tensor:
    """fp32 logprob of ``targets`` from this rank's vocabulary slice, the bits of
    ``isoexec_kernels.logprob.token_logprobs_reference(full_logits, targets)`` on every rank
    whatever the group size (module docstring).

    logits: ``[..., v1 - v0]`` this rank's columns, ``(v0, v1) = vocab_shard_range(vocab_size, tp,
    rank)``, any float dtype; targets: integer ``[...]`` token ids in ``[0, vocab_size)``, the same
    on every rank; group: the tensor-parallel process group (None: the default group, or one process
    if none is initialised). Differentiable in logits (no communication in the backward)."""
    tp, rank = group_size_rank(group)
    bounds = [vocab_shard_range(vocab_size, tp, r) for r in range(tp)]
    v0, v1 = bounds[rank]
    if logits.is_cuda:
        raise NotImplementedError(
            "vocab-parallel logprob: CUDA logits would run the reference schedule, not the Triton "
            "kernel's that token_logprobs runs there; its vocabulary-parallel form is not built yet")
    if not logits.is_floating_point() or logits.dim() < 1 or logits.shape[-1] != v1 - v0:
        raise ValueError(f"vocab-parallel logprob: rank {rank} of tp={tp} holds vocabulary columns "
                         f"[{v0}, {v1}) of {vocab_size} ({v1 - v0} wide), but logits are "
                         f"{logits.dtype} of shape {tuple(logits.shape)}")
    rows = logits.numel() // (v1 - v0)
    if targets.is_floating_point() or targets.numel() != rows:
        raise ValueError(f"vocab-parallel logprob: {rows} logit rows but targets are {targets.dtype} of "
                         f"shape {tuple(targets.shape)}; need one integer token id per row")
    if rows and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"vocab-parallel logprob: targets span [{int(targets.min())}, {int(targets.max())}], "
                         f"outside the vocabulary [0, {vocab_size})")
    return _VocabLogprobFn.apply(logits, targets, group, tp, rank, bounds)
