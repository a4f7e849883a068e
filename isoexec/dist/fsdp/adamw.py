"""AdamW on the fp32 shards of an FSDP2 model: ``MasterAdamW``'s update, sharded.

Under ``shard_model`` the model's parameters are fp32 DTensor shards and are the master weights
(``shard.py``); the gathered bf16 copies the forward reads are FSDP2's rounding of them. So this
optimizer keeps no second copy: it runs ``torch.optim.AdamW`` (``foreach`` pinned) directly on the
shards, with ``MasterAdamW``'s rules: weight decay on matrices only (dim >= 2 of the whole
parameter), the clip coefficient ``min(1, max_norm / (norm + 1e-6))`` applied to every gradient
before the step, a non-finite norm skips the update, and the LR is set on every step. AdamW is
elementwise, so a shard's update is bit for bit the single process's update of those elements
given the same gradients; what differs is the norm's order of additions (``grad_norm.py``).

Gradients: every micro-batch's backward reduce-scatters, and FSDP2 adds the reduced fp32 shard
into ``param.grad`` (the first one sets it), so at the end of a mini-batch ``param.grad`` is the
shard's gradient sum and ``accumulate_grads`` has nothing to do; it exists because the trainer
calls it.

The torch optimizer's parameters are the model's own, so ``torch.distributed.checkpoint``'s
``get_state_dict`` / ``set_state_dict`` save and restore its state sharded (``trainer.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from isoexec.train.optim import clipped_update

from .grad_norm import sharded_grad_norm


class ShardedAdamW:
    """AdamW over the fp32 DTensor parameters of a sharded model; ``step`` returns what
    ``MasterAdamW.step`` returns."""

    def __init__(self, model: nn.Module, group, dp: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, grad_clip: Optional[float] = None,
                 foreach: bool = True):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ShardedAdamW: the model has no trainable parameters")
        for n, p in named:
            if p.dtype != torch.float32 or not hasattr(p, "to_local"):
                raise ValueError(f"parameter {n} is a {type(p).__name__} of {p.dtype}; ShardedAdamW steps the fp32 "
                                 "DTensor shards of a model sharded by shard_model")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.group, self.dp = group, dp
        self.lr, self.betas, self.eps = lr, tuple(betas), eps
        self.weight_decay, self.grad_clip, self.foreach = weight_decay, grad_clip, foreach
        groups = []
        for decay in (True, False):
            ps = [p for p in self.params if (p.dim() >= 2) == decay]
            if ps:
                groups.append({"params": ps, "weight_decay": weight_decay if decay else 0.0})
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=self.betas, eps=eps, foreach=foreach)
        self.steps = 0

    def accumulate_grads(self) -> None:
        """Nothing to do: FSDP2 accumulates (see the module docstring)."""

    @property
    def grads(self) -> list[Optional[torch.Tensor]]:
        return [p.grad for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr_scale: float = 1.0) -> dict:
        """Clip by the fixed-order sharded norm, AdamW on the shards, clear grads. Returns
        ``grad_norm`` (before clipping), ``clip_coef``, ``lr`` and ``skipped``, the same on every
        rank."""
        lr = self.lr * lr_scale
        for group in self.opt.param_groups:
            group["lr"] = lr
        stats = clipped_update(self.opt, self.grads, sharded_grad_norm(self.grads, self.group, self.dp),
                               self.grad_clip, lr, local=lambda g: g.to_local())
        if not stats["skipped"]:
            self.steps += 1
        self.zero_grad()
        return stats
