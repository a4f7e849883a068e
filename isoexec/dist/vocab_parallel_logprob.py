"""Vocabulary-parallel token logprob with the bits of the single-process logprob kernel (its reference
schedule on CPU, its Triton schedule on a GPU).

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
(and ``token_logprobs`` on CPU, which runs that reference). TP = 1 needs no process group; there
the one rank runs ``token_logprobs`` itself, the kernel whose schedule the pieces take apart.

On a GPU the vocabulary-parallel logprob follows the Triton kernel instead, since that is what
``token_logprobs`` runs there (one program per row walking chunks of ``BLOCK_V`` = 4096 logits
with a running max and a running sum, the sum rescaled at each chunk by the new max). A rank cannot
add its chunks alone, but the walk comes apart at chunk boundaries
(``isoexec_kernels.logprob.triton_shards``): the vocabulary is sharded by whole chunks (the shard
rule in ``partition.vocab_shard_range``), each rank takes its chunks' maxes, the maxes (with the
target's logit from its owner) are gathered and every rank runs the running-max recurrence; each
rank sums its chunks under those running maxes, the sums are gathered, and every rank runs the
rescaling chain, the log and the token's value with the kernel's own operations: the bits of
``token_logprobs_triton`` on the whole row, on every rank, at every tp (checked under the Triton
interpreter on CPU at TP = 1, 2, 4, and by a GPU test on a device). Two ``all_gather``s of one
fp32 per chunk and row, against the stock path's three all-reduces of one value per row.

Autograd: d logits = (onehot(target) - softmax) * dy is elementwise once a row's (m, lse_rel) are
known, and every rank holds them after the forward, so the backward needs no communication and each
rank's slice of the gradient is bit for bit that slice of the single-process gradient (the
reference's on CPU, the Triton kernel's elementwise pass on a GPU; ``dy`` must be the same on every
rank, as it is when the loss is computed on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from isoexec_kernels import _ref
from isoexec_kernels.logprob import BLOCK_V, REF_LEAF_V, token_logprobs, triton_shards
from isoexec_kernels.logprob.shards import leaf_sums, lse_from_leaf_sums, row_max, token_grad

from .collectives import gather_columns_in_rank_order, gather_in_rank_order, group_size_rank
from .partition import vocab_shard_range

#: the schedules of ``isoexec_kernels.logprob.token_logprobs``: its reference (CPU) and its Triton
#: kernel (CUDA; on CPU under the Triton interpreter)
SCHEDULES = ("reference", "triton")


def _leaf_count(a: int, b: int) -> int:
    return -(-(b - a) // REF_LEAF_V)


def _owner_pick(values: torch.Tensor, tg: torch.Tensor, bounds) -> torch.Tensor:
    """``values[tp, R]`` (each rank's value for every row) -> ``[R]``, each row's from the rank whose
    vocabulary slice holds the row's target: picked, not summed (a -0 plus zeros would become +0)."""
    starts = torch.tensor([a for a, _ in bounds[1:]], dtype=torch.long, device=tg.device)
    owner = (tg[:, None] >= starts[None, :]).sum(dim=1)
    return values[owner, torch.arange(tg.shape[0], device=tg.device)]


class _VocabLogprobFn(torch.autograd.Function):
    """The reference schedule (module docstring)."""

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
        all_sums = gather_columns_in_rank_order(mine.t(), counts, group, tp).t()  # every leaf, vocabulary order
        lse_rel = lse_from_leaf_sums(all_sums)

        own = (tg >= v0) & (tg < v1)
        local_t = torch.where(own, tg - v0, torch.full_like(tg, -1))
        zt_mine = torch.zeros(R, dtype=torch.float32, device=z2.device)
        rows_own = own.nonzero()[:, 0]
        zt_mine[rows_own] = z2[rows_own, local_t[rows_own]].float() - m[rows_own]
        zt = _owner_pick(gather_in_rank_order(zt_mine, group, tp), tg, bounds)

        ctx.save_for_backward(logits, m, lse_rel, local_t)
        return (zt - lse_rel).reshape(targets.shape)

    @staticmethod
    def backward(ctx, dy):
        logits, m, lse_rel, local_t = ctx.saved_tensors
        z2 = logits.reshape(-1, logits.shape[-1]).float()
        g = token_grad(z2, m, lse_rel, local_t, dy.reshape(-1), logits.dtype)
        return g.reshape(logits.shape), None, None, None, None, None


class _VocabLogprobTritonFn(torch.autograd.Function):
    """The Triton kernel's schedule (module docstring): chunk maxes and the target's logit gathered,
    the running maxes on every rank, chunk sums gathered, the chain on every rank."""

    @staticmethod
    def forward(ctx, logits, targets, group, tp, rank, bounds, vocab_size):
        v0, v1 = bounds[rank]
        z2 = logits.reshape(-1, v1 - v0).contiguous()
        tg = targets.reshape(-1).long()
        R = z2.shape[0]
        counts = [triton_shards.num_chunks(b - a) for a, b in bounds]
        own = (tg >= v0) & (tg < v1)
        local_t = tg - v0   # outside [0, v1 - v0) where another rank holds the target
        # the target's logit as stored, in fp32 (the one-row kernel's load), from this rank or 0
        zt_mine = torch.where(own, z2.gather(1, local_t.clamp(0, v1 - v0 - 1)[:, None])[:, 0].float(),
                              torch.zeros(R, dtype=torch.float32, device=z2.device))
        # one gather: this rank's target logits (first column), then its chunk maxes
        every = gather_columns_in_rank_order(torch.cat([zt_mine[:, None], triton_shards.chunk_maxes_triton(z2)], dim=1),
                                             [1 + c for c in counts], group, tp)
        starts = [sum(1 + c for c in counts[:r]) for r in range(tp)]
        zt = _owner_pick(every[:, starts].t(), tg, bounds)
        chunk_max = torch.cat([every[:, s + 1:s + 1 + c] for s, c in zip(starts, counts)], dim=1)   # vocabulary order
        prefix = triton_shards.prefix_maxes_triton(chunk_max)
        first = v0 // BLOCK_V
        sums = triton_shards.chunk_sums_triton(z2, prefix, first, vocab_size)
        lp, stats = triton_shards.chain_triton(prefix, gather_columns_in_rank_order(sums, counts, group, tp), zt)
        ctx.save_for_backward(z2, local_t, stats)
        ctx.shape = logits.shape
        return lp.reshape(targets.shape)

    @staticmethod
    def backward(ctx, dy):
        z2, local_t, stats = ctx.saved_tensors
        g = triton_shards.slice_grad_triton(z2, local_t, stats, dy.reshape(-1))
        return g.reshape(ctx.shape), None, None, None, None, None, None


def vocab_parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                                  group=None, schedule: str | None = None) -> torch.Tensor:
    """fp32 logprob of ``targets`` from this rank's vocabulary slice, the bits of
    ``isoexec_kernels.logprob.token_logprobs`` of the whole rows in one process, on every rank,
    whatever the group size (module docstring).

    logits: ``[..., v1 - v0]`` this rank's columns, ``(v0, v1) = vocab_shard_range(vocab_size, tp,
    rank)``, any float dtype; targets: integer ``[...]`` token ids in ``[0, vocab_size)``, the same
    on every rank; group: the tensor-parallel process group (None: the default group, or one process
    if none is initialised); schedule: ``"reference"`` (``token_logprobs_reference``'s bits) or
    ``"triton"`` (``token_logprobs_triton``'s), by default the one ``token_logprobs`` runs on the
    logits' device: Triton on CUDA, the reference elsewhere. Differentiable in logits (no
    communication in the backward)."""
    tp, rank = group_size_rank(group)
    bounds = [vocab_shard_range(vocab_size, tp, r) for r in range(tp)]
    v0, v1 = bounds[rank]
    schedule = schedule or ("triton" if logits.is_cuda else "reference")
    if schedule not in SCHEDULES:
        raise ValueError(f"vocab-parallel logprob: unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if schedule == "reference" and logits.is_cuda:
        raise ValueError("vocab-parallel logprob: the reference schedule is the CPU's (float64 exp); CUDA "
                         "logits take the Triton schedule, which token_logprobs runs there")
    if schedule == "triton" and any(a % BLOCK_V for a, _ in bounds):
        chunks = triton_shards.num_chunks(vocab_size)
        raise ValueError(f"vocab-parallel logprob: vocab_size={vocab_size} is {chunks} chunk(s) of {BLOCK_V} "
                         f"logits, fewer than tp={tp}; the Triton schedule needs a whole chunk on every rank")
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
    if tp == 1 and schedule == ("triton" if logits.is_cuda else "reference"):
        # one rank holds every chunk: the kernel token_logprobs runs on this device is this
        # schedule in one launch (the pieces and their chain are that kernel taken apart), as
        # row_parallel_linear takes the one-launch walk at tp = 1
        return token_logprobs(logits, targets)
    if schedule == "triton":
        return _VocabLogprobTritonFn.apply(logits, targets, group, tp, rank, bounds, vocab_size)
    return _VocabLogprobFn.apply(logits, targets, group, tp, rank, bounds)


class _AllReduceVocabLogprobFn(torch.autograd.Function):
    """The stock vocabulary-parallel logprob (``all_reduce_vocab_parallel_token_logprobs``); the
    backward is local, as the Triton schedule's: (onehot - exp((z - m) - log s)) * dy on the slice."""

    @staticmethod
    def forward(ctx, logits, targets, group, tp, v0, v1):
        z = logits.reshape(-1, v1 - v0).float()
        tg = targets.reshape(-1).long()
        m = z.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        s = torch.exp(z - m[:, None]).sum(dim=-1)
        own = (tg >= v0) & (tg < v1)
        local_t = tg - v0
        zt = torch.where(own, z.gather(1, local_t.clamp(0, v1 - v0 - 1)[:, None])[:, 0], torch.zeros_like(m))
        if tp > 1:
            dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(zt, op=dist.ReduceOp.SUM, group=group)
        log_s = torch.log(s)
        ctx.save_for_backward(logits, m, log_s, local_t)
        ctx.shape = logits.shape
        return ((zt - m) - log_s).reshape(targets.shape)

    @staticmethod
    def backward(ctx, dy):
        logits, m, log_s, local_t = ctx.saved_tensors
        z = logits.reshape(-1, logits.shape[-1]).float()
        p = torch.exp((z - m[:, None]) - log_s[:, None])
        cols = torch.arange(z.shape[1], device=z.device)
        g = ((cols[None, :] == local_t[:, None]).float() - p) * dy.reshape(-1, 1).float()
        return g.to(logits.dtype).reshape(ctx.shape), None, None, None, None, None


def all_reduce_vocab_parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                                             group=None) -> torch.Tensor:
    """The stock vocabulary-parallel logprob (the vocabulary-parallel cross-entropy of Megatron and
    vLLM; same call as :func:`vocab_parallel_token_logprobs`): the row max all-reduced (MAX), then
    each rank's sum of ``exp(z - m)`` over its own slice and the target's logit (0 where another
    rank holds it) all-reduced (SUM), ``logprob = (z_t - m) - log(s)``, in fp32 torch ops. Its
    bits depend on tp twice (each rank sums its slice in one go; the collective adds the ranks'
    sums in an order of its own) and are no kernel's: the negative control of the tests and the
    baseline of ``isoexec bench tp_dist``, and the trainer cases' logprob of the native composition
    under tensor parallelism (``native_tp4``; ``torch_log_softmax``'s vocabulary-parallel form, as
    Megatron's vocabulary-parallel cross-entropy is the stock log-softmax's). Differentiable in
    logits, with no communication in the backward."""
    tp, rank = group_size_rank(group)
    v0, v1 = vocab_shard_range(vocab_size, tp, rank)
    return _AllReduceVocabLogprobFn.apply(logits, targets, group, tp, v0, v1)
