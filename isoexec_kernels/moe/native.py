"""Stock MoE twin: the mixture-of-experts layer the way transformers 5.17 computes it, on the fastest
stock path it offers (``experts_implementation="grouped_mm"``).

Same arguments as ``moe.moe_forward``. It is the native composition's MoE and the negative
control: no promise about the bits of a token when the batch changes.

  router (softmax_topk, ``Qwen3MoeTopKRouter``): logits = F.linear in x's dtype; softmax in fp32;
    ``torch.topk`` (tie order unspecified); optional renormalisation by ``torch.sum`` in top-k
    order; weights rounded to x's dtype.
  router (sigmoid_group_topk, ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter``): fp32 F.linear;
    ``torch.sigmoid``; correction bias for selection; group score = sum of the group's top-2;
    ``torch.topk`` for groups and experts; weights normalised by ``torch.sum`` + 1e-20, times
    ``routed_scaling_factor``.
  dispatch, experts, combine (transformers' ``grouped_mm`` experts; the regions below):
    dispatch: the T*k (token, slot) pairs, listed token-major (pair t*k + j), are ordered by
      their expert id with a stable sort, so the rows of one expert keep the pairs' order (token
      ascending: a token picks an expert at most once); the per-expert counts are a scatter_add
      into E slots and the offsets their prefix sum. transformers sorts with ``torch.sort`` and
      counts with ``torch.histc``: the same counts, and the same rows wherever its sort keeps
      equal keys in place (on the CPU it did: ``tests/kernels/test_moe.py`` matches transformers'
      grouped_mm layer bit for bit).
    experts: every dispatched row is x[token] (gathered in dispatch order), then ONE
      ``torch._grouped_mm`` over all experts for gate_up (each expert's row range times its
      [H, 2I] weight, the group ends passed as int32 offsets), F.silu(gate) * up (two roundings),
      and one ``torch._grouped_mm`` for down. Experts with no rows are empty groups; a dispatch of
      no row at all runs no GEMM and returns ``reference.no_rows`` (zero weight gradients).
    combine: each row times its routing weight (dtype promotion as in transformers: the sigmoid
      router's fp32 weights give fp32 products, the softmax router's x-dtype weights x-dtype
      ones), the rows put back in (token, slot) order, a token's k rows summed by ``torch.sum``
      over the slot axis, rounded to x's dtype; then the (gated) shared expert added in that dtype.
    No host synchronisation on this path: no ``.tolist()``, ``.item()``, ``nonzero``, boolean
    masks or data-sized outputs; every size is T*k or E, known on the host. So it can be captured
    in a CUDA graph wherever ``torch._grouped_mm`` itself can: on CUDA its grouped kernel runs for
    bf16 on sm90/sm100; any other dtype or arch takes torch's fallback, which copies the offsets
    to the host (the experts region refuses that inside a capture with a clear error).
  Alignment: ``torch._grouped_mm`` needs row strides that are multiples of 16 bytes (hidden and
    intermediate sizes multiples of 8 elements in bf16/fp16, of 4 in fp32), the weights' last
    dimension contiguous and, on CUDA, 16-byte aligned storage. For operands that miss any of
    this (:func:`grouped_mm_unsupported` says which) the experts region runs the per-expert loop
    instead: F.linear on each expert's rows, with the offsets read on the host (a sync, so not
    capturable). Every shipped model shape is aligned.
  Device choice: one path on every device. transformers 5.17 gives a model ``grouped_mm`` on the
    CPU too (the eager loop is what a bare experts module without a model config gets), and on
    the CPU ``torch._grouped_mm`` is one matrix product per expert on the rows it owns: the same
    products as the eager loop, bit for bit (``tests/kernels/test_moe_regions.py``). So the CPU
    negative controls keep their variance source -- an expert's GEMM sees as many rows as the
    expert received, and stock BLAS blocking follows that count -- and CPU and GPU run one path.
  ``experts_implementation="eager"`` (``moe_forward_native`` only; the regions are grouped_mm):
    transformers' eager ``*Experts.forward``, kept as the reference the grouped path is tested
    against: for each expert hit, in ascending expert index, the tokens that chose it are
    gathered and run through F.linear (gate_up), F.silu(gate) * up, F.linear (down), multiplied
    by their weight, rounded to x's dtype and ``index_add_``-ed into an x-dtype buffer (host
    syncs: ``nonzero``, ``torch.where``).
  shared expert: F.linear(gate), F.linear(up) as two products, F.silu(gate) * up, F.linear(down);
    Qwen-style gate: ``F.sigmoid(F.linear(x, shared_gate)) * shared`` in x's dtype; added to the
    routed sum in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import dispatch_in_order, no_rows
from .types import Dispatch, MoEWeights, ROUTER_SIGMOID_GROUP_TOPK, ROUTER_SOFTMAX_TOPK, RouterSpec, Routing

EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")
"""``moe_forward_native``'s expert paths (transformers' ``experts_implementation`` names)."""

_ALIGN_BYTES = 16  # torch._grouped_mm: row strides and (on CUDA) base pointers


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
    bias = correction_bias if correction_bias is not None else scores.new_zeros(E)   # scores[0]: none without a token
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


def _experts_eager(x, top_i, top_w, gate_up, down):
    """transformers' eager expert loop, weights and index_add_ included (module docstring)."""
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
                       routed_scaling_factor: float = 1.0, experts_implementation: str = "grouped_mm"
                       ) -> torch.Tensor:
    """Stock MoE layer output [..., H] in x's dtype (module docstring). ``experts_implementation``:
    ``"grouped_mm"`` (the regions below, what the native composition runs) or ``"eager"``."""
    if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"moe_native: experts_implementation {experts_implementation!r} is not one of "
                         f"{EXPERTS_IMPLEMENTATIONS}")
    spec = RouterSpec(kind=kind, top_k=top_k, norm_topk_prob=norm_topk_prob, n_group=n_group,
                      topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
    H = x.shape[-1]
    weights.check(H)
    spec.check(weights.num_experts)
    x2 = x.reshape(-1, H)
    top_w, top_i = route_native(x2, weights, spec)
    gate_up, down = weights.gate_up.to(x.dtype), weights.down.to(x.dtype)
    if experts_implementation == "eager":
        out = _experts_eager(x2, top_i, top_w, gate_up, down)
    else:
        disp = moe_dispatch_native(top_i, weights.num_experts)
        out = moe_combine_native(moe_experts_native(x2, disp, gate_up, down), disp,
                                 Routing(ids=top_i, weights=top_w), out_dtype=x.dtype)
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
# sequence they compute what moe_forward_native computes (grouped_mm), bit for bit.
def moe_route_native(x: torch.Tensor, weight: torch.Tensor, spec: RouterSpec,
                     correction_bias: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None):
    """transformers' router: ids in ``torch.topk`` order, weights in its dtype; the shared gate
    F.sigmoid(F.linear(x, shared_gate)) in x's dtype."""
    top_w, top_i = _route_native(x, weight, correction_bias, spec)
    g = None if shared_gate is None else F.sigmoid(F.linear(x, shared_gate.to(x.dtype)))
    return Routing(ids=top_i, weights=top_w, shared_gate=g)


def moe_dispatch_native(ids: torch.Tensor, num_experts: int) -> Dispatch:
    """The grouped_mm dispatch: pairs ordered by expert id with a stable sort (pair order, i.e. token
    ascending, inside an expert); counts by scatter_add, offsets their prefix sum. No host sync."""
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    return dispatch_in_order(flat, torch.argsort(flat, stable=True), T, k, num_experts)


def grouped_mm_unsupported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str | None:
    """Why ``torch._grouped_mm`` cannot run the experts on these operands, or None when it can:
    dtypes (bf16, fp16 or fp32, all three alike), hidden and intermediate sizes whose rows are a
    multiple of 16 bytes (the gathered rows and the activation are contiguous, so their row stride
    is that size), weights with a contiguous last dimension and 16-byte multiple row strides, and
    on CUDA weights whose storage starts 16-byte aligned (the transposed weight views are then the
    column-major operands torch asks for). Host metadata only."""
    dt = x.dtype
    if dt not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dt} (torch._grouped_mm takes bf16, fp16 or fp32)"
    if gate_up.dtype != dt or down.dtype != dt:
        return f"x is {dt} but the expert weights are {gate_up.dtype} and {down.dtype}"
    align = _ALIGN_BYTES // x.element_size()
    for name, n in (("hidden size", x.shape[-1]), ("intermediate size", down.shape[-1])):
        if n % align:
            return f"{name} {n} is not a multiple of {align} elements ({_ALIGN_BYTES}-byte row strides, {dt})"
    for name, w in (("gate_up", gate_up), ("down", down)):
        if w.stride(-1) != 1 or w.stride(-2) < w.shape[-1] or w.stride(-2) % align:
            return (f"{name} strides {tuple(w.stride())} are not row-major with rows a multiple of "
                    f"{_ALIGN_BYTES} bytes apart")
        if w.is_cuda and w.data_ptr() % _ALIGN_BYTES:
            return f"{name} storage does not start on a {_ALIGN_BYTES}-byte boundary"
    return None


