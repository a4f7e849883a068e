"""The MoE layer as the four regions a contract binds (ops ``router``, ``dispatch``, ``experts``,
``combine``; the shared expert runs through the ``shared_*`` linear and activation regions).

The invariant implementations are the reference building blocks of ``reference.py`` (rounding
schedule: ``api.py``) with the public ``linear`` and ``silu_and_mul`` kernels, so that autograd
runs their designed backwards (the selection itself has no gradient; the routing weights do,
through the fp32 router GEMM and the sigmoid / softmax). On CUDA the routing after the logits is
one Triton launch (``router_triton.py``: fp32 device exp instead of the reference's float64, its
own schedule) and the combine another (``combine_triton.py``: the reference's operations, the
same bits). The ``experts`` region
runs, on CUDA, the Triton grouped GEMM (``triton_kernels.experts_forward_triton``: grouped GEMM,
``silu_and_mul``, grouped GEMM; no host sync, its own deterministic backward), and elsewhere the
per-expert Python loop of the reference (one K order per row whatever the expert's load in both;
``api.py`` step 4), or, without autograd, that loop's bits with all experts in one pass
(``reference.experts_forward_grouped``).

Signatures (the stock twins in ``native.py`` take the same):
  router(x [T, H], weight [E, H], spec: RouterSpec, correction_bias=None [E] fp32,
         shared_gate=None [1, H]) -> Routing (ids [T, k], weights [T, k], shared_gate [T, 1] | None)
  dispatch(ids [T, k], num_experts) -> Dispatch
  experts(x [T, H], disp, gate_up [E, 2I, H], down [E, H, I]) -> rows [T*k, H] in dispatch order
  combine(rows, disp, routing, shared=None [T, H], out_dtype=None) -> [T, H]
"""

from __future__ import annotations

import torch

from .._triton_util import want_triton
from ..activation import silu_and_mul
from ..gemm import linear
from .combine_triton import combine_triton
from .reference import (_sigmoid_fp32, combine, dispatch, experts_forward, experts_forward_grouped, fp32_linear, route,
                        router_logits)
from .router_triton import route_triton, route_triton_supported
from .triton_kernels import experts_forward_triton
from .types import Dispatch, RouterSpec, Routing


def moe_route(x: torch.Tensor, weight: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None,
              shared_gate: torch.Tensor | None = None) -> Routing:
    """Region ``router``: fp32 logits through the invariant GEMM (the model dtype's products,
    fp32 accumulator unrounded: :func:`reference.fp32_linear`), then :func:`reference.route`
    (ties to the lower expert / group index); with ``shared_gate`` [1, H] (Qwen), also the
    shared expert's fp32 gate sigmoid(fp32_linear(x, shared_gate)) [T, 1]."""
    spec.check(weight.shape[0])
    logits = router_logits(x, weight, linear)
    gate_logit = None if shared_gate is None else fp32_linear(x, shared_gate, linear)
    if want_triton(x) and route_triton_supported(spec, weight.shape[0]):
        # CUDA: one launch after the GEMMs (router_triton.py: fp32 device exp, no float64)
        ids, w, g = route_triton(logits, spec, correction_bias, gate_logit)
        return Routing(ids=ids, weights=w, shared_gate=g)
    r = route(logits, spec, correction_bias)
    if gate_logit is not None:
        r.shared_gate = _sigmoid_fp32(gate_logit)
    return r


def moe_dispatch(ids: torch.Tensor, num_experts: int) -> Dispatch:
    """Region ``dispatch``: (token, slot) pairs expert-major, token-ascending (integers only)."""
    return dispatch(ids, num_experts)


def moe_experts(x: torch.Tensor, disp: Dispatch, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Region ``experts``: each expert's SwiGLU on the rows it owns (invariant GEMM, position-free
    activation): a row's output does not depend on how many rows its expert received. CUDA: the
    Triton grouped GEMM; elsewhere the reference loop (with autograd) or its bits in one pass.
    Under autograd the stacked weights get a whole gradient in every backward, zeros for an idle
    expert, and zeros for both when no row was dispatched (``reference.no_rows`` on the loop, the
    Triton backward's own zeros)."""
    if want_triton(x):
        return experts_forward_triton(x, disp, gate_up, down)
    if not (torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad or down.requires_grad)):
        # no autograd: the reference loop's bits with all experts in one pass
        return experts_forward_grouped(x, disp, gate_up, down)
    return experts_forward(x, disp, gate_up, down, linear, silu_and_mul)


def moe_combine(rows: torch.Tensor, disp: Dispatch, routing: Routing, shared: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Region ``combine``: per token, the k weighted rows in fp32 from +0 in ascending expert
    index, then the (gated) shared expert, one rounding. CUDA: the same operations in one Triton
    launch (combine_triton.py, the same bits)."""
    if want_triton(rows):
        return combine_triton(rows, disp, routing, shared, routing.shared_gate, out_dtype)
    return combine(rows, disp, routing, shared, routing.shared_gate, out_dtype)
