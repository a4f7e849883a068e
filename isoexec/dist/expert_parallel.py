"""Expert parallelism for one MoE layer with the bits of one process (issue #15, part 3).

The routed experts of a layer are dealt out over an ``ep`` process group in whole contiguous
ranges (``partition.expert_shard_range``: rank j owns experts ``j * E // ep`` to
``(j + 1) * E // ep - 1``); the router, the shared expert and the combine stay with the tokens.
Every rank holds its own tokens and runs, on them, the same regions a single process runs
(``isoexec_kernels/moe/regions.py``; rounding schedule: ``isoexec_kernels/moe/api.py``):

  1. router and dispatch on the rank's tokens, exactly as one process: a token's expert choice
     and weights are a function of its own row (the router handles every row on its own), and
     the dispatch lists the (token, slot) pairs expert-major, token-ascending. With contiguous
     expert ranges the pairs bound for rank q are one contiguous run of that list, in rank order;
  2. the per-expert row counts are gathered (``all_gather``, a copy of integers), so every rank
     knows what it will receive from whom; then each pair's hidden row goes to its expert's owner
     (``all_to_all`` of raw bytes, a copy);
  3. the owner runs the ``experts`` region on the rows it received, expert-major (for each of its
     experts: source rank 0's rows, then rank 1's, ...), with the slice of the stacked expert
     weights it holds. The region's rows are independent of one another: on CPU it is a loop over
     experts of the invariant ``linear`` (each output element a fixed function of its own input
     row and the weight: fp32 products, 64-wide K blocks by a fixed tree, blocks in K order; its
     row chunking only decides which rows share a torch call) and the elementwise
     ``silu_and_mul``. So a row's bits do not depend on which rows share the call, how many an
     expert received, or where the row lands (tests/dist/test_expert_parallel.py checks the
     outcome). When each rank's tokens are a contiguous slice of a batch, as in the tests, the
     order is also the single process's: an expert's rows token-ascending over the whole batch;
  4. the output rows travel back by the reverse ``all_to_all`` (a copy). Concatenated in rank
     order they are the rank's rows in its own dispatch order, the very tensor the single-process
     ``experts`` region returns for these tokens;
  5. the ``combine`` region runs on the owner unchanged: each token's k weighted rows summed in
     fp32 from +0 in ascending expert index, then the shared expert (computed by the caller on the
     same tokens, replicated weights), one rounding.

Nothing is added across ranks: the only collectives are copies, and every sum is one a single
process also performs, in the same order, on the same operands. So EP = 1, 2, 4 give the bits of
the single-process layer for every token. The stock alternatives do add across ranks: an expert
rank that sums the weighted rows of its own experts for a token and sends one partial (or
partials summed by ``all_reduce``, as an all-gather dispatcher with a reduce-scatter combine does)
adds a token's k terms in a grouping set by the expert ranges, ``(a + b) + (c + d)`` instead of
``((a + b) + c) + d``, so its bits follow ep (the test's negative control). With k = 2 and no
term before the shared expert that grouping cannot show (a two-term sum has no order).

The backward (``_ExpertExchange``: steps 2-4 are one autograd node) runs the exchange in reverse:
the output rows' gradients to the owners, the experts region's own backward there (an expert's
weight gradient is the sum over every rank's rows it received, kept on its owner), the input
rows' gradients back to their ranks; router, shared expert and combine differentiate locally. Only
forward bits must match (docs/variance_sources.md): the backward is correct and fixed run to run,
and equals one process's within rounding (tests/dist/test_ep_model.py measures it).

Refusals, on every rank before any collective (the ranks see the same sizes): an ep the expert
count cannot be dealt to (``ep > E``) and expert weights that are not this rank's range. The
model classes call this layer through ``isoexec.model.ep_moe.ExpertParallelMoe``, which also
checks the contract's ep claim. CPU (gloo) tested; on CUDA the regions are the Triton ones and the
collectives would be NCCL's, untested.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from isoexec_kernels.moe import Dispatch, RouterSpec

from .collectives import all_to_all_rows, gather_in_rank_order, group_size_rank
from .partition import expert_shard_range


@dataclass(frozen=True)
class ExpertParallelGroup:
    """The expert-parallel group a model's MoE layers run over (``moe_ep`` of the MoE model
    classes, set by ``isoexec.model.ep_moe.ExpertParallelMoe``): ``group`` is the torch process
    group, or None for the default group (one process when none is initialised). A model whose
    ``moe_ep`` is None holds every expert and runs the single-process layer."""

    group: Any = None


def _refuse(x, router_weight, gate_up, down, num_experts: int, ep: int, rank: int, e0: int, e1: int):
    what = f"expert parallelism: rank {rank} of ep={ep}"
    if router_weight.dim() != 2 or router_weight.shape[0] != num_experts:
        raise ValueError(f"{what}: the router weight must be the whole [E={num_experts}, H] (replicated), "
                         f"got shape {tuple(router_weight.shape)}")
    if x.dim() != 2 or x.shape[1] != router_weight.shape[1]:
        raise ValueError(f"{what}: x must be [T, H={router_weight.shape[1]}], got shape {tuple(x.shape)}")
    if gate_up.dim() != 3 or gate_up.shape[0] != e1 - e0 or down.dim() != 3 or down.shape[0] != e1 - e0:
        raise ValueError(f"{what} owns experts [{e0}, {e1}) of {num_experts}; gate_up and down must hold "
                         f"those {e1 - e0}, got shapes {tuple(gate_up.shape)} and {tuple(down.shape)}")


def _owner_order(recv_counts: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``recv_counts [ep, E_r]``: rows received from each source rank, per local expert, each
    source's block expert-major. Returns (the received row index of each row in expert-major,
    source-ascending order; the local experts' offsets into that order)."""
    ep, n_local = recv_counts.shape
    counts = recv_counts.tolist()
    starts, pos = [], 0          # where source s's block of expert e starts in the received rows
    for s in range(ep):
        row = []
        for e in range(n_local):
            row.append(pos)
            pos += counts[s][e]
        starts.append(row)
    order, offsets = [], [0]
    for e in range(n_local):
        for s in range(ep):
            order.extend(range(starts[s][e], starts[s][e] + counts[s][e]))
        offsets.append(len(order))
    return torch.tensor(order, dtype=torch.long), offsets