def _cuda_sync_reason(x: torch.Tensor) -> str | None:
    """Why torch._grouped_mm would take its host-synchronising fallback on x's CUDA device."""
    if x.dtype != torch.bfloat16:
        return f"torch._grouped_mm's CUDA grouped kernel is bf16 only; {x.dtype} takes its host-synchronising fallback"
    major, minor = torch.cuda.get_device_capability(x.device)
    if major not in (9, 10):
        return (f"torch._grouped_mm's CUDA grouped kernel needs sm90 or sm100; sm{major}{minor} takes its "
                "host-synchronising fallback")
    return None


def moe_experts_native(x: torch.Tensor, disp: Dispatch, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The grouped_mm experts: x[token] in dispatch order, one ``torch._grouped_mm`` for gate_up,
    F.silu(gate) * up, one for down; rows [T*k, H] in dispatch order. Operands torch._grouped_mm
    refuses (:func:`grouped_mm_unsupported`) run the per-expert F.linear loop instead. The
    stacked weights get a whole gradient in every backward: torch._grouped_mm's (an expert with no
    rows is an empty group, whose slice is zeros on the CPU; on CUDA torch's kernel fills it,
    reported as zeros on sm90 and not always on sm100 in pytorch issue 172439, not checked here),
    the loop's (each expert's weight an index of the stacked one: zeros for an idle expert), and
    with no row at all ``reference.no_rows``'s zeros."""
    why = grouped_mm_unsupported(x, gate_up, down)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        sync = why or _cuda_sync_reason(x)
        if sync is not None:
            raise RuntimeError(f"moe_experts_native: cannot run inside a CUDA graph capture: {sync}")
    if disp.token.numel() == 0:
        return no_rows(x, gate_up, down)   # no grouped GEMM of no row; the weights get zero gradients
    if why is not None:
        return _experts_loop(x, disp, gate_up, down)
    ends = disp.offsets[1:].to(torch.int32)          # group e ends at row ends[e] (torch's offs)
    h = torch._grouped_mm(x[disp.token], gate_up.transpose(-2, -1), offs=ends)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=ends)


