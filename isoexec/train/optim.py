"""AdamW over fp32 master weights for a model that computes in bf16 (or fp32).

Why masters: a bf16 parameter cannot absorb an update much smaller than its own ULP (2^-8
relative), so Adam steps of size ~lr vanish when applied to bf16 directly. The optimizer
therefore keeps an fp32 copy of every parameter, accumulates gradients in fp32, runs
``torch.optim.AdamW`` on the copies, and then writes ``master.to(param.dtype)`` back INTO the
model's parameter tensors. Writing in place (not rebinding ``param.data``) keeps every
reference to the parameters valid: the rollout engine holds the same tensors (colocated) or
copies from them, and a CUDA graph captured over them keeps pointing at live storage.

Why a fixed-order gradient norm: the clip factor multiplies every gradient, so a norm that
changed in its last bit with the thread count or the device would change every update. The
norm here is built from IEEE basic operations only: each parameter's sum of squares is reduced
by a fixed pairwise tree (``isoexec_kernels._ref.tree_sum0``, its order depends only on the
element count), the per-parameter sums are added left to right in parameter order, and the
square root is correctly rounded. The same gradients therefore always give the same clip factor.

Why ``torch.optim.AdamW`` and pinned ``foreach``: the update rule is the stock one (nothing to
audit); ``foreach`` is pinned (default True) because the foreach and per-tensor implementations
are not guaranteed to round identically, and a resumed run must use the same one.

Weight decay applies to matrices (dim >= 2) only: decaying the 1-D RMSNorm gains would pull them
from their identity value 1 toward 0, which is not the regularisation anyone asks for.
"""

from __future__ import annotations

import copy
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from isoexec_kernels._ref import tree_sum0

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), at most 1


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """fp32 sum of squares of ``t`` by the fixed halves tree: same bits for the same values
    whatever the thread count or device."""
    x = t.detach().to(torch.float32).reshape(-1)
    return tree_sum0(x * x)


def global_grad_norm(grads: Iterable[Optional[torch.Tensor]]) -> torch.Tensor:
    """fp32 L2 norm of all ``grads`` (None counts as zero): per-tensor tree sums of squares added
    in the given order from +0, then sqrt."""
    total = None
    for g in grads:
        if g is None:
            continue
        s = sum_of_squares(g)
        total = s if total is None else total + s
    if total is None:
        return torch.zeros((), dtype=torch.float32)
    return torch.sqrt(total)


def clip_coefficient(norm: torch.Tensor, max_norm: Optional[float]) -> torch.Tensor:
    """The factor every gradient is multiplied by: ``min(1, max_norm / (norm + 1e-6))``, or 1
    when clipping is off (``max_norm`` None)."""
    one = torch.ones((), dtype=torch.float32, device=norm.device)
    if max_norm is None:
        return one
    return torch.minimum(one, torch.tensor(max_norm, dtype=torch.float32, device=norm.device) / (norm + CLIP_EPS))


def clipped_update(opt: torch.optim.Optimizer, grads, norm: torch.Tensor, max_norm: Optional[float], lr: float,
                   local=lambda g: g) -> dict:
    """One optimizer step on ``grads`` (the tensors ``opt`` updates) clipped by ``norm``, unless
    the norm is not finite (no update). ``local(g)`` is the tensor to scale in place (a DTensor's
    local shard). Returns ``grad_norm`` (before clipping), ``clip_coef``, ``lr`` and ``skipped``;
    the caller clears the gradients."""
    if not bool(torch.isfinite(norm)):
        return {"grad_norm": float(norm), "clip_coef": 0.0, "lr": lr, "skipped": True}
    coef = clip_coefficient(norm, max_norm)
    if max_norm is not None:
        for g in grads:
            if g is not None:
                local(g).mul_(coef.to(g.device))
    opt.step()
    return {"grad_norm": float(norm), "clip_coef": float(coef), "lr": lr, "skipped": False}


