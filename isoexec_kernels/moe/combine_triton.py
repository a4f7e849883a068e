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

Backward: the reference's torch ops (autograd through the weights, the rows and the shared
expert) -- the forward is recomputed by them, so only this forward's bits are new.
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


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, shared, gate, disp, out_dtype):
        ctx.disp, ctx.out_dtype = disp, out_dtype
        ctx.save_for_backward(rows, weights, shared, gate)
        return _combine_launch(rows, disp, weights, shared, gate, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        from .reference import combine

        rows, weights, shared, gate = ctx.saved_tensors
        ins = [t.detach().requires_grad_(t.requires_grad) if t is not None else None
               for t in (rows, weights, shared, gate)]
        with torch.enable_grad():
            out = combine(ins[0], ctx.disp, Routing(ids=ctx.disp.token.new_empty(0), weights=ins[1]),
                          ins[2], ins[3], ctx.out_dtype)
            need = [t for t in ins if t is not None and t.requires_grad]
            got = iter(torch.autograd.grad(out, need, grad) if need else ())
        return (*(next(got) if t is not None and t.requires_grad else None for t in ins), None, None)


def combine_triton(expert_rows: torch.Tensor, disp: Dispatch, routing: Routing, shared: torch.Tensor | None = None,
                   shared_gate: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton twin of :func:`reference.combine` (module docstring), differentiable."""
    out_dtype = out_dtype or expert_rows.dtype
    return _CombineFn.apply(expert_rows, routing.weights, shared, shared_gate, disp, out_dtype)
