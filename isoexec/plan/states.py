"""Bytes per parameter that each state of a run holds on one GPU, at the peak of a mini-batch.

Read off what the trainer and the engine keep (not a rule of thumb):

- one process (``isoexec.train.Trainer`` with ``MasterAdamW``, dp = 1): the model's parameters in
  the compute dtype; an fp32 master copy of each trainable one (a clone even when the model is
  fp32); AdamW's two fp32 moments; the gradients: the compute-dtype ``p.grad`` a backward leaves
  and the fp32 master gradient it is accumulated into (both exist until ``accumulate_grads`` has
  moved the last micro-batch's). 2 + 4 + 8 + (2 + 4) = 20 bytes in bf16.
- FSDP2 over dp ranks (``isoexec.dist.fsdp``, dp > 1): the fp32 shards are the masters (4/dp)
  and AdamW's moments are sharded with them (8/dp); during a mini-batch every parameter is gathered
  whole in the compute dtype (the trainer gathers at the model's entry and frees after the
  backward, docs/scale_out.md) and its unsharded gradient is accumulated in fp32 (FSDP2 keeps the
  accumulated gradient in ``reduce_dtype`` when a rank packs several micro-batches: 4, whole),
  then reduce-scattered into an fp32 sharded gradient (4/dp). 2 + 4/dp + 8/dp + (4 + 4/dp).
- the engine (``RLRun.engine_model``): a second model in the compute dtype, whole on every GPU (a
  tensor-parallel engine's shards are counted in ``rows.plan_row``, not per parameter here).

Frozen parameters (``requires_grad=False``: mla_moe's fp32 router correction bias) are fp32 in
both models and have no master, moments or gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
FROZEN_BYTES = 4

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

    @property
    def total(self) -> float:
        return sum(getattr(self, s) for s in STATES)

    @property
    def trainer(self) -> str:
        return "Trainer, one process" if self.dp == 1 else f"FSDP2 over dp = {self.dp}"

    def notes(self) -> dict[str, str]:
        """What each state is, for the table's legend."""
        engine = f"the engine's own model ({self.dtype}), whole on every GPU"
        if self.dp == 1:
            return {"weights": f"the model's parameters ({self.dtype})", "master": "an fp32 copy of each parameter",
                    "adam": "two fp32 moments", "grads": f"p.grad ({self.dtype}) + the fp32 master gradient",
                    "engine": engine}
        return {"weights": f"every parameter gathered whole ({self.dtype}) for the mini-batch",
                "master": f"the fp32 shards (4 / {self.dp})", "adam": f"two fp32 moments, sharded (8 / {self.dp})",
                "grads": f"the unsharded fp32 accumulation (4) + the fp32 sharded gradient (4 / {self.dp})",
                "engine": engine}


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
    return BytesPerParam(dtype, dp, weights=b, master=4 / dp, adam=8 / dp, grads=4 + 4 / dp, engine=b)
