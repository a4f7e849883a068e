"""Stock MoE twin: the mixture-of-experts layer written the way transformers 5.17 computes it.

Same arguments as ``moe.moe_forward``. It is the native composition's MoE and the negative
control: no promise about the bits of a token when the batch changes.

  router (softmax_topk, ``Qwen3MoeTopKRouter``): logits = F.linear in x's dtype; softmax in fp32;
    ``torch.topk`` (tie order unspecified); optional renormalisation by ``torch.sum`` in top-k
    order; weights rounded to x's dtype.
  router (sigmoid_group_topk, ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter``): fp32 F.linear;
    ``torch.sigmoid``; correction bias for selection; group score = sum of the group's top-2;
    ``torch.topk`` for groups and experts; weights normalised by ``torch.sum`` + 1e-20, times
    ``routed_scaling_factor``.
  experts (the eager ``*Experts.forward``): for each expert hit, in ascending expert index, the
    tokens that chose it are gathered and run through F.linear (gate_up), F.silu(gate) * up (two
    roundings), F.linear (down), multiplied by their weight, rounded to x's dtype and
    ``index_add_``-ed into an x-dtype buffer. Each expert's GEMMs see as many rows as the expert
    received, so stock BLAS blocking (and the position of an element in the SIMD loops of
    ``F.silu``) can change a token's bits with the batch.
  (transformers can swap in other expert implementations through ``experts_implementation``;
  this twin is the eager one, which a config built in code gets.)
  shared expert: F.linear(gate), F.linear(up) as two products, F.silu(gate) * up, F.linear(down);
    Qwen-style gate: ``F.sigmoid(F.linear(x, shared_gate)) * shared`` in x's dtype; added to the
    routed sum in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .types import MoEWeights, ROUTER_SIGMOID_GROUP_TOPK, ROUTER_SOFTMAX_TOPK, RouterSpec


def route_native(x: torch.Tensor, weights: MoEWeights, spec: RouterSpec):
    """(top-k weights [T, k], top-k expert ids [T, k]) as transformers' routers compute them."""
    return _route_native(x, weights.router, weights.correction_bias, spec)


