"""The data-parallel trainer of an MoE model whose routed experts are sharded over an ``ep`` axis.

``ExpertParallelTrainer(model, config, ep)`` is ``FSDPTrainer`` (every rank takes its own
sequences of each batch, the whole batch handed to every rank; the loss, statistics and
checkpoints as there) for the MoE families (``mla_moe``, ``hybrid_moe``), with each MoE layer's
routed experts dealt over ep ranks instead of sharded by FSDP2. N ranks, ep dividing N:

- **who holds what.** ``isoexec.dist.mesh.ep_mesh(ep)``: the ep consecutive ranks
  ``[g * ep, (g + 1) * ep)`` form ep group g and hold one copy of the experts between them, rank
  ``r`` the slice ``expert_shard_range(E, ep, r % ep)`` of every MoE layer (whole experts, 6 over 4
  ranks as 1, 2, 1, 2); the ranks ``j, j + ep, ...`` (an ``ep_replica`` column) hold the same slice.
  The model is ``ExpertParallelMoe(model, ep group)`` (``isoexec.model.ep_moe``): every MoE layer
  sends each routed row to its expert's owner in the group and back (copies), so a sequence's
  logprobs are the one-process model's bits whichever rank holds it (the forward is bitwise, as
  under ``FSDPTrainer``).
- **the replicated parameters** (everything but the expert slices) are sharded over all N ranks by
  ``shard_model`` exactly as under ``FSDPTrainer``: fp32 shards are the masters, bf16 compute by
  FSDP2's mixed precision, gradients reduce-scattered over all N ranks in rank order. Frozen ones
  (GLM's router correction bias, fp32 in every model) stay whole and out of FSDP2, in their dtype.
- **the expert slices** stay out of FSDP2 (``fully_shard``'s ``ignored_params``; ``shard.py`` says
  why: FSDP2 would take the ranks' different slices for shards of one parameter, and cannot cut
  uneven slices). Plain parameters in the compute dtype, with fp32 masters in
  ``ExpertParallelAdamW`` (``ep_adamw.py``): a slice's gradient, already complete over its ep group,
  is accumulated into its master after every micro-batch and added over its ``ep_replica`` column
  in rank order before the step (gather, then a fixed-order sum; no all_reduce).
- **the step.** One clip over every gradient, each counted once (``grad_norm.py``), then AdamW on
  the shards and on the masters, the masters rounded into the slices.
- **lockstep.** Each MoE layer's exchange is a collective of the ep group, and each layer's
  all-gather and reduce-scatter one of all N ranks, so every rank runs the same number of forward
  (and backward) passes: the most of any rank, the extra ones empty (no token: they join the
  exchanges and the collectives and add nothing), as under ``FSDPTrainer`` (``_lockstep``).

What matches, and how (tests/dist/test_ep_trainer.py, gloo, CPU): the forward (scoring, the
training forward) is bitwise the single-process ``Trainer``'s; a step is bitwise the same run to
run; against the single process it agrees within a tolerance: an expert's weight gradient sums
its rows of every rank of a group in one pass (one process sums each micro-batch's rows and then
adds micro-batches), another association of the same fp32 terms.

Weight sync: ``full_parameters()`` gathers the shards whole and each MoE layer's expert slices
over the ep group (padded to the widest slice, ``all_gather`` of the bytes in rank order, a copy),
so it returns the one-process model's fp32 masters by name. Checkpoints: ``save`` / ``load`` as
under ``FSDPTrainer`` (``torch.distributed.checkpoint``), the model's expert slices left out of its
state dict and the slices' masters and AdamW state saved under keys of their own, parameter and
expert range (``ExpertParallelAdamW.expert_state``); a resumed run is bitwise the uninterrupted one
at the same world size and ep.

Refused on every rank before any collective, in one line: an ep that does not divide the world
(``ValueError``), an ep the model's contract does not claim or the experts cannot be dealt to
(``TopologyRefused``, ``ep_moe.check_ep``), a family without routed experts (``BindingRefused``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from isoexec.dist.collectives import gather_in_rank_order
from isoexec.dist.lazy_parameters import GatheredParameters
from isoexec.dist.mesh import DP, EP, EP_REPLICA, check_dp_mesh, check_ep_size, dp_mesh, ep_mesh
from isoexec.dist.partition import expert_shard_range
from isoexec.errors import BindingRefused
from isoexec.model.ep_moe import EP_FAMILIES, ExpertParallelMoe, check_ep, is_expert_weight, num_routed_experts
from isoexec.train.trainer import TrainConfig

from .ep_adamw import ExpertParallelAdamW
from .shard import free_params, shard_model
from .trainer import FSDPTrainer


class ExpertParallelTrainer(FSDPTrainer):
    """``FSDPTrainer`` over every rank of the default group with ``model``'s routed experts dealt
    over ``ep`` ranks (module docstring). ``model``: the single-process MoE model with its contract
    installed, the same on every rank; the trainer holds its own cut of it (``self.model``), the
    caller may drop ``model``. Every rank calls every method with the same arguments."""

    def __init__(self, model, config: TrainConfig, ep: int):
        if not isinstance(config, TrainConfig):
            raise TypeError(f"ExpertParallelTrainer needs a TrainConfig, got {type(config).__name__}")
        # refusals from sizes and the contract alone: every rank, before the meshes' collectives
        family = getattr(model, "family", type(model).__name__)
        if family not in EP_FAMILIES:
            raise BindingRefused(f"expert-parallel trainer: the {family} family has no routed experts (expert "
                                 f"parallelism serves {', '.join(EP_FAMILIES)})")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("the expert-parallel trainer needs an initialised default process group")
        check_ep_size(ep, dist.get_world_size())
        check_ep(model, ep)
        device_type = next(model.parameters()).device.type
        mesh = dp_mesh(device_type=device_type)
        self.dp, self.rank = check_dp_mesh(mesh)
        self.mesh, self.group = mesh, mesh.get_group(DP)
        self.ep_mesh, self.ep = ep_mesh(ep, device_type), ep
        self.ep_group, self.replica_group = self.ep_mesh.get_group(EP), self.ep_mesh.get_group(EP_REPLICA)
        self.replicas = self.dp // ep
        cut = ExpertParallelMoe(model, self.ep_group)
        experts = [(n, p) for n, p in cut.named_parameters() if is_expert_weight(n)]
        # frozen parameters stay out of FSDP2 too: replicated, no gradient, in their own dtype
        # (GLM's fp32 correction bias in a bf16 model; the mixed-precision cast would round it)
        frozen = [p for p in cut.parameters() if not p.requires_grad]
        self.model, self.config = shard_model(cut, mesh, ignored=[p for _, p in experts] + frozen,
                                              reshard_after_forward=config.reshard_after_forward), config
        # the checkpoint runs inside each layer's FSDP2 unit (shard.py): the recompute in the
        # backward reads the layer gathered again, and runs its MoE exchanges again
        cut.activation_checkpointing = config.activation_checkpointing
        self.optimizer = ExpertParallelAdamW(
            cut, [n for n, _ in experts], self.group, self.dp, self.replica_group, self.replicas, ep,
            {n: cut.expert_range for n, _ in experts}, lr=config.lr, betas=config.betas, eps=config.eps,
            weight_decay=config.weight_decay, grad_clip=config.grad_clip)
        self._rng = torch.Generator().manual_seed(config.seed)
        self.rl_updates = 0

    # ----------------------------------------------------------------------------- weights
    def _whole_experts(self, name: str) -> torch.Tensor:
        """The fp32 master of expert weight ``name`` whole: every slice of this rank's ep group,
        padded to the widest, gathered as bytes in rank order (a copy) and cut back."""
        m = self.optimizer.masters[name]
        bounds = [expert_shard_range(num_routed_experts(self.model.cfg), self.ep, q) for q in range(self.ep)]
        width = max(b - a for a, b in bounds)
        padded = m.new_zeros((width, *m.shape[1:]))
        padded[:m.shape[0]] = m
        parts = gather_in_rank_order(padded, self.ep_group, self.ep)
        return torch.cat([parts[q, :b - a] for q, (a, b) in enumerate(bounds)])

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the one-process model's names (fp32 masters; frozen ones
        too): the shards gathered, the expert slices gathered over the ep group; a collective. All
        at once: the weight sync reads :meth:`gathered_parameters`."""
        return dict(self.gathered_parameters())

    def gathered_parameters(self) -> GatheredParameters:
        """:meth:`full_parameters` read one parameter at a time (``GatheredParameters``): the
        FSDP2 trainer's, with each expert weight's slices gathered over the ep group instead."""
        base = super().gathered_parameters()
        masters = self.optimizer.masters
        E = num_routed_experts(self.model.cfg)
        shapes = {n: (E, *masters[n].shape[1:]) if n in masters else base.shape_of(n) for n in base}
        return GatheredParameters(shapes, lambda n: self._whole_experts(n) if n in masters else base[n])

    # --------------------------------------------------------------------------- checkpoints
    def _state(self) -> dict:
        free_params(self.model)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer.opt)
        for n in self.optimizer.masters:   # a slice per rank under one name: saved as `experts` instead
            model_sd.pop(n)
        return {"model": model_sd, "optimizer": optim_sd, "experts": self.optimizer.expert_state(),
                "trainer": {"rng": self._rng.get_state(), "rl_updates": torch.tensor(self.rl_updates),
                            "steps": torch.tensor(self.optimizer.steps)}}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` in place: the shards and their AdamW state
        (``set_state_dict``), the slices' masters and AdamW state (written into the slices)."""
        free_params(self.model)
        keys = set_state_dict(self.model, self.optimizer.opt, model_state_dict=state["model"],
                              optim_state_dict=state["optimizer"], options=StateDictOptions(strict=False))
        # not strict only for the expert slices, which the model state leaves out: anything else is refused
        missing = set(keys.missing_keys) - set(self.optimizer.masters)
        if missing or keys.unexpected_keys:
            raise ValueError(f"expert-parallel trainer checkpoint: model state missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(keys.unexpected_keys)[:5]}")
        self.optimizer.load_expert_state(state["experts"])
        t = state["trainer"]
        self._rng.set_state(t["rng"])
        self.rl_updates = int(t["rl_updates"])
        self.optimizer.steps = int(t["steps"])
        self.optimizer.zero_grad()
