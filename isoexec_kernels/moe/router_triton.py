"""The MoE router after its logits, as one Triton launch (CUDA, or CPU under ``TRITON_INTERPRET=1``).

:func:`route_triton` replaces :func:`reference.route` (and the shared gate's sigmoid) on CUDA. The
torch reference evaluates exp in float64 from basic operations, because on a CPU ``torch.exp`` is
not a function of the element alone (SIMD body vs scalar tail); on a GPU every lane runs the same
instruction sequence, so the fp32 device exp is position-free, and the float64 route (about fifty
small kernels per layer) is not needed there. One program per token row does everything below on
the row's E logits held in registers (E padded to a power of two, pad lanes inert).

Rounding schedule (per token; z = the fp32 logits [E] of the invariant GEMM)
  * softmax_topk: m = max_j z_j; e_j = exp(z_j - m) (fp32 subtract, the device's fp32 ``tl.exp``);
    S = tl.sum of the e_j over the padded E lanes (a fixed reduction tree for a given E: the pad
    lanes hold +0); p_j = e_j / S. Selected: the k largest p_j, ties to the lower expert index
    (k rounds of max, then the lowest index holding it). Weights: p_j, or with
    ``norm_topk_prob`` p_j / D with D = tl.sum of the chosen p_j (+0 elsewhere, same tree).
  * sigmoid_group_topk: s_j = 1 / (1 + exp(-z_j)) (fp32, ``tl.exp``); b_j = s_j + bias_j
    (selection only). Groups of E / n_group contiguous experts score max b + second max b (one
    fp32 add); the ``topk_group`` best groups are kept (ties: lower group); the k largest b_j
    inside them are chosen (ties: lower expert). Weights s_j, or s_j / (D + 1e-20) with D =
    tl.sum of the chosen s_j; then times fp32(routed_scaling_factor).
  * the shared expert's gate (Qwen): g = 1 / (1 + exp(-l)) of its fp32 logit l.
  The k ids are written in ascending expert index, their weights in the same order.
Nothing reduces across rows, so a row's ids and weights are functions of that row's logits only.
These are not the reference's bits (float64 exp, left-to-right sums): as for the GEMM, each
implementation is invariant on its own, and trainer and engine on one device run the same one.

Backward (autograd through the weights and the gate; the selection has none): the weights are
recomputed from the logits at the selected ids with fp32 torch ops and differentiated by torch
(deterministic; only forward bits must match between trainer and engine).
"""

from __future__ import annotations

import torch

from .._triton_util import jit, next_pow2, tl
from .types import ROUTER_SOFTMAX_TOPK, RouterSpec

_NORM_EPS_SIGMOID = 1e-20


@jit
def _route_kernel(z_ptr, bias_ptr, gl_ptr, ids_ptr, w_ptr, g_ptr, E, rsf,
                  SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr, NORM: tl.constexpr,
                  K: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr, TOPK_GROUP: tl.constexpr):
    # One token row, its experts laid out as [NG, GS] (groups x experts per group, powers of two;
    # NG = 1 for the softmax router). Lanes past E are inert.
    row = tl.program_id(0).to(tl.int64)
    g_i = tl.arange(0, NG)[:, None]
    e_i = tl.arange(0, GS)[None, :]
    idx = g_i * GS + e_i
    ok = idx < E
    z = tl.load(z_ptr + row * E + idx, mask=ok, other=0.0)
    neg = float("-inf")
    if SOFTMAX:
        zm = tl.where(ok, z, neg)
        m = tl.max(tl.max(zm, axis=1), axis=0)
        e = tl.where(ok, tl.exp(z - m), 0.0)
        p = e / tl.sum(tl.sum(e, axis=1), axis=0)
        score = p
        cand = tl.where(ok, p, neg)
    else:
        s = 1.0 / (1.0 + tl.exp(-z))
        score = s
        b = s
        if HAS_BIAS:
            b = s + tl.load(bias_ptr + idx, mask=ok, other=0.0)
        cand = tl.where(ok, b, neg)
        if NG > 1:
            # group score: the largest b of the group plus its second largest
            top1 = tl.max(cand, axis=1)
            first = tl.min(tl.where(cand == top1[:, None], e_i, GS), axis=1)
            top2 = tl.max(tl.where(e_i == first[:, None], neg, cand), axis=1)
            gscore = top1 + top2
            gidx = tl.arange(0, NG)
            keep = gidx < 0
            for _ in tl.static_range(TOPK_GROUP):
                gv = tl.where(keep, neg, gscore)
                best = tl.max(gv, axis=0)
                pick = tl.min(tl.where(gv == best, gidx, NG), axis=0)
                keep = keep | (gidx == pick)
            cand = tl.where(keep[:, None], cand, neg)
    sel = idx < 0
    for _ in tl.static_range(K):
        c = tl.where(sel, neg, cand)
        best = tl.max(tl.max(c, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(c == best, idx, NG * GS), axis=1), axis=0)
        sel = sel | (idx == pick)
    w = tl.where(sel, score, 0.0)
    if NORM:
        d = tl.sum(tl.sum(w, axis=1), axis=0)
        if SOFTMAX:
            w = w / d
        else:
            w = w / (d + 1e-20)
    if not SOFTMAX:
        w = w * rsf
    # the chosen experts in ascending index: the rank of a chosen lane is the number of chosen
    # lanes before it (row-major over [NG, GS] is ascending index)
    flat_sel = tl.reshape(sel.to(tl.int32), (NG * GS,))
    rank = tl.cumsum(flat_sel, axis=0) - 1
    flat_idx = tl.reshape(idx, (NG * GS,))
    flat_w = tl.reshape(w, (NG * GS,))
    chosen = flat_sel > 0
    tl.store(ids_ptr + row * K + rank, flat_idx.to(tl.int64), mask=chosen)
    tl.store(w_ptr + row * K + rank, flat_w, mask=chosen)
    if HAS_GATE:
        gl = tl.load(gl_ptr + row)
        tl.store(g_ptr + row, 1.0 / (1.0 + tl.exp(-gl)))


