"""Bytes per parameter that each state of a run holds on one GPU, at the peak of a mini-batch.

Read off what the trainer and the engine keep (not a rule of thumb):

- one process (``isoexec.train.Trainer`` with ``MasterAdamW``, dp = 1): the model's parameters in
  the compute dtype; an fp32 master copy of each trainable one (a clone even when the model is
  fp32); AdamW's two fp32 moments; the gradients: the compute-dtype ``p.grad`` a backward leaves
  and the fp32 master gradient it is accumulated into (both exist until ``accumulate_grads`` has
  moved the last micro-batch's). 2 + 4 + 8 + (2 + 4) = 20 bytes in bf16.
- FSDP2 over dp ranks (``isoexec.dist.fsdp``, dp > 1): per parameter, the fp32 shards are the
  masters (4/dp), AdamW's moments are sharded with them (8/dp), and so is the fp32 gradient that
  every micro-batch's reduce-scatter adds into (4/dp); there is no whole copy. On top, per model
  (``fsdp_units``: the units ``shard_model`` makes, one per decoder layer and the root with the
  embedding, the final norm and lm_head):
  - trainer weights, the gathered units in the compute dtype: the root, gathered from a pass's
    entry through its backward, and ``GATHERED_LAYERS`` layers: a layer is gathered for its
    forward and freed after it, gathered again for its backward and freed after it; FSDP2 gathers
    the layer before it during a layer's backward (its default backward prefetch), and on a GPU
    may issue the next layer's all-gather while one computes, so two at a time. With
    ``train.reshard_after_forward: false`` a layer stays gathered from its forward to its backward:
    at the forward's end every layer is (``FsdpUnits.layers``);
  - gradients in flight, ``REDUCE_BYTES`` per element of the unit being reduced: its
    compute-dtype gradient is copied into the fp32 reduce-scatter input (b + 4), then that input
    and the receive buffer of the rank-order sum (``RankOrderReduceScatter``'s all_to_all) are
    alive at once (4 + 4); meanwhile the root's compute-dtype gradient (lm_head's from the
    backward's start) waits for the root's reduce-scatter, which comes last.
- the engine (``RLRun.engine_model``): a second model in the compute dtype, whole on every GPU (a
  tensor-parallel engine's shards are counted in ``rows.plan_row``, not per parameter here).
- the expert-parallel trainer (``rl.settings.trainer_ep: e`` > 1, the MoE families): every
  parameter but the routed experts is FSDP2-sharded over all N GPUs as above (dp = N); the routed
  experts leave FSDP2 and each GPU holds its slice of them whole, ``1 / e`` of the experts when e
  divides E: compute-dtype weights, fp32 masters, two fp32 moments, and a slice-sized ``p.grad`` plus
  fp32 master gradient (``expert_bytes_per_param``; the exact slice and what is in flight:
  ``expert_slices``). The FSDP2 units then hold no expert (``fsdp_units(..., trainer_ep)``).

Frozen parameters (``requires_grad=False``: mla_moe's fp32 router correction bias) are fp32 in
both models and have no master, moments or gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import FAMILY_MODELS
from ..model.ep_moe import is_expert_weight

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
FROZEN_BYTES = 4
#: decoder layers gathered at once under FSDP2: the one running and the one prefetched
GATHERED_LAYERS = 2
#: bytes per element of a unit while its gradient is reduce-scattered (module docstring)
REDUCE_BYTES = 8

STATES = ("weights", "master", "adam", "grads", "engine")
STATE_LABELS = {"weights": "trainer weights", "master": "fp32 master", "adam": "Adam m+v (fp32)",
                "grads": "gradients", "engine": "engine weights"}


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per trainable parameter on one GPU, per state."""

    dtype: str
    dp: int
    weights: float
    master: float
    adam: float
    grads: float
    engine: float
    ep: int = 1                   # > 1: the routed experts' layout under the expert-parallel trainer

    @property
    def total(self) -> float:
        return sum(getattr(self, s) for s in STATES)

    @property
    def trainer(self) -> str:
        if self.ep > 1:
            return f"routed experts, trainer_ep = {self.ep} of {self.dp} GPUs"
        return "Trainer, one process" if self.dp == 1 else f"FSDP2 over dp = {self.dp}"

    def notes(self) -> dict[str, str]:
        """What each state is, for the table's legend."""
        engine = f"the engine's own model ({self.dtype}), whole on every GPU"
        if self.ep > 1:
            b, e = DTYPE_BYTES[self.dtype], self.ep
            return {"weights": f"this GPU's slice of the experts ({self.dtype}, {b} / {e}), held whole: not "
                               "in FSDP2, never gathered",
                    "master": f"the slice's fp32 masters (4 / {e}, ExpertParallelAdamW)",
                    "adam": f"two fp32 moments of the slice (8 / {e})",
                    "grads": f"the slice's p.grad ({self.dtype}) + its fp32 master gradient (({b} + 4) / {e}); "
                             "per row, one expert weight's in flight",
                    "engine": engine}
        if self.dp == 1:
            return {"weights": f"the model's parameters ({self.dtype})", "master": "an fp32 copy of each parameter",
                    "adam": "two fp32 moments", "grads": f"p.grad ({self.dtype}) + the fp32 master gradient",
                    "engine": engine}
        return {"weights": f"no whole copy: the fp32 shards (next row) are the weights; per row, the root and "
                           f"{GATHERED_LAYERS} layers gathered ({self.dtype}; every layer with reshard_after_forward false)",
                "master": f"the fp32 shards (4 / {self.dp})", "adam": f"two fp32 moments, sharded (8 / {self.dp})",
                "grads": f"the fp32 sharded gradient (4 / {self.dp}); per row, one unit's gradient in flight",
                "engine": engine}


