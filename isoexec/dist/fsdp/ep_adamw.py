"""AdamW for the expert-parallel trainer: FSDP2 shards for the replicated parameters, fp32 masters
for the expert slices, one clip over both.

A model of the expert-parallel trainer (``ep_trainer.py``) holds two kinds of trainable parameter:

- **replicated** (attention or Gated DeltaNet, router, shared expert, norms, embedding, lm_head):
  fp32 DTensor shards over every rank, managed by FSDP2 and reduce-scattered in rank order at the
  end of each mini-batch's backward, exactly as under ``ShardedAdamW``; the shards are the masters;
- **expert slices** (each MoE layer's ``experts_gate_up`` / ``experts_down`` rows of this rank's
  experts): plain parameters in the compute dtype, outside FSDP2. Their fp32 masters live here, as
  in ``MasterAdamW``: after every micro-batch's backward the slices' gradients are added into the
  masters' fp32 gradients (``accumulate_grads``: in micro-batch order), and after the step each
  master is rounded into its parameter in place (``master.to(dtype)``).

An expert slice's gradient on a rank is already the sum over every rank of its ep group (the
exchange's backward brings every row the slice computed back to it; ``isoexec.model.ep_moe``), so
it is not added over the ep group. The ranks that hold the same slice in the other ep groups (the
``ep_replica`` column of ``isoexec.dist.mesh.ep_mesh``) each hold that sum for their own group's
tokens: ``step`` adds them, gathered (a copy of the fp32 bytes) and summed left to right in
rank order (``collectives.sum_in_rank_order``, no ``all_reduce``), one expert weight at a time (so
the gather holds the column's copies of one slice, not of all). Every rank of a column then holds
the same bits.

The step, with ``MasterAdamW``'s rules: the global gradient norm over every parameter in the
model's order, each counted once (``grad_norm.sharded_grad_norm``: the shards' squares over every
rank, a slice's over the first ep group), the clip coefficient ``min(1, max_norm / (norm +
1e-6))`` applied to every gradient, a non-finite norm skips the update, the LR set on every step,
weight decay on matrices only. Two ``torch.optim.AdamW`` (``foreach`` pinned) step the two kinds:
``opt`` the DTensor shards (so ``torch.distributed.checkpoint``'s ``get_state_dict`` sees the model's
own parameters, as under ``ShardedAdamW``), ``expert_opt`` the masters. AdamW is elementwise, so
splitting the parameters over two optimizers changes no element's update.

Checkpoint: ``expert_state`` names each slice's master and AdamW moments by parameter and expert
range (``layers.1.experts_down@experts[4:8]``): the ranks of one column write the same key with the
same bits (``torch.distributed.checkpoint`` keeps one copy), different slices different keys.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from isoexec.dist.collectives import sum_in_rank_order
from isoexec.train.optim import clipped_update

from .grad_norm import sharded_grad_norm


def _adamw(params: list, lr, betas, eps, weight_decay, foreach) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with decay on matrices only (dim >= 2 of the whole parameter)."""
    groups = []
    for decay in (True, False):
        ps = [p for p in params if (p.dim() >= 2) == decay]
        if ps:
            groups.append({"params": ps, "weight_decay": weight_decay if decay else 0.0})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=foreach)


class _Both:
    """What ``clipped_update`` steps: both optimizers, with the one clip it applied."""

    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()


