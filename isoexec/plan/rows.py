"""One row of the plan: a family's run at its parallel sizes, every state in bytes per GPU, the
total against the GPU's memory, and the verdict.

The peak is taken as everything held at once: the persistent states (trainer weights, fp32
masters, Adam moments, the engine's weights, its KV pool and state slots) plus the gradients of a
mini-batch (under FSDP2 the gathered units and the gradient in flight are added to the trainer
weights and the gradients: ``states.FsdpUnits``), plus the larger of the two phases' activations (rollout and training alternate in the
synchronous loop; the gradients are freed between mini-batches, so adding them to the rollout's
activations overstates that phase a little, never the training one).

With ``trainer_ep`` > 1 the routed experts leave the FSDP2 layout: the parameters FSDP2 still
shards take ``bytes_per_param`` at dp = every GPU, this GPU's expert slice takes
``expert_slices``'s bytes (the largest rank's slice), and the gradient in flight is the larger of
FSDP2's (units without the experts, during the backward) and one expert weight's (after it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import engine_activation_bytes, micro_batch_tokens, trainer_activation_bytes
from .engine_pools import engine_weight_elements, kv_bytes_per_page, kv_pool_bytes, recurrent_state_bytes
from .params import ParamCount, count_parameters
from .expert_slices import ExpertSlices, expert_slices
from .states import (DTYPE_BYTES, FROZEN_BYTES, STATES, BytesPerParam, FsdpUnits, bytes_per_param,
                     expert_bytes_per_param, fsdp_units)
from .workflow_config import RunShape

GIB = 1 << 30

#: GPU memory the plan compares with when --gpu-memory-gib is not given, per contract arch.
DEFAULT_GPU_MEMORY_GIB = {"sm90": (80.0, "an H100 80 GB; an H200 has about 140"),
                          "cpu": (80.0, "an H100's 80 GB, for comparison: arch cpu runs in host memory")}


def default_gpu_memory(arch: str) -> tuple[float, str]:
    return DEFAULT_GPU_MEMORY_GIB.get(arch, (80.0, f"an H100's 80 GB: no figure for arch {arch}"))


@dataclass(frozen=True)
class PlanRow:
    shape: RunShape
    params: ParamCount
    per_param: BytesPerParam
    states: dict                  # state -> bytes per GPU (STATES)
    kv_pool: int
    recurrent_state: int
    trainer_activations: int
    engine_activations: int
    capacity: int                 # bytes of one GPU
    units: FsdpUnits | None = None    # the FSDP2 units (dp > 1), counted into weights and grads
    experts: ExpertSlices | None = None          # trainer_ep > 1: this GPU's routed-expert slice
    expert_per_param: BytesPerParam | None = None   # trainer_ep > 1: the experts' bytes per parameter

    @property
    def activations(self) -> int:
        return max(self.trainer_activations, self.engine_activations)

    @property
    def total(self) -> int:
        return sum(self.states.values()) + self.kv_pool + self.recurrent_state + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def pages_that_fit(self) -> int:
        """The most KV pages with which the row would fit, everything else as planned (may be <= 0)."""
        s = self.shape
        per_page = kv_bytes_per_page(s.cfg, s.page_size, s.dtype, s.engine_tp)
        if per_page == 0:
            return s.num_pages
        return (self.capacity - (self.total - self.kv_pool)) // per_page

    def verdict(self) -> str:
        """fits (and what is left), or by how much not, and whether fewer KV pages would do."""
        gib = lambda b: f"{b / GIB:,.1f} GiB"  # noqa: E731
        if self.fits:
            return f"fits, {gib(self.capacity - self.total)} free"
        out = f"does not fit: over by {gib(self.total - self.capacity)}"
        s = self.shape
        rest = self.total - self.kv_pool - self.capacity       # over (> 0) or under without the KV pool
        if not self.kv_pool or rest > 0:
            return out + (f" ({gib(rest)} without the KV pool)" if self.kv_pool else "")
        n, need = self.pages_that_fit(), -(-s.longest_sequence // s.page_size)
        if n < need:
            return out + f"; {n:,} KV pages would fit, one whole sequence needs {need:,}"
        return out + f"; fits with engine.num_pages <= {n:,} (now {s.num_pages:,})"


def plan_row(shape: RunShape, capacity_bytes: int) -> PlanRow:
    """The memory of ``shape``'s run on one GPU."""
    cfg, b = shape.cfg, DTYPE_BYTES[shape.dtype]
    params = count_parameters(cfg)
    pp = bytes_per_param(shape.dtype, shape.dp)
    states = {s: int(params.trainable * getattr(pp, s)) for s in STATES}
    experts = expert_pp = None
    if shape.trainer_ep > 1:    # the routed experts out of FSDP2: the rest sharded, this GPU's slice whole
        experts = expert_slices(shape.family, cfg, shape.trainer_ep, shape.dp)
        expert_pp = expert_bytes_per_param(shape.dtype, shape.dp, shape.trainer_ep)
        for s, slice_bytes in experts.state_bytes(shape.dtype).items():
            states[s] = int((params.trainable - experts.total) * getattr(pp, s)) + slice_bytes
    states["weights"] += params.frozen * FROZEN_BYTES          # fp32 in both models, no optimizer state
    states["engine"] += params.frozen * FROZEN_BYTES
    units = fsdp_units(shape.family, cfg, shape.trainer_ep) if shape.dp > 1 else None
    if units is not None:
        states["weights"] += units.gathered_bytes(shape.dtype)
        # FSDP2's reduce-scatter runs in the backward, the expert weights' after it: never at once
        states["grads"] += max(units.grads_in_flight_bytes(shape.dtype),
                               experts.grads_in_flight_bytes(shape.dtype) if experts else 0)
    if shape.engine_tp > 1:     # a tensor-parallel engine: this GPU's shards, not the whole model
        states["engine"] = engine_weight_elements(shape.family, cfg, shape.engine_tp) * b
    return PlanRow(
        shape=shape, params=params, per_param=pp, states=states,
        kv_pool=kv_pool_bytes(cfg, shape.num_pages, shape.page_size, shape.dtype, shape.engine_tp),
        recurrent_state=recurrent_state_bytes(cfg, shape.num_state_slots, shape.gdn_chunk, shape.dtype,
                                              shape.engine_tp, chunk_form=shape.gdn_chunk_form),
        trainer_activations=trainer_activation_bytes(
            cfg, micro_batch_tokens(shape.micro_batch_budget, shape.longest_sequence), b,
            checkpointing=shape.activation_checkpointing),
        engine_activations=engine_activation_bytes(cfg, shape.max_num_batched_tokens, shape.max_num_seqs, b),
        capacity=capacity_bytes, units=units, experts=experts, expert_per_param=expert_pp)