class MasterAdamW:
    """AdamW on fp32 masters of ``model``'s trainable parameters, written back in place.

    Use: after each micro-batch ``loss.backward()`` call :meth:`accumulate_grads` (moves the
    parameter grads, cast to fp32, into the masters' grads: accumulation happens in fp32 even for
    a bf16 model); after the last one call :meth:`step` (clip by the fixed-order global norm,
    AdamW on the masters, copy into the parameters, clear grads).
    """

    def __init__(self, model: nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, grad_clip: Optional[float] = None, foreach: bool = True):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("MasterAdamW: the model has no trainable parameters")
        for n, p in named:
            if not p.dtype.is_floating_point:
                raise ValueError(f"parameter {n} has dtype {p.dtype}; MasterAdamW needs floating-point parameters")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # clone(): for an fp32 model .to() would return the parameter itself, not a copy
        self.masters = [p.detach().to(torch.float32).clone() for p in self.params]
        self.lr, self.betas, self.eps = lr, tuple(betas), eps
        self.weight_decay, self.grad_clip, self.foreach = weight_decay, grad_clip, foreach
        groups, self._group_decays = [], []
        for decay in (True, False):
            ms = [m for m in self.masters if (m.dim() >= 2) == decay]
            if ms:
                groups.append({"params": ms, "weight_decay": weight_decay if decay else 0.0})
                self._group_decays.append(decay)
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=self.betas, eps=eps, foreach=foreach)
        self.steps = 0

    # ---------------------------------------------------------------------------------- grads
    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add every parameter's grad (cast to fp32) to its master's grad; clear the parameter's.
        Call once after each micro-batch backward: sums happen in fp32 in micro-batch order."""
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                continue
            g = p.grad.to(torch.float32)
            if m.grad is None:
                m.grad = g if g is not p.grad else g.clone()
            else:
                m.grad.add_(g)
            p.grad = None

    @property
    def grads(self) -> list[Optional[torch.Tensor]]:
        """The accumulated fp32 gradients (None where nothing was accumulated)."""
        return [m.grad for m in self.masters]

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    # ----------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, lr_scale: float = 1.0) -> dict:
        """Clip, update the masters, write them into the parameters. Returns ``grad_norm`` (before
        clipping), ``clip_coef``, ``lr`` (the rate this step used) and ``skipped`` (True when the
        norm is not finite: no update).

        ``lr_scale`` multiplies the configured rate for this step only (a warm-up schedule): the
        rate is set on every step rather than kept as state, so a resumed run and an SFT step
        after RL updates use exactly the rate their caller asks for."""
        lr = self.lr * lr_scale
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.accumulate_grads()
        stats = clipped_update(self.opt, self.grads, global_grad_norm(self.grads), self.grad_clip, lr)
        if not stats["skipped"]:
            self.sync_params()
            self.steps += 1
        self.zero_grad()
        return stats

    @torch.no_grad()
    def sync_params(self) -> None:
        """Overwrite each parameter IN PLACE with its master rounded to the parameter's dtype."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m.to(p.dtype))

    # ----------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """A snapshot (tensors cloned: later steps do not change it) of the masters, the AdamW
        moments and step counts, and the step counter."""
        return {"names": list(self.names), "masters": [m.detach().clone() for m in self.masters],
                "adamw": copy.deepcopy(self.opt.state_dict()), "steps": self.steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` snapshot, then write the masters into the parameters so the
        model is exactly where the checkpointed run was. Hyperparameters (lr, betas, eps, weight
        decay) stay those this optimizer was built with: the config, not the checkpoint, decides."""
        if list(state["names"]) != self.names:
            raise ValueError("optimizer checkpoint is for different parameters: "
                             f"{_first_difference(state['names'], self.names)}")
        for n, m, src in zip(self.names, self.masters, state["masters"]):
            if tuple(src.shape) != tuple(m.shape):
                raise ValueError(f"optimizer checkpoint: master {n} has shape {tuple(src.shape)}, "
                                 f"parameter has {tuple(m.shape)}")
            m.copy_(src)
        self.opt.load_state_dict(copy.deepcopy(state["adamw"]))  # deepcopy: never alias the caller's tensors
        for group, decay in zip(self.opt.param_groups, self._group_decays):
            group.update(lr=self.lr, betas=self.betas, eps=self.eps, foreach=self.foreach,
                         weight_decay=self.weight_decay if decay else 0.0)
        self.steps = int(state["steps"])
        self.zero_grad()
        self.sync_params()


def _first_difference(a: Sequence[str], b: Sequence[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"position {i}: checkpoint has {x!r}, model has {y!r}"
    return f"checkpoint has {len(a)} parameters, model has {len(b)}"