def _layout(spec: RouterSpec, E: int) -> tuple[int, int] | None:
    """(NG, GS) powers of two with NG * GS covering E and the groups contiguous, or None."""
    if spec.kind == ROUTER_SOFTMAX_TOPK or spec.n_group == 1:
        return 1, next_pow2(E)
    size = E // spec.n_group
    if next_pow2(spec.n_group) != spec.n_group or next_pow2(size) != size:
        return None
    return spec.n_group, size


def route_triton_supported(spec: RouterSpec, E: int) -> bool:
    """Whether :func:`route_triton` takes this router (group routers need power-of-two groups)."""
    return _layout(spec, E) is not None and E <= 4096


def _route_launch(z, spec, bias, gate_logit):
    T, E = z.shape
    ng, gs = _layout(spec, E)
    k = spec.top_k
    ids = torch.empty((T, k), dtype=torch.int64, device=z.device)
    w = torch.empty((T, k), dtype=torch.float32, device=z.device)
    g = torch.empty((T, 1), dtype=torch.float32, device=z.device) if gate_logit is not None else None
    if T:
        softmax = spec.kind == ROUTER_SOFTMAX_TOPK
        _route_kernel[(T,)](
            z, bias if bias is not None else z, gate_logit if gate_logit is not None else z, ids, w,
            g if g is not None else w, E, float(spec.routed_scaling_factor),
            SOFTMAX=softmax, HAS_BIAS=bias is not None and not softmax, HAS_GATE=gate_logit is not None,
            NORM=bool(spec.norm_topk_prob), K=k, NG=ng, GS=gs,
            TOPK_GROUP=1 if softmax else spec.topk_group, num_warps=1 if ng * gs <= 256 else 4)
    return ids, w, g


def _weights_torch(z, ids, spec):
    """The weights of the chosen experts as fp32 torch ops (the backward's recompute)."""
    if spec.kind == ROUTER_SOFTMAX_TOPK:
        w = torch.softmax(z, dim=-1).gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True) if spec.norm_topk_prob else w
    w = torch.sigmoid(z.gather(1, ids))
    if spec.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + _NORM_EPS_SIGMOID)
    return w * float(spec.routed_scaling_factor)


class _RouteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, gate_logit, spec, bias):
        ids, w, g = _route_launch(z.contiguous(), spec, bias, None if gate_logit is None else gate_logit.contiguous())
        ctx.spec = spec
        ctx.has_gate = gate_logit is not None
        ctx.save_for_backward(z, ids, *( [gate_logit] if gate_logit is not None else []))
        ctx.mark_non_differentiable(ids)
        return ids, w, g

    @staticmethod
    def backward(ctx, _gids, gw, gg):
        z, ids, *rest = ctx.saved_tensors
        ggl = None
        with torch.enable_grad():
            zz = z.detach().requires_grad_()
            w = _weights_torch(zz, ids, ctx.spec)
            outs, grads, ins = [w], [gw if gw is not None else torch.zeros_like(w)], [zz]
            if ctx.has_gate and gg is not None:
                gl = rest[0].detach().requires_grad_()
                outs.append(torch.sigmoid(gl).reshape(gg.shape))
                grads.append(gg)
                ins.append(gl)
            got = torch.autograd.grad(outs, ins, grads, allow_unused=True)
        if len(got) > 1:
            ggl = got[1]
        return got[0], ggl, None, None


def route_triton(logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None,
                 shared_gate_logit: torch.Tensor | None = None):
    """(ids [T, k] int64 ascending, weights [T, k] fp32, gate [T, 1] fp32 | None) from fp32
    ``logits [T, E]`` and, for a gated shared expert, its fp32 logit [T, 1] (module docstring).
    Differentiable in the logits and the gate logit."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"moe.route_triton: logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    T, E = logits.shape
    spec.check(E)
    if not route_triton_supported(spec, E):
        raise ValueError(f"moe.route_triton: {spec.n_group} groups of {E // spec.n_group} experts: "
                         "groups must be powers of two")
    if spec.kind == ROUTER_SOFTMAX_TOPK and correction_bias is not None:
        raise ValueError("moe.route: the softmax_topk router takes no correction bias")
    bias = None if correction_bias is None else correction_bias.float().contiguous()
    gl = None if shared_gate_logit is None else shared_gate_logit.reshape(T).float()
    return _RouteFn.apply(logits, gl, spec, bias)
