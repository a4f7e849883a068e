"""The mixture-of-experts layer: the fixed-order torch twin (runs on any device; the CPU path of the
public API). The rounding schedule is the docstring of ``api.py`` in this folder. Each building
block (router, dispatch, experts, combine) is usable alone."""

from __future__ import annotations

import torch

from .. import _ref
from .._empty import no_token
from ..activation.reference import silu_and_mul_reference
from ..gemm.reference import grouped_linear_reference, linear_reference
from .types import Dispatch, MoEWeights, ROUTER_SOFTMAX_TOPK, RouterSpec, Routing


_NORM_EPS_SIGMOID = 1e-20  # transformers' DeepSeek-V3 / GLM-4 denominator guard


def router_logits(x: torch.Tensor, router_weight: torch.Tensor, linear=linear_reference) -> torch.Tensor:
    """fp32 [T, E] logits = lin(x, router_weight) with fp32 output: the exact products of the
    inputs' values accumulated in fp32, never rounded to the model dtype (api.py step 1); x [T, H].
    A row's logits are a function of that row only (the GEMM's schedule)."""
    return fp32_linear(x, router_weight, linear)


def fp32_linear(x: torch.Tensor, w: torch.Tensor, linear=linear_reference) -> torch.Tensor:
    """``lin(x, w)`` with fp32 output. Same dtypes: the GEMM of the inputs as they are, its fp32
    accumulator returned unrounded (for bf16/fp16 values the reference gives exactly
    ``lin(fp32(x), fp32(w))``: the products are exact in fp32; on the GPU it runs at the 16-bit
    GEMM's speed on tensor cores instead of an fp32 FMA chain). Different dtypes (an fp32 router
    in a bf16 model): both cast to fp32."""
    if x.dtype == w.dtype:
        return linear(x, w, out_dtype=torch.float32)
    return linear(x.float(), w.float())


def _sigmoid_fp32(z: torch.Tensor) -> torch.Tensor:
    """fp32(1 / (1 + exp(-z))) from float64 basic operations (position-free)."""
    return (1.0 / (1.0 + _ref.exp64(-z.double()))).float()


def _desc_order(v: torch.Tensor) -> torch.Tensor:
    """Indices of the last dim sorted by value descending, equal values by ascending index."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices


def _sum_left_to_right(w: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, ((+0 + w_0) + w_1) + ..., fp32."""
    acc = torch.zeros(w.shape[:-1], dtype=torch.float32, device=w.device)
    for j in range(w.shape[-1]):
        acc = acc + w[..., j]
    return acc


def _softmax_fp32(z: torch.Tensor) -> torch.Tensor:
    m = z.max(dim=-1, keepdim=True).values + 0.0
    e = _ref.exp64((z - m).double()).float()
    s = _ref.tree_sum0(e.t().contiguous())  # halves tree over the experts: a function of E only
    return e / s[:, None]