class _ExpertExchange(torch.autograd.Function):
    """Steps 2-4 as one autograd node: ``rows`` (this rank's dispatch-order rows, one run per
    owner) to their experts' owners, the ``experts`` region on what this rank received (with the
    ``local`` dispatch: expert-major, source-ascending), the output rows back to their ranks.

    Its backward is the same exchange reversed: the output rows' gradients go to the owners
    (``all_to_all``), the owner runs the experts region's own backward on the graph it kept (so the
    gradients of its expert weights are the sum over every rank's rows it received, and stay
    there), and the input rows' gradients go back to their ranks (``all_to_all``). Copies again,
    so the gradients are those of the same arithmetic as one process's expert loop, and fixed run
    to run. Every rank of the group takes part in both exchanges of every layer's backward, rows
    or not (one node per layer, whose output feeds the combine on every rank); the ranks must
    agree on whether the forward is recorded (the same parameters requiring grad)."""

    @staticmethod
    def forward(ctx, rows, gate_up, down, experts, local, send, recv, group, ep):
        inbox = all_to_all_rows(rows, send, recv, group, ep)
        record = any(ctx.needs_input_grad[:3])
        with torch.enable_grad() if record else contextlib.nullcontext():
            # the graph of the experts region alone, on detached inputs; backward() walks it
            leaves = [t.detach().requires_grad_(record and t.is_floating_point()) for t in (inbox, gate_up, down)]
            out_rows = experts(leaves[0], local, leaves[1], leaves[2])
            outbox = out_rows[local.row_of_pair]   # back to arrival order: a copy
        if record:
            ctx.graph = (outbox, leaves)
        ctx.exchange = (send, recv, group, ep)
        return all_to_all_rows(outbox.detach(), recv, send, group, ep)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, ep = ctx.exchange
        outbox, leaves = ctx.graph
        del ctx.graph
        g_out = all_to_all_rows(grad.contiguous(), send, recv, group, ep)   # to the owners
        if outbox.requires_grad:   # else this rank received no row: no expert ran here
            g_inbox, g_gate_up, g_down = torch.autograd.grad(outbox, leaves, g_out, allow_unused=True)
        else:
            g_inbox = g_gate_up = g_down = None
        # zeros, not None, where this rank ran no expert: one process's stacked expert weights get a
        # whole gradient (zeros for its idle experts) whenever any token ran, and an optimizer treats
        # an unset gradient otherwise (no decay, no moment update)
        g_inbox, g_gate_up, g_down = (torch.zeros_like(t) if g is None else g
                                      for g, t in zip((g_inbox, g_gate_up, g_down), leaves))
        g_rows = all_to_all_rows(g_inbox.contiguous(), recv, send, group, ep)   # back to the rows' ranks
        return g_rows, g_gate_up, g_down, None, None, None, None, None, None


