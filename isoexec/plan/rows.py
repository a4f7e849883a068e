"""One row of the plan: a family's run at its parallel sizes, every state in bytes per GPU, the
total against the GPU's memory, and the verdict.

The peak is taken as everything held at once: the persistent states (trainer weights, fp32
masters, Adam moments, the engine's weights, its KV pool and state slots) plus the gradients of a
mini-batch (under FSDP2 the gathered units and the gradient in flight are added to the trainer
weights and the gradients: ``states.FsdpUnits``), plus the larger of the two phases' activations (rollout and training alternate in the
synchronous loop; the gradients are freed between mini-batches, so adding them to the rollout's
activations overstates that phase a little, never the training one).

Building the models comes before all of that and has a peak of its own (``build_bytes``); the
verdict takes the larger of the two. One process builds the trainer's model, the engine's and the
fp32 masters, all within the steady state. A distributed run (``RLRun`` under torchrun, dp > 1)
builds in two phases on every GPU:

1. the trainer: its model whole in the compute dtype, which ``shard_model`` turns into fp32 shards
   one FSDP2 unit at a time (each unit converted to fp32 just before its ``fully_shard``): at a
   unit's ``fully_shard`` the units after it in the compute dtype, the unit whole in fp32 and the
   fp32 shards made so far, its own included; the frozen parameters stay whole in fp32. Under the
   expert-parallel trainer the model the run built stays whole beside the trainer's cut of it
   (this GPU's expert slice and a copy of everything else) until the trainer is built;
2. the engine, only once the trainer is sharded: the trainer's fp32 shards (and the expert slice
   with its fp32 masters) beside the engine's model whole in the compute dtype and, with
   ``engine_tp`` > 1, the shards its tensor-parallel cut clones before the whole copy goes.

AdamW's moments, the KV pool and the state slots come later (the first step, the engine's
constructor): they are in the steady state only.

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
    build_trainer: int = 0        # bytes at the peak of building (and sharding) the trainer
    build_engine: int = 0         # bytes at the peak of building (and cutting) the engine's model

    @property
    def activations(self) -> int:
        return max(self.trainer_activations, self.engine_activations)

    @property
    def total(self) -> int:
        """The steady state's peak: every state held at once, plus the larger phase's activations."""
        return sum(self.states.values()) + self.kv_pool + self.recurrent_state + self.activations

    @property
    def build(self) -> int:
        """The peak while the run builds its models (module docstring)."""
        return max(self.build_trainer, self.build_engine)

    @property
    def peak(self) -> int:
        return max(self.total, self.build)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

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
            return f"fits, {gib(self.capacity - self.peak)} free" + (
                " at the build's peak" if self.build > self.total else "")
        if self.build > self.total:       # building the models is what does not fit
            after = (f"the steady state fits, {gib(self.capacity - self.total)} free" if self.total <= self.capacity
                     else f"the steady state is over by {gib(self.total - self.capacity)}")
            return f"does not fit: building the models is over by {gib(self.build - self.capacity)} ({after})"
        out = f"does not fit: over by {gib(self.total - self.capacity)}"
        s = self.shape
        rest = self.total - self.kv_pool - self.capacity       # over (> 0) or under without the KV pool
        if not self.kv_pool or rest > 0:
            return out + (f" ({gib(rest)} without the KV pool)" if self.kv_pool else "")
        if self.build > self.capacity:    # fewer pages would not shrink the build
            return out + f"; building the models is over too, by {gib(self.build - self.capacity)}"
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
    units = fsdp_units(shape.family, cfg, shape.trainer_ep, shape.reshard_after_forward) if shape.dp > 1 else None
    if units is not None:
        states["weights"] += units.gathered_bytes(shape.dtype)
        # FSDP2's reduce-scatter runs in the backward, the expert weights' after it: never at once
        states["grads"] += max(units.grads_in_flight_bytes(shape.dtype),
                               experts.grads_in_flight_bytes(shape.dtype) if experts else 0)
    engine_whole = states["engine"]
    if shape.engine_tp > 1:     # a tensor-parallel engine: this GPU's shards, not the whole model
        states["engine"] = engine_weight_elements(shape.family, cfg, shape.engine_tp) * b
    build_trainer, build_engine = build_bytes(shape, params, states, units, experts, engine_whole)
    return PlanRow(
        shape=shape, params=params, per_param=pp, states=states,
        kv_pool=kv_pool_bytes(cfg, shape.num_pages, shape.page_size, shape.dtype, shape.engine_tp),
        recurrent_state=recurrent_state_bytes(cfg, shape.num_state_slots, shape.gdn_chunk, shape.dtype,
                                              shape.engine_tp, chunk_form=shape.gdn_chunk_form),
        trainer_activations=trainer_activation_bytes(
            cfg, micro_batch_tokens(shape.micro_batch_budget, shape.longest_sequence), b,
            checkpointing=shape.activation_checkpointing),
        engine_activations=engine_activation_bytes(cfg, shape.max_num_batched_tokens, shape.max_num_seqs, b),
        capacity=capacity_bytes, units=units, experts=experts, expert_per_param=expert_pp,
        build_trainer=build_trainer, build_engine=build_engine)


def build_bytes(shape: RunShape, params: ParamCount, states: dict, units: FsdpUnits | None,
                experts: ExpertSlices | None, engine_whole: int) -> tuple[int, int]:
    """(bytes at the peak of building the trainer, bytes at the peak of building the engine's
    model) on one GPU (module docstring). ``states``: the row's steady states, ``engine_whole`` the
    engine's whole model in bytes."""
    if units is None:    # one process: both models and the fp32 masters, built one after the other
        held = states["weights"] + states["engine"] + states["master"]
        return held, held
    b, dp, frozen = DTYPE_BYTES[shape.dtype], shape.dp, params.frozen * FROZEN_BYTES
    order = units.order
    # the trainer's model as shard_model meets it: beside it, the frozen parameters (fp32, whole);
    # under the expert-parallel trainer this GPU's expert slice and the whole model the run built
    beside = frozen
    if experts is not None:
        beside += experts.slice * b + params.trainable * b + frozen
    trainer = beside + max(b * sum(order[k + 1:]) + 4 * order[k] + 4 * sum(order[:k + 1]) // dp
                           for k in range(len(order)))
    # the trainer sharded (its fp32 shards, frozen parameters, expert slice and its fp32 masters),
    # then the engine's model whole and, at engine_tp > 1, the shards cut from it
    sharded = 4 * sum(order) // dp + frozen + (experts.slice * (b + 4) if experts is not None else 0)
    engine = sharded + engine_whole + (states["engine"] if shape.engine_tp > 1 else 0)
    return trainer, engine