def route(logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None) -> Routing:
    """Expert choice and weights of each row of fp32 ``logits [T, E]`` (api.py's docstring, step 2).
    Every row is handled on its own: nothing here reduces across rows."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"moe.route: logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    T, E = logits.shape
    spec.check(E)
    k = spec.top_k
    if spec.kind == ROUTER_SOFTMAX_TOPK:
        if correction_bias is not None:
            raise ValueError("moe.route: the softmax_topk router takes no correction bias")
        p = _softmax_fp32(logits)
        chosen = _desc_order(p)[:, :k]
        ids = torch.sort(chosen, dim=-1).values
        w = p.gather(1, ids)
        if spec.norm_topk_prob:
            w = w / _sum_left_to_right(w)[:, None]
        return Routing(ids=ids, weights=w)

    s = _sigmoid_fp32(logits)
    b = s if correction_bias is None else s + correction_bias.float()
    size = E // spec.n_group
    bg = b.view(T, spec.n_group, size)
    top2 = bg.gather(2, _desc_order(bg)[:, :, :2])
    group_score = top2[:, :, 0] + top2[:, :, 1]
    kept = _desc_order(group_score)[:, :spec.topk_group]
    keep = torch.zeros(T, spec.n_group, dtype=torch.bool, device=logits.device)
    keep.scatter_(1, kept, True)
    keep = keep[:, :, None].expand(T, spec.n_group, size).reshape(T, E)
    b = b.masked_fill(~keep, float("-inf"))
    chosen = _desc_order(b)[:, :k]
    ids = torch.sort(chosen, dim=-1).values
    w = s.gather(1, ids)
    if spec.norm_topk_prob:
        w = w / (_sum_left_to_right(w) + _NORM_EPS_SIGMOID)[:, None]
    w = w * float(spec.routed_scaling_factor)
    return Routing(ids=ids, weights=w)


def dispatch(ids: torch.Tensor, num_experts: int) -> Dispatch:
    """Sort the (token, slot) pairs of ``ids [T, k]`` expert-major, token-ascending. The sort key
    expert * T + token is unique, so the order does not depend on the sort algorithm."""
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    tok = torch.arange(T, device=ids.device).repeat_interleave(k)
    return dispatch_in_order(flat, torch.argsort(flat * T + tok), T, k, num_experts)


def dispatch_in_order(flat: torch.Tensor, order: torch.Tensor, T: int, k: int, num_experts: int) -> Dispatch:
    """The Dispatch record of the pairs ``t*k + j`` (expert ids ``flat`` [T*k]) listed in ``order``
    (an expert-major permutation of them): tokens, per-expert offsets and the inverse permutation.
    No host sync."""
    # scatter_add, not bincount: bincount on CUDA reads its input's max on the host, which a
    # captured decode graph forbids; integer adds are exact in any order
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    row_of_pair = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=flat.device))
    return Dispatch(token=torch.div(order, k, rounding_mode="floor"), offsets=offsets, row_of_pair=row_of_pair,
                    num_tokens=T, top_k=k)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, linear, act) -> torch.Tensor:
    return linear(act(linear(x, gate_up)), down)


def no_rows(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The expert output rows [0, H] (x's dtype) of a dispatch with no row (a batch of no token),
    differentiable: the stacked weights get a zero gradient, not none, as they get zeros for every
    idle expert when some expert has rows. So a backward of no token gives every parameter of the
    layer a gradient, as a backward of tokens does: the FSDP2 trainer's lockstep empty passes rely
    on it (isoexec/dist/fsdp/shard.py). Every experts region returns this for no rows: the shared
    ``_empty.no_token`` with the experts' inputs."""
    return no_token((0, x.shape[-1]), x.dtype, x, gate_up, down)


