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

The stock twins (``native.py``) are transformers 5.17's ``experts_implementation="grouped_mm"``
path on every device: a stable sort of the pairs by expert, ``torch._grouped_mm`` for gate_up and
down, a weighted sum of each token's k rows. Router, dispatch and combine never read device data
on the host, nor do the experts where ``torch._grouped_mm`` runs its grouped kernel (CUDA: bf16,
sm90/sm100, aligned operands), so these four declare ``cuda_graph``; an experts call that would
sync (unaligned operands, another dtype on CUDA) refuses to run inside a capture.
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
    grouped_mm_unsupported,
    moe_combine_native,
    moe_dispatch_native,
    moe_experts_native,
    moe_forward_native,
    moe_route_native,
    route_native,
)
from .regions import moe_combine, moe_dispatch, moe_experts, moe_route
from .triton_kernels import experts_forward_triton, grouped_linear
from .router_triton import route_triton, route_triton_supported
from .combine_triton import combine_triton

__all__ = [name for name in dir() if not name.startswith("_")]

# The CPU reference syncs with the host (expert offsets); the sm90 grouped GEMM does not, but no gate
# has captured it in a CUDA graph yet, so the invariant impls do not declare cuda_graph. The stock
# twins have no host sync on their CUDA path (the grouped_mm regions were captured and replayed on
# an H200: tests/kernels/test_moe_regions.py, marked gpu).
_GRAD = frozenset({"grad"})
_GRAD_GRAPH = frozenset({"grad", "cuda_graph"})
IMPLS = (
    Impl("moe_router_fp32", "3", "router", moe_route, capabilities=_GRAD, hazards=("topk_tie",),
         doc="router GEMM with fp32 accumulation and fp32 logits (invariant; the model dtype's exact products, "
             "tensor cores on sm90), float64-evaluated softmax/sigmoid on CPU and one Triton launch with the "
             "device's fp32 exp on sm90, stable selection: ties to the lower expert and group index"),
    Impl("moe_dispatch_stable", "1", "dispatch", moe_dispatch, capabilities=_GRAD,
         doc="(token, slot) pairs sorted by the unique key expert * T + token: expert-major, token-ascending"),
    Impl("moe_experts_loop", "1", "experts", moe_experts, capabilities=_GRAD,
         hazards=("expert_zero_load", "expert_full_load", "skewed_load"),
         doc="per-expert SwiGLU on the invariant GEMM: a Python loop over the experts on CPU, the Triton "
             "grouped GEMM (one launch, the GEMM's fixed 64-wide K order per row) on sm90"),
    Impl("moe_combine_fp32", "1", "combine", moe_combine, capabilities=_GRAD,
         doc="k weighted rows summed in fp32 from +0 in ascending expert index, shared expert last, one rounding"),
    Impl("torch_moe_router", "torch", "router", moe_route_native, capabilities=_GRAD_GRAPH, native=True,
         doc="transformers' router: torch.topk (tie order unspecified)"),
    Impl("torch_moe_dispatch", "grouped_mm", "dispatch", moe_dispatch_native, capabilities=_GRAD_GRAPH, native=True,
         doc="transformers' grouped_mm order: pairs stably sorted by expert id (token-ascending inside an expert), "
             "scatter_add counts, no host sync"),
    Impl("torch_moe_experts", "grouped_mm", "experts", moe_experts_native, capabilities=_GRAD_GRAPH, native=True,
         doc="transformers' grouped_mm experts: torch._grouped_mm for gate_up and down over the expert-sorted rows "
             "(per-expert mm on CPU; the CUTLASS grouped kernel for bf16 on sm90), F.silu(gate) * up between; "
             "unaligned operands fall back to the per-expert F.linear loop"),
    Impl("torch_moe_combine", "grouped_mm", "combine", moe_combine_native, capabilities=_GRAD_GRAPH, native=True,
         doc="rows times their weight, each token's k rows summed by torch.sum and rounded to the model dtype, "
             "shared expert added in that dtype"),
)