class ExpertParallelAdamW:
    """AdamW over a model sharded by ``shard_model(..., ignored=experts)``: ``expert_names`` are
    its expert slices (plain parameters), every other trainable parameter an fp32 DTensor shard
    over ``group`` (size ``dp``, rank = global rank). ``replica_group`` (size ``replicas``): the
    ranks holding this rank's slices; ``ep``: the size of an ep group (ranks 0 .. ep - 1 hold
    every slice once). ``step`` returns what ``MasterAdamW.step`` returns, the same on every
    rank."""

    def __init__(self, model: nn.Module, expert_names: Sequence[str], group, dp: int, replica_group,
                 replicas: int, ep: int, ranges: dict[str, tuple[int, int]], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 grad_clip: Optional[float] = None, foreach: bool = True):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        experts = set(expert_names)
        if not named:
            raise ValueError("ExpertParallelAdamW: the model has no trainable parameters")
        if not experts <= {n for n, _ in named}:
            raise ValueError(f"ExpertParallelAdamW: {sorted(experts - {n for n, _ in named})} are not trainable "
                             "parameters of the model")
        for n, p in named:
            if n not in experts and (p.dtype != torch.float32 or not hasattr(p, "to_local")):
                raise ValueError(f"parameter {n} is a {type(p).__name__} of {p.dtype}; ExpertParallelAdamW steps "
                                 "the fp32 DTensor shards of a model sharded by shard_model, and the expert slices")
            if n in experts and (hasattr(p, "to_local") or not p.dtype.is_floating_point):
                raise ValueError(f"expert slice {n} is a {type(p).__name__} of {p.dtype}; it must stay a plain "
                                 "floating-point parameter, outside FSDP2 (shard_model's ignored)")
        self.names = [n for n, _ in named]             # the model's order: the norm's order
        self.params = [p for _, p in named]
        self.is_expert = [n in experts for n in self.names]
        # clone(): for an fp32 model .to() would return the parameter itself, not a copy
        self.masters = {n: p.detach().to(torch.float32).clone() for n, p in named if n in experts}
        self.ranges = {n: ranges[n] for n in self.masters}
        self.group, self.dp = group, dp
        self.replica_group, self.replicas, self.ep = replica_group, replicas, ep
        self.lr, self.betas, self.eps = lr, tuple(betas), eps
        self.weight_decay, self.grad_clip, self.foreach = weight_decay, grad_clip, foreach
        shards = [p for p, e in zip(self.params, self.is_expert) if not e]
        self.opt = _adamw(shards, lr, self.betas, eps, weight_decay, foreach)
        self.expert_opt = _adamw(list(self.masters.values()), lr, self.betas, eps, weight_decay, foreach)
        self.steps = 0

    # ---------------------------------------------------------------------------------- grads
    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add each expert slice's gradient (cast to fp32) to its master's; clear the slice's.
        Call after every micro-batch's backward (the shards' gradients FSDP2 accumulates itself)."""
        for n, p, e in zip(self.names, self.params, self.is_expert):
            if not e or p.grad is None:
                continue
            m = self.masters[n]
            g = p.grad.to(torch.float32)
            if m.grad is None:
                m.grad = g if g is not p.grad else g.clone()
            else:
                m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def reduce_expert_grads(self) -> None:
        """Add the expert slices' gradients over the ``ep_replica`` column, in rank order (module
        docstring); every rank of the column ends with the same bits. A slice no backward reached
        counts as zeros (an expert-parallel backward gives its slices zeros, not None)."""
        if self.replicas == 1:
            return
        for m in self.masters.values():   # one parameter at a time: the gather holds replicas copies of it
            g = m.grad if m.grad is not None else torch.zeros_like(m)
            m.grad = sum_in_rank_order(g, self.replica_group, self.replicas)

    @property
    def grads(self) -> list[Optional[torch.Tensor]]:
        """Every trainable parameter's gradient in the model's order: a shard's ``grad``, a slice's
        fp32 master gradient."""
        return [self.masters[n].grad if e else p.grad for n, p, e in zip(self.names, self.params, self.is_expert)]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters.values():
            m.grad = None

    # ----------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, lr_scale: float = 1.0) -> dict:
        """Replica sum of the slices' gradients, the clip by the norm of every gradient counted
        once, AdamW on the shards and the masters, the masters into the slices, grads cleared.
        Returns ``grad_norm`` (before clipping), ``clip_coef``, ``lr`` and ``skipped``."""
        lr = self.lr * lr_scale
        for opt in (self.opt, self.expert_opt):
            for group in opt.param_groups:
                group["lr"] = lr
        self.reduce_expert_grads()
        grads = self.grads
        first_group = range(self.ep)   # ranks 0 .. ep - 1: every slice once
        norm = sharded_grad_norm(grads, self.group, self.dp,
                                 counted=[first_group if e else None for e in self.is_expert])
        stats = clipped_update(_Both(self.opt, self.expert_opt), grads, norm, self.grad_clip, lr,
                               local=lambda g: g.to_local() if hasattr(g, "to_local") else g)
        if not stats["skipped"]:
            self.sync_params()
            self.steps += 1
        self.zero_grad()
        return stats

    @torch.no_grad()
    def sync_params(self) -> None:
        """Overwrite each expert slice IN PLACE with its master rounded to the slice's dtype."""
        for n, p, e in zip(self.names, self.params, self.is_expert):
            if e:
                p.copy_(self.masters[n].to(p.dtype))

    # ----------------------------------------------------------------------------- checkpoint
    def expert_state(self) -> dict:
        """The expert slices' masters and AdamW state, keyed by parameter and expert range (module
        docstring): the live tensors, for ``torch.distributed.checkpoint`` to write or to load into.
        A master the optimizer has not stepped yet gets AdamW's initial state (step 0, zero moments,
        what its first step would create), so a fresh trainer can be loaded into."""
        out = {}
        for n, m in self.masters.items():
            st = self.expert_opt.state[m]
            if not st:
                st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(m),
                          exp_avg_sq=torch.zeros_like(m))
            e0, e1 = self.ranges[n]
            out[f"{n}@experts[{e0}:{e1}]"] = {"master": m, "step": st["step"], "exp_avg": st["exp_avg"],
                                              "exp_avg_sq": st["exp_avg_sq"]}
        return out

    @torch.no_grad()
    def load_expert_state(self, state: dict) -> None:
        """Restore an ``expert_state`` (copied in; a no-op for the live tensors themselves), then
        write the masters into the slices."""
        mine = self.expert_state()
        if state.keys() != mine.keys():
            raise ValueError(f"expert-parallel optimizer state for slices {sorted(state)[:3]}..., this rank holds "
                             f"{sorted(mine)[:3]}...; load a checkpoint written at the same ep")
        for k, dst in mine.items():
            for f, t in dst.items():
                if state[k][f] is not t:
                    t.copy_(state[k][f])
        self.zero_grad()
        self.sync_params()
