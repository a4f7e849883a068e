"""RMSNorm: the Triton twin (kernels and their launchers; CUDA, or CPU under ``TRITON_INTERPRET=1``).
The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .._triton_util import jit, next_pow2, tl
from .reference import _check, _eps32, _out_dtype, _rows


def _warps_for(H: int) -> int:
    # A function of H only: the reduction tree inside tl.sum depends on the layout.
    block = next_pow2(H)
    return 1 if block <= 256 else 4 if block <= 2048 else 8


@jit
def _rms_fwd_kernel(x_ptr, w_ptr, w2_ptr, out_ptr, rstd_ptr, H, stride_x, stride_o, eps, heads, stride_head,
                    heads1, BLOCK_H: tl.constexpr, ZERO_CENTRED: tl.constexpr, TWO_WEIGHTS: tl.constexpr):
    # row r of x is (r // heads, r % heads) of a [T, heads, H] view with strides
    # (stride_x, stride_head, 1): a head-strided q/k slice is read in place instead of copied
    # (the address changes, the row's arithmetic does not)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(x_ptr + (row // heads) * stride_x + (row % heads) * stride_head + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    ss = tl.sum(xf * xf, axis=0)
    var = ss / H
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    if TWO_WEIGHTS:
        # heads from heads1 on take the second weight (q and k norms of a fused qkv output in
        # one launch; only the weight's address differs)
        w_row = tl.where((row % heads) < heads1, w_ptr + cols, w2_ptr + cols)
        w = tl.load(w_row, mask=ok, other=0.0).to(tl.float32)
    else:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        out = ((xf * rstd) * (1.0 + w)).to(out_ptr.dtype.element_ty)
    else:
        y = (xf * rstd).to(x.dtype)
        out = (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)
    tl.store(rstd_ptr + row, rstd)


@jit
def _rms_bwd_kernel(dy_ptr, x_ptr, w_ptr, w2_ptr, rstd_ptr, dx_ptr, dwp_ptr, R, H, rows_per_prog,
                    stride_dy, stride_x, stride_dx, heads, stride_head, heads1, stride_dwp,
                    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                    TWO_WEIGHTS: tl.constexpr):
    # Program p owns rows [p * rows_per_prog, (p + 1) * rows_per_prog): it writes their dx and
    # one fp32 partial of dweight, accumulated tile after tile in row order (fixed order, no
    # atomics). The partials are summed afterwards in program order. Row r of x is (r // heads,
    # r % heads) of a [T, heads, H] view with strides (stride_x, stride_head, 1), as in the
    # forward. TWO_WEIGHTS: heads from heads1 on take the second weight, and their dweight
    # partial goes to a second slab, stride_dwp further on.
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cok = cols < H
    w = tl.load(w_ptr + cols, mask=cok, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        w = 1.0 + w
    if TWO_WEIGHTS:
        w2 = tl.load(w2_ptr + cols, mask=cok, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            w2 = 1.0 + w2
        acc2 = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    r_first = pid * rows_per_prog
    r_end = tl.minimum(r_first + rows_per_prog, R)
    for r0 in range(r_first, r_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rok = rows < r_end
        ok = rok[:, None] & cok[None, :]
        x_row = (rows // heads) * stride_x + (rows % heads) * stride_head
        x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=ok, other=0.0)
        xf = x.to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rok, other=0.0)
        xhat = xf * rstd[:, None]
        if TWO_WEIGHTS:
            second = ((rows % heads) >= heads1)[:, None]
            g = dy * tl.where(second, w2[None, :], w[None, :])
        else:
            g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / H
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(x.dtype), mask=ok)
        if ZERO_CENTRED:
            part = dy * xhat
        else:
            part = dy * xhat.to(x.dtype).to(tl.float32)
        if TWO_WEIGHTS:
            acc += tl.sum(tl.where(second, 0.0, part), axis=0)
            acc2 += tl.sum(tl.where(second, part, 0.0), axis=0)
        else:
            acc += tl.sum(part, axis=0)
    tl.store(dwp_ptr + pid * H + cols, acc, mask=cok)
    if TWO_WEIGHTS:
        tl.store(dwp_ptr + stride_dwp + pid * H + cols, acc2, mask=cok)


def _bwd_launch(R: int, H: int) -> tuple[int, int, int]:
    """(BLOCK_R, rows_per_prog, programs) of the Triton backward, a function of (R, H) only: a
    tile of about 4096 elements, and about 512 programs (4 per SM of an H200) so that the dweight
    partials stay small while every SM has work."""
    block_h = next_pow2(H)
    block_r = max(1, min(64, 4096 // block_h))
    per = max(block_r, -(-R // 512))
    per = -(-per // block_r) * block_r
    return block_r, per, -(-R // per)


def _row_layout(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, heads, token stride, head stride) of ``x`` as the kernels address its rows: [R, H]
    rows, or the (token, head) rows of a [T, heads, H] view (unit column stride either way)."""
    H = x.shape[-1]
    rows = x.numel() // H if H else 0
    if x.dim() == 3:
        return rows, x.shape[1], x.stride(0), x.stride(1)
    return rows, 1, x.stride(0), 0


