"""Batch-invariant mixture-of-experts layer (router, dispatch, experts, combine); no Triton twin yet.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``native.py`` (the stock twin), ``types.py`` (router
kinds, weights, routing and dispatch records).

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

__all__ = [
    "moe_forward",
    "ROUTER_KINDS",
    "ROUTER_SIGMOID_GROUP_TOPK",
    "ROUTER_SOFTMAX_TOPK",
    "Dispatch",
    "MoEWeights",
    "RouterSpec",
    "Routing",
    "combine",
    "dispatch",
    "experts_forward",
    "moe_forward_reference",
    "route",
    "router_logits",
    "shared_expert_forward",
    "moe_forward_native",
    "route_native",
]
