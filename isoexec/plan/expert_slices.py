"""What one GPU of the expert-parallel trainer holds of the routed experts (``rl.settings.trainer_ep``).

With ``trainer_ep: e`` > 1 a distributed run's trainer is ``isoexec.dist.fsdp.ExpertParallelTrainer``
over every rank (N of them, e dividing N; mesh ``(ep_replica, ep)`` = ``(N / e, e)``). Read off its
code (``ep_trainer.py``, ``ep_adamw.py``, ``isoexec.model.ep_moe``):

- each MoE layer's stacked routed-expert weights (``experts_gate_up``, ``experts_down``) are cut by
  whole experts, rank r holding ``expert_shard_range(E, e, r % e)`` (6 experts over 4 ranks: 1, 2,
  1, 2). The slice stays out of FSDP2 (``ignored_params``): a plain parameter in the compute dtype,
  held whole between steps and through every pass, never gathered or freed per layer;
- ``ExpertParallelAdamW`` keeps an fp32 master of the slice (a clone, also for an fp32 model) and
  AdamW's two fp32 moments of that master;
- the gradients are slice-sized, never full-size: a backward leaves the slice's ``p.grad`` in the
  compute dtype (already summed over the ep group by the exchange's backward), and
  ``accumulate_grads`` adds it, cast to fp32, into the master's gradient after every micro-batch,
  which lives until the step clears it. At the end of a micro-batch's backward both exist: compute
  dtype + 4 bytes per slice element, the one-process layout. Beyond them, one expert weight at a
  time: ``accumulate_grads``'s fp32 copy of a bf16 ``p.grad`` (4 bytes per element of that weight)
  and, with ``N / e`` > 1 replicas, the replica sum before the step (``sum_in_rank_order``: the
  column's ``N / e`` copies gathered and stacked, 2 x 4 bytes per element per replica);
- everything else (attention or Gated DeltaNet, router, shared expert, norms, embedding, lm_head)
  is FSDP2-sharded over all N ranks exactly as under ``FSDPTrainer``: ``states.bytes_per_param``
  at dp = N, and the FSDP2 units without the experts (``states.fsdp_units``). The frozen router
  correction bias (GLM) is whole on every rank in fp32, as the plan counts it already.

The slice is counted on the family's model built on the ``meta`` device and cut with the run's own
``ep_moe.cut_parameter``, so an uneven deal (E not a multiple of e) gives the largest rank's slice.
``tests/plan/test_expert_parallel_plan.py`` checks it against what ``ExpertParallelAdamW`` holds on a
gloo world of two ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dist.partition import expert_shard_range
from ..model import FAMILY_MODELS
from ..model.ep_moe import cut_parameter, is_expert_weight, num_routed_experts
from .states import DTYPE_BYTES, expert_slice_bytes_per_element

#: bytes per element of one expert weight's fp32 gradient while the replica column's copies are
#: gathered (the all_gather's receive buffers) and stacked into one tensor, per replica
REPLICA_SUM_BYTES = 2 * 4
#: bytes per element of one expert weight's fp32 copy of its compute-dtype p.grad in accumulate_grads
ACCUMULATE_COPY_BYTES = 4


@dataclass(frozen=True)
class ExpertSlices:
    """The routed-expert weights of a model under the expert-parallel trainer at ``ep`` over ``world``
    ranks, in elements."""

    ep: int
    world: int
    experts: int                      # E, routed experts per MoE layer
    total: int                        # every routed-expert weight of the model, whole
    per_rank: tuple[int, ...]         # ep rank q's slice, every MoE layer (q = rank % ep)
    experts_per_rank: tuple[int, ...]  # ep rank q's whole experts per MoE layer
    largest_weight: int               # one expert weight's slice, the largest of any rank

    @property
    def replicas(self) -> int:
        """Ranks holding the same slice (the ``ep_replica`` column)."""
        return self.world // self.ep

    @property
    def slice(self) -> int:
        """Elements of the largest rank's slice: what the plan counts per GPU."""
        return max(self.per_rank)

    def state_bytes(self, dtype: str) -> dict[str, int]:
        """Bytes of the largest slice per trainer state (weights, master, adam, grads)."""
        return {s: int(self.slice * v) for s, v in expert_slice_bytes_per_element(dtype).items()}

    def grads_in_flight_bytes(self, dtype: str) -> int:
        """Gradient bytes beyond the slice's ``p.grad`` and master gradient, one expert weight at a
        time (module docstring): the fp32 copy ``accumulate_grads`` makes of a non-fp32 ``p.grad``,
        or the replica sum's gathered copies, whichever is larger."""
        copy = ACCUMULATE_COPY_BYTES if DTYPE_BYTES[dtype] != 4 else 0
        replica = REPLICA_SUM_BYTES * self.replicas if self.replicas > 1 else 0
        return self.largest_weight * max(copy, replica)


def expert_slices(family: str, cfg, ep: int, world: int) -> ExpertSlices:
    """The routed-expert slices of ``family``'s model built from ``cfg`` at ``ep`` over ``world``
    ranks, counted on the ``meta`` device with the run's own cut (``ep_moe.cut_parameter``)."""
    model = FAMILY_MODELS[family][0](cfg, device="meta")
    weights = [(n, p) for n, p in model.named_parameters() if is_expert_weight(n)]
    if not weights:
        raise ValueError(f"expert_slices: the {family} model has no routed-expert weights")
    cuts = [[cut_parameter(cfg, ep, q, n, p).numel() for n, p in weights] for q in range(ep)]
    E = num_routed_experts(cfg)
    counts = tuple(b - a for a, b in (expert_shard_range(E, ep, q) for q in range(ep)))
    return ExpertSlices(ep=ep, world=world, experts=E, total=sum(p.numel() for _, p in weights),
                        per_rank=tuple(sum(c) for c in cuts), experts_per_rank=counts,
                        largest_weight=max(max(c) for c in cuts))