def _triton_fwd(x2, weight, eps, zero_centred: bool = False, weight2=None, heads1: int = 0):
    """Forward of rows ``x2``: [R, H] with unit column stride, or [T, heads, H] with unit column
    stride (rows taken in (token, head) order; out is [T * heads, H] either way). With
    ``weight2``, the rows of heads ``heads1..`` of the [T, heads, H] view are normed with it."""
    H = x2.shape[-1]
    R, heads, stride_x, stride_head = _row_layout(x2)
    out_dtype = x2.dtype if zero_centred else _out_dtype(x2, weight)
    out = torch.empty((R, H), dtype=out_dtype, device=x2.device)
    rstd = torch.empty((R,), dtype=torch.float32, device=x2.device)
    if R:
        w = weight.contiguous()
        _rms_fwd_kernel[(R,)](x2, w, w if weight2 is None else weight2.contiguous(), out, rstd, H, stride_x,
                              out.stride(0), _eps32(eps), heads, stride_head, heads1, BLOCK_H=next_pow2(H),
                              ZERO_CENTRED=zero_centred, TWO_WEIGHTS=weight2 is not None,
                              num_warps=_warps_for(H))
    return out, rstd


def triton_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the forward kernel reads it without a copy: [R, H] rows, or the [T, heads, H]
    view itself when only the token stride breaks the row layout (a q or k slice of a fused qkv
    output); a copy only when the last dim is strided or the view has other shapes."""
    if x.dim() == 3 and x.stride(-1) == 1 and x.stride(1) == x.shape[-1] and x.shape[1] > 1:
        return x
    return _rows(x)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm by the Triton schedule (api.py's docstring); forward only. CUDA tensors, or CPU
    tensors under ``TRITON_INTERPRET=1``."""
    _check(x, weight)
    out, _ = _triton_fwd(triton_rows(x), weight, eps, zero_centred)
    return out.reshape(x.shape)


def rms_norm_backward_triton(dy, x, weight, rstd, zero_centred: bool = False, weight2=None, heads1: int = 0):
    """(dx, dweight) for 2-D row-contiguous ``dy, x`` [R, H]: one fused Triton pass writes dx
    and a fixed-order dweight partial per program; the partials are summed over programs by
    torch (deterministic for a given shape). Not batch invariant in dweight, which is a sum over
    the batch (only forward bits must match trainer and engine).

    With ``weight2`` (the forward's two-weight call): ``x`` is the [T, heads, H] view the forward
    read (unit column stride), ``dy`` its gradient as [T * heads, H] rows, and the result is
    (dx [T * heads, H], dweight, dweight2), both dweights from one launch and one sum."""
    H = x.shape[-1]
    R, heads, stride_x, stride_head = _row_layout(x)
    two = weight2 is not None
    dx = torch.empty((R, H), dtype=x.dtype, device=x.device)
    if not R:
        return (dx, torch.zeros_like(weight)) + ((torch.zeros_like(weight2),) if two else ())
    block_r, per, programs = _bwd_launch(R, H)
    dwp = torch.empty((2 if two else 1, programs, H), dtype=torch.float32, device=x.device)
    w = weight.contiguous()
    _rms_bwd_kernel[(programs,)](dy, x, w, weight2.contiguous() if two else w, rstd, dx, dwp, R, H, per,
                                 dy.stride(0), stride_x, dx.stride(0), heads, stride_head, heads1,
                                 programs * H, BLOCK_R=block_r, BLOCK_H=next_pow2(H),
                                 ZERO_CENTRED=zero_centred, TWO_WEIGHTS=two, num_warps=_warps_for(H))
    if not two:
        return dx, dwp[0].sum(0).to(weight.dtype)
    dws = dwp.sum(1)
    return dx, dws[0].to(weight.dtype), dws[1].to(weight2.dtype)