def _experts_loop(x: torch.Tensor, disp: Dispatch, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Fallback for unaligned operands: per expert with rows, F.linear, F.silu(gate) * up, F.linear
    on its rows (the offsets read on the host). Called with rows only (no row at all:
    :func:`moe_experts_native` returns ``reference.no_rows`` first)."""
    out = x.new_empty((disp.token.numel(), x.shape[-1]))
    offs = disp.offsets.tolist()
    for e in range(len(offs) - 1):
        r0, r1 = offs[e], offs[e + 1]
        if r1 > r0:
            gate, up = F.linear(x[disp.token[r0:r1]], gate_up[e]).chunk(2, dim=-1)
            out[r0:r1] = F.linear(F.silu(gate) * up, down[e])
    return out


def moe_combine_native(rows: torch.Tensor, disp: Dispatch, routing: Routing, shared: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The grouped_mm combine: rows back in (token, slot) order times their routing weight, a
    token's k rows summed by ``torch.sum`` over the slot axis, rounded to the output dtype; then
    + the (gated) shared expert in that dtype. No host sync."""
    T, k = disp.num_tokens, disp.top_k
    dtype = out_dtype or rows.dtype
    weighted = rows[disp.row_of_pair] * routing.weights.reshape(-1, 1)
    final = weighted.reshape(T, k, rows.shape[-1]).sum(dim=1).to(dtype)
    if shared is not None:
        final = final + (shared if routing.shared_gate is None else routing.shared_gate * shared)
    return final