def _route_native(x: torch.Tensor, router: torch.Tensor, correction_bias: torch.Tensor | None, spec: RouterSpec):
    if spec.kind == ROUTER_SOFTMAX_TOPK:
        logits = F.linear(x, router.to(x.dtype))
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        top_v, top_i = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            top_v = top_v / top_v.sum(dim=-1, keepdim=True)
        return top_v.to(logits.dtype), top_i
    if spec.kind != ROUTER_SIGMOID_GROUP_TOPK:
        raise ValueError(f"moe_native: unknown router kind {spec.kind!r}")
    E = router.shape[0]
    logits = F.linear(x.type(torch.float32), router.type(torch.float32))
    scores = logits.sigmoid()
    bias = correction_bias if correction_bias is not None else torch.zeros_like(scores[0])
    choice = scores + bias.float()
    group_scores = choice.view(-1, spec.n_group, E // spec.n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(-1, spec.n_group, E // spec.n_group).reshape(-1, E))
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    top_i = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    top_w = scores.gather(1, top_i)
    if spec.norm_topk_prob:
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
    return top_w * spec.routed_scaling_factor, top_i


def _experts_native(x, top_i, top_w, gate_up, down):
    E = gate_up.shape[0]
    final = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(top_i, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        slot, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down[e])
        h = h * top_w[tok, slot, None]
        final.index_add_(0, tok, h.to(final.dtype))
    return final


def moe_forward_native(x: torch.Tensor, weights: MoEWeights, *, kind: str, top_k: int,
                       norm_topk_prob: bool = True, n_group: int = 1, topk_group: int = 1,
                       routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """Stock MoE layer output [..., H] in x's dtype (module docstring)."""
    spec = RouterSpec(kind=kind, top_k=top_k, norm_topk_prob=norm_topk_prob, n_group=n_group,
                      topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
    H = x.shape[-1]
    weights.check(H)
    spec.check(weights.num_experts)
    x2 = x.reshape(-1, H)
    top_w, top_i = route_native(x2, weights, spec)
    out = _experts_native(x2, top_i, top_w, weights.gate_up.to(x.dtype), weights.down.to(x.dtype))
    if weights.shared_gate_up is not None:
        sgu = weights.shared_gate_up.to(x.dtype)
        i = sgu.shape[0] // 2
        shared = F.linear(F.silu(F.linear(x2, sgu[:i])) * F.linear(x2, sgu[i:]),
                          weights.shared_down.to(x.dtype))
        if weights.shared_gate is not None:
            shared = F.sigmoid(F.linear(x2, weights.shared_gate.to(x.dtype))) * shared
        out = out + shared
    return out.reshape(x.shape)


# ------------------------------------------------------------------------------ the four regions
# The stock layer above, cut into the regions a contract binds (signatures: regions.py). Run in
# sequence they compute what moe_forward_native computes, bit for bit.
def moe_route_native(x: torch.Tensor, weight: torch.Tensor, spec: RouterSpec,
                     correction_bias: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None):
    """transformers' router: ids in ``torch.topk`` order, weights in its dtype; the shared gate
    F.sigmoid(F.linear(x, shared_gate)) in x's dtype."""
    from .types import Routing

    top_w, top_i = _route_native(x, weight, correction_bias, spec)
    g = None if shared_gate is None else F.sigmoid(F.linear(x, shared_gate.to(x.dtype)))
    return Routing(ids=top_i, weights=top_w, shared_gate=g)


def moe_dispatch_native(ids: torch.Tensor, num_experts: int):
    """transformers' expert loop order: experts ascending; inside an expert, ``torch.where`` over
    its [k, T] mask: slot-major, then token."""
    from .types import Dispatch

    T, k = ids.shape
    mask = F.one_hot(ids.long(), num_classes=num_experts).permute(2, 1, 0)   # [E, k, T]
    e_idx, slot, tok = torch.where(mask > 0)                                 # row-major: expert, slot, token
    pair = tok * k + slot
    counts = torch.bincount(e_idx, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    row_of_pair = torch.empty_like(pair)
    row_of_pair[pair] = torch.arange(pair.numel(), device=ids.device)
    return Dispatch(token=tok, offsets=offsets, row_of_pair=row_of_pair, num_tokens=T, top_k=k)


def moe_experts_native(x: torch.Tensor, disp, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The eager expert loop: per expert hit, F.linear, F.silu(gate) * up, F.linear on its rows."""
    out = x.new_empty((disp.token.numel(), x.shape[-1]))
    offs = disp.offsets.tolist()
    for e in range(len(offs) - 1):
        r0, r1 = offs[e], offs[e + 1]
        if r1 > r0:
            gate, up = F.linear(x[disp.token[r0:r1]], gate_up[e]).chunk(2, dim=-1)
            out[r0:r1] = F.linear(F.silu(gate) * up, down[e])
    return out


def moe_combine_native(rows: torch.Tensor, disp, routing, shared: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """transformers' combine: per expert in ascending index, rows times their weight, rounded to the
    output dtype and ``index_add_``-ed into a buffer of that dtype; then + the (gated) shared expert
    in that dtype."""
    T, k = disp.num_tokens, disp.top_k
    dtype = out_dtype or rows.dtype
    final = torch.zeros((T, rows.shape[-1]), dtype=dtype, device=rows.device)
    pair_of_row = torch.empty_like(disp.row_of_pair)
    pair_of_row[disp.row_of_pair] = torch.arange(disp.row_of_pair.numel(), device=rows.device)
    w_rows = routing.weights.reshape(-1)[pair_of_row]
    offs = disp.offsets.tolist()
    for e in range(len(offs) - 1):
        r0, r1 = offs[e], offs[e + 1]
        if r1 > r0:
            h = rows[r0:r1] * w_rows[r0:r1, None]
            final = final.index_add(0, disp.token[r0:r1], h.to(dtype))
    if shared is not None:
        final = final + (shared if routing.shared_gate is None else routing.shared_gate * shared)
    return final
