"""Batch-invariant mixture-of-experts layer (router, dispatch, experts, combine); no Triton twin yet.

Besides the usual files (``isoexec_kernels/__init__.py``): ``types.py`` (router kinds, weights,
routing and dispatch records).

No ``IMPLS`` yet: no model family the compositions cover runs an MoE layer, so the registry has
no MoE implementation to bind.
"""

from .api import moe_forward
from .types import (
    ROUTER_KINDS,
    ROUTER_SIGMOID_GROUP_TOPK,
    ROUTER_SOFTMAX_TOPK,
    Dispatch,
    MoEWeights,
    RouterSpec,
    Routing,
)
from .reference import (
    combine,
    dispatch,
    experts_forward,
    moe_forward_reference,
    route,
    router_logits,
    shared_expert_forward,
)
from .native import moe_forward_native, route_native

__all__ = [name for name in dir() if not name.startswith("_")]