def experts_forward(x: torch.Tensor, disp: Dispatch, gate_up: torch.Tensor, down: torch.Tensor,
                    linear=linear_reference, act=silu_and_mul_reference) -> torch.Tensor:
    """Expert output rows [T*k, H] in dispatch order (x's dtype): each expert's SwiGLU on the rows
    it owns (api.py's docstring, step 4). Experts with no rows are skipped: their slices of the
    stacked weights' gradients are zeros (each expert's weight is an index of the stacked one).
    No row at all: :func:`no_rows`."""
    if disp.token.numel() == 0:
        return no_rows(x, gate_up, down)
    out = torch.empty((disp.token.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
    offs = disp.offsets.tolist()
    for e in range(len(offs) - 1):
        r0, r1 = offs[e], offs[e + 1]
        if r1 > r0:
            out[r0:r1] = _swiglu(x[disp.token[r0:r1]], gate_up[e], down[e], linear, act)
    return out


def experts_forward_grouped(x: torch.Tensor, disp: Dispatch, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """:func:`experts_forward` with the invariant linear and SwiGLU of the CPU path (the public
    ``linear`` and ``silu_and_mul`` on CPU tensors without autograd), all experts' rows in one
    pass: :func:`gemm.reference.grouped_linear_reference` (each row against its expert's weight,
    the bits of the per-expert linear), the activation on all rows at once (elementwise, float64
    basic operations), the second grouped linear. Rows never mix, so each row gets the bits of the
    per-expert loop, except where two NaNs meet in a product: which NaN comes out can depend on
    the element's position in the tensor (a vector body and a scalar tail differ), so an expert
    with a NaN in an output row is made again by the loop, as it was before."""
    out = torch.empty((disp.token.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
    offs = disp.offsets.tolist()
    E = len(offs) - 1
    R = offs[-1]
    if R == 0:
        return out
    counts = torch.tensor([offs[e + 1] - offs[e] for e in range(E)], device=x.device)
    expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts)
    h = grouped_linear_reference(x[disp.token[:R]], gate_up, expert)
    y = grouped_linear_reference(silu_and_mul_reference(h), down, expert)
    out[:R] = y
    nan_rows = torch.isnan(y).any(1)
    if bool(nan_rows.any()):
        for e in torch.unique(expert[nan_rows]).tolist():
            r0, r1 = offs[e], offs[e + 1]
            out[r0:r1] = _swiglu(x[disp.token[r0:r1]], gate_up[e], down[e], linear_reference, silu_and_mul_reference)
    return out


def shared_expert_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          gate: torch.Tensor | None = None, linear=linear_reference,
                          act=silu_and_mul_reference):
    """(shared expert rows [T, H] in x's dtype, fp32 sigmoid gate [T, 1] or None)."""
    ys = _swiglu(x, gate_up, down, linear, act)
    g = None if gate is None else _sigmoid_fp32(fp32_linear(x, gate, linear))
    return ys, g


def combine(expert_rows: torch.Tensor, disp: Dispatch, routing: Routing,
            shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each token's k weighted expert rows summed in fp32 in ascending expert index from +0, then
    the (gated) shared expert, one rounding (api.py's docstring, step 6)."""
    T, k = disp.num_tokens, disp.top_k
    H = expert_rows.shape[-1]
    y = expert_rows[disp.row_of_pair].view(T, k, H)  # slot order = ascending expert index
    acc = torch.zeros((T, H), dtype=torch.float32, device=expert_rows.device)
    w = routing.weights
    for j in range(k):
        acc = acc + w[:, j:j + 1] * y[:, j].float()
    if shared is not None:
        acc = acc + (shared.float() if shared_gate is None else shared_gate * shared.float())
    return acc.to(out_dtype or expert_rows.dtype)


def _spec(kind, top_k, norm_topk_prob, n_group, topk_group, routed_scaling_factor) -> RouterSpec:
    return RouterSpec(kind=kind, top_k=top_k, norm_topk_prob=norm_topk_prob, n_group=n_group,
                      topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)


def _forward(x, weights: MoEWeights, spec: RouterSpec, linear, act, experts=None):
    """The layer from its building blocks; ``experts(x, disp, gate_up, down)`` replaces the
    expert loop when given (the Triton grouped GEMM on CUDA, ``api.moe_forward``)."""
    H = x.shape[-1]
    weights.check(H)
    spec.check(weights.num_experts)
    x2 = x.reshape(-1, H)
    routing = route(router_logits(x2, weights.router, linear), spec, weights.correction_bias)
    disp = dispatch(routing.ids, weights.num_experts)
    gate_up, down = weights.gate_up.to(x.dtype), weights.down.to(x.dtype)
    if experts is None:
        rows = experts_forward(x2, disp, gate_up, down, linear, act)
    else:
        rows = experts(x2, disp, gate_up, down)
    shared = gate = None
    if weights.shared_gate_up is not None:
        shared, gate = shared_expert_forward(x2, weights.shared_gate_up.to(x.dtype),
                                             weights.shared_down.to(x.dtype), weights.shared_gate,
                                             linear, act)
    return combine(rows, disp, routing, shared, gate, x.dtype).reshape(x.shape)


def moe_forward_reference(x: torch.Tensor, weights: MoEWeights, *, kind: str, top_k: int,
                          norm_topk_prob: bool = True, n_group: int = 1, topk_group: int = 1,
                          routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """MoE layer output [..., H] in x's dtype for ``x [..., H]`` by the reference schedule (module
    docstring). Expert weights are used in x's dtype; router and shared gate in fp32."""
    spec = _spec(kind, top_k, norm_topk_prob, n_group, topk_group, routed_scaling_factor)
    return _forward(x, weights, spec, linear_reference, silu_and_mul_reference)
