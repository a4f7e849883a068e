"""The MoE combine as one Triton launch (CUDA, or CPU under ``TRITON_INTERPRET=1``).

:func:`combine_triton` computes what :func:`reference.combine` computes, with the same operations
in the same order, so the bits are the same (checked against the torch reference under the
interpreter and, on a GPU, by the tests): per token t and hidden column h,

    acc = +0
    for j in 0..k-1 (the token's experts in ascending index):  acc = acc + fp32(w[t, j] * fp32(y))
    with a shared expert:   acc = acc + fp32(g[t] * fp32(ys))   (acc + fp32(ys) without a gate)
    out = round_to_out_dtype(acc)

where y is the expert row ``rows[row_of_pair[t * k + j]]``. Products are rounded before their add:
the kernel is compiled with floating-point contraction off (no fused multiply-add), as torch's
separate multiply and add kernels compute it. The reference takes about 3k + 4 kernels (a gather,
then a multiply and an add per expert); this is one.

Backward (deterministic, not batch invariant: only forward bits must match between trainer and
engine), one launch, one program per token; with G = fp32(grad[t]) (the output cast's gradient):

    grad rows[row_of_pair[t*k + j]] = round_to_rows_dtype(w[t, j] * G)    (each row once: no adds)
    grad w[t, j]                    = sum_h G[h] * fp32(y_j[h])            (fp32)
    grad shared[t]                  = round(g[t] * G), or round(G) without a gate
    grad g[t]                       = sum_h G[h] * fp32(ys[h])             (fp32)

the row and shared gradients are the reference autograd's bits (one product, one rounding); each
sum runs over fixed 1024-wide blocks of h, added elementwise in h-block order into an fp32 vector,
then one ``tl.sum`` of that vector: a fixed order for a given H (not torch's reduction order, so
those two gradients match the reference's at fp32 tolerance). The reference's autograd took about
6k + 10 kernels (one select, multiply and add per expert, an index backward into the rows).
"""

from __future__ import annotations

import torch

from .._triton_util import jit, tl, triton
from .types import Dispatch, Routing

_BLOCK_H = 1024


@jit
def _combine_kernel(rows_ptr, rop_ptr, w_ptr, sh_ptr, g_ptr, out_ptr, H, K: tl.constexpr,
                    HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(rop_ptr + t * K + j).to(tl.int64)
        y = tl.load(rows_ptr + r * H + offs, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + t * K + j)
        acc = acc + w * y
    if HAS_SHARED:
        ys = tl.load(sh_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_GATE:
            acc = acc + tl.load(g_ptr + t) * ys
        else:
            acc = acc + ys
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _combine_launch(rows, disp: Dispatch, weights, shared, gate, out_dtype):
    T, k = disp.num_tokens, disp.top_k
    H = rows.shape[-1]
    out = torch.empty((T, H), dtype=out_dtype, device=rows.device)
    if T == 0 or H == 0:
        return out
    rows = rows.contiguous()
    sh = shared.contiguous() if shared is not None else rows
    g = gate.reshape(T).float().contiguous() if gate is not None else weights
    grid = (T, triton.cdiv(H, _BLOCK_H))
    _combine_kernel[grid](rows, disp.row_of_pair.contiguous(), weights.float().contiguous(), sh, g, out, H,
                          K=k, HAS_SHARED=shared is not None, HAS_GATE=gate is not None and shared is not None,
                          BLOCK_H=_BLOCK_H, num_warps=4, enable_fp_fusion=False)
    return out


@jit
def _combine_bwd_kernel(grad_ptr, rows_ptr, rop_ptr, w_ptr, sh_ptr, g_ptr,
                        grows_ptr, gw_ptr, gsh_ptr, gg_ptr, H, K: tl.constexpr,
                        HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    for j in tl.static_range(K):
        r = tl.load(rop_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j)
        part = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + cols
            ok = offs < H
            gr = tl.load(grad_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)
            y = tl.load(rows_ptr + r * H + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(grows_ptr + r * H + offs, (w * gr).to(grows_ptr.dtype.element_ty), mask=ok)
            part = part + gr * y
        tl.store(gw_ptr + t * K + j, tl.sum(part, 0))
    if HAS_SHARED:
        part = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + cols
            ok = offs < H
            gr = tl.load(grad_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_GATE:
                ys = tl.load(sh_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)
                part = part + gr * ys
                gr = tl.load(g_ptr + t) * gr
            tl.store(gsh_ptr + t * H + offs, gr.to(gsh_ptr.dtype.element_ty), mask=ok)
        if HAS_GATE:
            tl.store(gg_ptr + t, tl.sum(part, 0))


def _combine_bwd_launch(grad, rows, disp: Dispatch, weights, shared, gate):
    """(grad rows, grad weights fp32 [T, k], grad shared | None, grad gate fp32 [T] | None)."""
    T, k = disp.num_tokens, disp.top_k
    H = rows.shape[-1]
    grows = torch.empty_like(rows, memory_format=torch.contiguous_format)
    gw = torch.empty((T, k), dtype=torch.float32, device=rows.device)
    gsh = None if shared is None else torch.empty_like(shared, memory_format=torch.contiguous_format)
    gg = None if (gate is None or shared is None) else torch.empty(T, dtype=torch.float32, device=rows.device)
    if T == 0 or H == 0:
        return grows.zero_(), gw.zero_(), None if gsh is None else gsh.zero_(), None if gg is None else gg.zero_()
    grad = grad.contiguous()
    rows = rows.contiguous()
    sh = shared.contiguous() if shared is not None else rows
    g = gate.reshape(T).float().contiguous() if gate is not None else gw
    _combine_bwd_kernel[(T,)](grad, rows, disp.row_of_pair.contiguous(), weights.float().contiguous(), sh, g,
                              grows, gw, gsh if gsh is not None else grows, gg if gg is not None else gw, H,
                              K=k, HAS_SHARED=shared is not None, HAS_GATE=gg is not None,
                              BLOCK_H=_BLOCK_H, num_warps=4)
    return grows, gw, gsh, gg


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, shared, gate, disp, out_dtype):
        ctx.disp, ctx.out_dtype = disp, out_dtype
        ctx.save_for_backward(rows, weights, shared, gate)
        return _combine_launch(rows, disp, weights, shared, gate, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, shared, gate = ctx.saved_tensors
        grows, gw, gsh, gg = _combine_bwd_launch(grad, rows, ctx.disp, weights, shared, gate)
        need = ctx.needs_input_grad
        return (grows if need[0] else None, gw.to(weights.dtype) if need[1] else None,
                gsh if need[2] else None,
                gg.reshape(gate.shape).to(gate.dtype) if (need[3] and gg is not None) else None, None, None)


def combine_triton(expert_rows: torch.Tensor, disp: Dispatch, routing: Routing, shared: torch.Tensor | None = None,
                   shared_gate: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton twin of :func:`reference.combine` (module docstring), differentiable."""
    out_dtype = out_dtype or expert_rows.dtype
    return _CombineFn.apply(expert_rows, routing.weights, shared, shared_gate, disp, out_dtype)