def expert_slice_bytes_per_element(dtype: str) -> dict[str, float]:
    """Bytes per element of the expert-parallel trainer's expert slice, per trainer state: the
    compute-dtype weights, an fp32 master, two fp32 moments, and the compute-dtype ``p.grad`` beside
    the fp32 master gradient (``expert_slices`` module docstring)."""
    b = DTYPE_BYTES[dtype]
    return {"weights": b, "master": 4, "adam": 8, "grads": b + 4}


def expert_bytes_per_param(dtype: str, dp: int, ep: int) -> BytesPerParam:
    """Bytes per routed-expert parameter of the model on one GPU with the trainer's experts over
    ``ep`` of ``dp`` GPUs: the slice's bytes per element over ``ep`` (exact when ``ep`` divides the
    experts; the rows count the largest rank's slice exactly)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: the trainer computes in {' or '.join(DTYPE_BYTES)}")
    if not 1 < ep <= dp:
        raise ValueError(f"trainer_ep {ep}: the expert layout needs 1 < ep <= dp ({dp})")
    per = expert_slice_bytes_per_element(dtype)
    return BytesPerParam(dtype, dp, **{s: v / ep for s, v in per.items()}, engine=DTYPE_BYTES[dtype], ep=ep)


def bytes_per_param(dtype: str, dp: int) -> BytesPerParam:
    """The per-GPU bytes of each state for a model computing in ``dtype`` with its trainer over
    ``dp`` GPUs (1: one process)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: the trainer computes in {' or '.join(DTYPE_BYTES)}")
    if dp < 1:
        raise ValueError(f"dp {dp} must be >= 1")
    b = DTYPE_BYTES[dtype]
    if dp == 1:
        return BytesPerParam(dtype, 1, weights=b, master=4, adam=8, grads=b + 4, engine=b)
    return BytesPerParam(dtype, dp, weights=0, master=4 / dp, adam=8 / dp, grads=4 / dp, engine=b)


@dataclass(frozen=True)
class FsdpUnits:
    """Parameter elements of the FSDP2 units ``isoexec.dist.fsdp.shard_model`` makes of a model:
    the root (every parameter outside ``model.layers``: embedding, final norm, an untied lm_head),
    the largest decoder layer and all the layers together; and whether the layers are freed after
    their forward (``TrainConfig.reshard_after_forward``)."""

    root: int
    layer: int
    layers: int = 0
    reshard_after_forward: bool = True
    #: elements the trainer's FSDP2 manages in each unit, in the order ``shard_model`` shards them
    #: (the layers in order, then the root), without what it leaves out (frozen parameters; the
    #: routed experts under the expert-parallel trainer): what building the trainer walks through
    order: tuple[int, ...] = ()

    def gathered_bytes(self, dtype: str) -> int:
        """Trainer weights under FSDP2: the root and ``GATHERED_LAYERS`` layers in ``dtype``, or the
        root and every layer when the layers stay gathered from their forward to their backward."""
        held = GATHERED_LAYERS * self.layer if self.reshard_after_forward else self.layers
        return DTYPE_BYTES[dtype] * (self.root + held)

    def grads_in_flight_bytes(self, dtype: str) -> int:
        """Gradients beyond the fp32 shards: a layer's reduce-scatter while the root's gradient
        waits, or the root's own reduce-scatter at the backward's end, whichever is larger."""
        b = DTYPE_BYTES[dtype]
        return max(b * self.root + REDUCE_BYTES * self.layer, REDUCE_BYTES * self.root)


def fsdp_units(family: str, cfg, trainer_ep: int = 1, reshard_after_forward: bool = True) -> FsdpUnits:
    """The units of ``family``'s model built from ``cfg``, counted on the ``meta`` device (no
    memory): the same modules ``shard_model`` shards, so a change to a layer changes the plan.
    With ``trainer_ep`` > 1 the parameters ``ExpertParallelTrainer`` leaves out of FSDP2 are not in
    them: the routed-expert slices and the frozen ones (its ``ignored``)."""
    model = FAMILY_MODELS[family][0](cfg, device="meta")

    def managed(named) -> int:
        return sum(p.numel() for n, p in named
                   if trainer_ep == 1 or (p.requires_grad and not is_expert_weight(n)))

    def sharded(named) -> int:     # what the trainers hand FSDP2: never the frozen ones
        return sum(p.numel() for n, p in named
                   if p.requires_grad and (trainer_ep == 1 or not is_expert_weight(n)))

    layers = {id(p) for p in model.layers.parameters()}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in layers]
    per_layer = [managed(L.named_parameters()) for L in model.layers]
    return FsdpUnits(root=managed(root), layer=max(per_layer), layers=sum(per_layer),
                     reshard_after_forward=reshard_after_forward,
                     order=(*(sharded(L.named_parameters()) for L in model.layers), sharded(root)))