def expert_parallel_moe(x: torch.Tensor, regions: Mapping, spec: RouterSpec, *, num_experts: int,
                        router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        correction_bias: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
                        shared: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """One MoE layer's output ``[T, H]`` (x's dtype) for this rank's tokens ``x [T, H]``, its
    routed experts spread over ``group`` (module docstring); the bits of the single-process layer
    ``regions["combine"](regions["experts"](x, disp, all gate_up, all down), disp, routing,
    shared)`` for these tokens, at every ep.

    regions: a mapping with the ``router``, ``dispatch``, ``experts`` and ``combine`` regions
    (a model's contract plan, or ``isoexec_kernels.moe.regions``' functions), called with the
    signatures of ``regions.py``; spec: the layer's router; num_experts: E; router_weight
    ``[E, H]``, correction_bias ``[E]`` and shared_gate ``[1, H]``: replicated, as the model holds
    them; gate_up ``[E_r, 2I, H]`` and down ``[E_r, H, I]``: this rank's experts
    ``expert_shard_range(E, ep, rank)`` only; shared: the shared expert's rows ``[T, H]`` on these
    tokens (replicated weights, computed by the caller as the single-process layer does) or None;
    group: the expert-parallel process group (None: the default group, or one process if none is
    initialised). A rank may hold no tokens (T = 0); every rank of the group must call it
    together. Differentiable (``_ExpertExchange``); the ranks must agree on whether autograd
    records it."""
    ep, rank = group_size_rank(group)
    e0, e1 = expert_shard_range(num_experts, ep, rank)
    _refuse(x, router_weight, gate_up, down, num_experts, ep, rank, e0, e1)

    # 1. the single process's router and dispatch, on this rank's tokens
    routing = regions["router"](x, router_weight, spec, correction_bias, shared_gate)
    disp = regions["dispatch"](routing.ids, num_experts)

    # 2. every rank's per-expert counts (a copy of integers), then the rows to the experts' owners
    counts = gather_in_rank_order(disp.counts.to(torch.long), group, ep)          # [ep, E]
    bounds = [expert_shard_range(num_experts, ep, q) for q in range(ep)]
    per_owner = torch.stack([counts[:, a:b].sum(dim=1) for a, b in bounds], dim=1)  # [src, dst]
    send = per_owner[rank].tolist()   # this rank's dispatch-order rows, one run per owner
    recv = per_owner[:, rank].tolist()

    # 3. this rank's experts on the rows it received, expert-major; 4. the rows back to their
    # tokens' rank (rank order = this rank's dispatch order). One autograd node for 2-4.
    order, offsets = _owner_order(counts[:, e0:e1])
    n = order.numel()
    local = Dispatch(token=order.to(x.device), offsets=torch.tensor(offsets, dtype=torch.long, device=x.device),
                     row_of_pair=torch.empty_like(order).scatter_(0, order, torch.arange(n)).to(x.device),
                     num_tokens=n, top_k=1)
    rows = _ExpertExchange.apply(x[disp.token], gate_up, down, regions["experts"], local, send, recv, group, ep)

    # 5. the single process's combine, unchanged
    return regions["combine"](rows, disp, routing, shared, out_dtype=x.dtype)
