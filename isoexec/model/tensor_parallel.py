"""Which tensor-parallel model serves a family, and what one of its ranks holds.

One table for every caller that cuts a model over a tp group: the topology gates, the RL run's
sharded engine (``engine_tp``) and the memory plan. A family without a row has no tensor-parallel
model; its ``tp_problems`` refuses tp > 1 before anyone gets here. ``tp_serving_problems`` is what
the tensor-parallel models refuse at a size, before anything is cut: the model's ``tp_problems``,
or under a tp claim of kind ``variant`` (``native_tp4``) its shape checks with the stock kernels
allowed; a caller that checks a size without cutting (the memory plan) asks it the same question.
"""

from __future__ import annotations

from . import tp_dense, tp_hybrid, tp_moe
from .tp_dense import tp_serving_problems

#: family -> (its tensor-parallel model class, its ``cut_parameter(cfg, tp, rank, name, full)``);
#: the MoE families' cut deals the routed experts out whole (``expert_shard_range``) and keeps the
#: router, correction bias and shared expert whole on every rank (tp_moe.py)
TENSOR_PARALLEL = {"dense": (tp_dense.TensorParallelDense, tp_dense.cut_parameter),
                   "hybrid": (tp_hybrid.TensorParallelHybrid, tp_hybrid.cut_parameter),
                   "mla_moe": (tp_moe.TensorParallelMlaMoe, tp_moe.cut_parameter_mla_moe),
                   "hybrid_moe": (tp_moe.TensorParallelHybridMoe, tp_moe.cut_parameter_hybrid_moe)}


def _row(family: str):
    if family not in TENSOR_PARALLEL:
        raise ValueError(f"the {family} family has no tensor-parallel model (have: {', '.join(TENSOR_PARALLEL)})")
    return TENSOR_PARALLEL[family]


def tensor_parallel(model, group=None):
    """``model`` (a contract installed) cut over ``group``: this rank's tensor-parallel model.
    Its constructor checks the topology against the contract before it cuts anything."""
    return _row(model.family)[0](model, group)


def rank_parameter_count(model, tp: int, rank: int) -> int:
    """Elements of the parameters rank ``rank`` of ``tp`` holds of ``model`` (``meta`` is enough)."""
    cut = _row(model.family)[1]
    return sum(cut(model.cfg, tp, rank, n, p).numel() for n, p in model.named_parameters())


__all__ = ["TENSOR_PARALLEL", "rank_parameter_count", "tensor_parallel", "tp_serving_problems"]
