"""Batch-invariant mixture-of-experts layer (router, dispatch, experts, combine); the experts have a
Triton twin (grouped GEMM, ``triton_kernels.py``), the other regions are torch on every device.

Besides the usual files (``isoexec_kernels/__init__.py``): ``types.py`` (router kinds, weights,
routing and dispatch records) and ``regions.py`` (the layer cut into the regions a contract binds:
router, dispatch, experts, combine).

``IMPLS`` (at the end): the invariant implementation and the stock twin of each of the four
regions. Router, dispatch and combine are the torch reference on every arch (their GEMMs the
Triton ``linear`` on sm90). The ``experts`` region (impl id ``moe_experts_loop``, kept so the
compositions keep their meaning) runs the reference per-expert loop on the CPU and the Triton
grouped GEMM on sm90 (one launch per projection, no host sync); its ``cuda_graph`` capability is
not declared until the GPU gates have run it under capture.
"""

from ..impl import Impl
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
from .native import (
    moe_combine_native,
    moe_dispatch_native,
    moe_experts_native,
    moe_forward_native,
    moe_route_native,
    route_native,
)
from .regions import moe_combine, moe_dispatch, moe_experts, moe_route
from .triton_kernels import experts_forward_triton, grouped_linear

__all__ = [name for name in dir() if not name.startswith("_")]

# The CPU reference syncs with the host (expert offsets); the sm90 grouped GEMM does not, but no gate
# has captured it in a CUDA graph yet, so no impl here declares cuda_graph.
_GRAD = frozenset({"grad"})
IMPLS = (
    Impl("moe_router_fp32", "1", "router", moe_route, capabilities=_GRAD, hazards=("topk_tie",),
         doc="fp32 router GEMM (invariant), float64-evaluated softmax/sigmoid, stable sort: ties to the lower "
             "expert and group index"),
    Impl("moe_dispatch_stable", "1", "dispatch", moe_dispatch, capabilities=_GRAD,
         doc="(token, slot) pairs sorted by the unique key expert * T + token: expert-major, token-ascending"),
    Impl("moe_experts_loop", "1", "experts", moe_experts, capabilities=_GRAD,
         hazards=("expert_zero_load", "expert_full_load", "skewed_load"),
         doc="per-expert SwiGLU on the invariant GEMM: a Python loop over the experts on CPU, the Triton "
             "grouped GEMM (one launch, the GEMM's fixed 64-wide K order per row) on sm90"),
    Impl("moe_combine_fp32", "1", "combine", moe_combine, capabilities=_GRAD,
         doc="k weighted rows summed in fp32 from +0 in ascending expert index, shared expert last, one rounding"),
    Impl("torch_moe_router", "torch", "router", moe_route_native, capabilities=_GRAD, native=True,
         doc="transformers' router: torch.topk (tie order unspecified)"),
    Impl("torch_moe_dispatch", "torch", "dispatch", moe_dispatch_native, capabilities=_GRAD, native=True,
         doc="transformers' one_hot / torch.where order"),
    Impl("torch_moe_experts", "torch", "experts", moe_experts_native, capabilities=_GRAD, native=True,
         doc="eager expert loop: F.linear per expert on its rows (BLAS blocking follows the load)"),
    Impl("torch_moe_combine", "torch", "combine", moe_combine_native, capabilities=_GRAD, native=True,
         doc="weighted rows rounded to the model dtype, index_add_ per expert, shared expert added in that dtype"),
)
