"""Batch-invariant RMSNorm (Qwen3 style), forward and backward.

Public API
  ``rms_norm(x, weight, eps)``             dispatcher (CUDA -> Triton, else reference),
                                            differentiable
  ``rms_norm_reference(x, weight, eps)``   torch twin (forward only)
  ``rms_norm_triton(x, weight, eps)``      Triton twin (forward only)
  ``rms_norm_backward_reference(dy, x, weight, rstd)`` / ``rms_norm_backward_triton(...)``

``weight`` has shape [H] and applies to the last dim of ``x[..., H]`` (so the same function is
the model norm and the per-head q/k norm on ``x[T, heads, head_dim]``).

Rounding schedule (per row of H elements; identical for every row position and batch size)
  xf = fp32(x); ss = sum(xf * xf) in fp32 by a fixed order over H; var = ss / H (fp32 div);
  rstd = 1 / sqrt(var + eps) (IEEE sqrt, IEEE div; eps rounded to fp32 first);
  y = round_to_x_dtype(xf * rstd); out = round_to_out_dtype(fp32(weight) * fp32(y)),
  out_dtype = promote(x.dtype, weight.dtype). This is Qwen3RMSNorm's formula
  (``weight * (x.float() * rsqrt(var + eps)).to(input_dtype)``) with pinned reduction order.
  * reference (impl ``ref_rmsnorm``): ss by the halves pairwise tree over the whole row
    zero-padded to a power of two.
  * Triton (impl ``triton_rmsnorm``): one program per row, the row in one register block of
    ``next_pow2(H)``; ``tl.sum`` with num_warps chosen from H only.

Backward (straight-through the two casts, like torch autograd of the formula above):
  g = fp32(dy) * fp32(weight); c = sum(g * xhat) / H (same fixed order as forward), with
  xhat = xf * rstd in fp32; dx = (g - xhat * c) * rstd -> x.dtype;
  dweight = sum over rows of fp32(dy) * fp32(y) -> weight.dtype. The reference sums rows by
  fixed 64-row leaves (halves tree inside a leaf, leaves left to right); the Triton backward is
  one fused pass (dx and a per-program dweight partial over a fixed row range, tiles in row
  order), the partials then summed over programs by ``torch.sum``. Both are deterministic for a
  given shape; dweight is a sum over the batch and is not batch invariant (only forward bits
  must match between trainer and engine, ``docs/variance_sources.md``).

Zero-centred variant (``zero_centred=True``; Qwen3.5's ``Qwen3_5RMSNorm``, weights stored as
offsets from 1): same ss / rstd, then out = round_to_x_dtype((xf * rstd) * (1 + fp32(weight))),
all in fp32 with no intermediate rounding to x.dtype (``1 + w`` is one fp32 add). Backward: g =
fp32(dy) * (1 + fp32(weight)), dx as above, dweight = fixed-leaf row sum of fp32(dy) * xhat.
The default (``zero_centred=False``) path is unchanged, bit for bit.
"""

from __future__ import annotations

import torch

from . import _ref
from ._triton_util import jit, next_pow2, tl, want_triton

__all__ = [
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_triton",
    "rms_norm_backward_reference",
    "rms_norm_backward_triton",
    "IMPL_REFERENCE",
    "IMPL_TRITON",
    "DW_ROW_LEAF",
]

IMPL_REFERENCE = "ref_rmsnorm"
IMPL_TRITON = "triton_rmsnorm"
DW_ROW_LEAF = 64
"""Leaf width (rows) of the fixed-order sum that forms dweight in the backward."""


def _check(x, weight):
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm: weight must be [H] with H = x.shape[-1]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )


def _eps32(eps: float) -> float:
    # eps is applied as an fp32 number on every path.
    return float(torch.tensor(eps, dtype=torch.float32))


def _out_dtype(x, weight):
    return torch.promote_types(x.dtype, weight.dtype)


# ---------------------------------------------------------------------------------------------
# Reference twin
# ---------------------------------------------------------------------------------------------


def _row_sum_ref(t: torch.Tensor) -> torch.Tensor:
    """Fixed-order sum over the last dim of a 2-D fp32 tensor (halves tree, whole row)."""
    return _ref.tree_sum0(t.t().contiguous())


def _ref_fwd(x2: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False):
    R, H = x2.shape
    xf = x2.float()
    ss = _row_sum_ref(xf * xf) if R else xf.new_zeros(0)
    var = ss / H
    s = torch.sqrt(var + _eps32(eps))
    rstd = torch.div(torch.ones_like(s), s)
    if zero_centred:
        return ((xf * rstd[:, None]) * (1.0 + weight.float())).to(x2.dtype), rstd
    y = (xf * rstd[:, None]).to(x2.dtype)
    out = (weight.float() * y.float()).to(_out_dtype(x2, weight))
    return out, rstd


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm by the reference schedule (module docstring); forward only."""
    _check(x, weight)
    H = x.shape[-1]
    out, _ = _ref_fwd(x.reshape(-1, H), weight, eps, zero_centred)
    return out.reshape(x.shape)


def rms_norm_backward_reference(dy, x, weight, rstd, zero_centred: bool = False):
    """(dx, dweight) for 2-D ``dy, x`` [R, H] and the forward's fp32 ``rstd`` [R]."""
    R, H = x.shape
    xf = x.float()
    xhat = xf * rstd[:, None]
    g = dy.float() * ((1.0 + weight.float()) if zero_centred else weight.float())
    c = _row_sum_ref(g * xhat) / H if R else xf.new_zeros(0)
    dx = ((g - xhat * c[:, None]) * rstd[:, None]).to(x.dtype)
    y = xhat if zero_centred else xhat.to(x.dtype).float()
    dw = _ref.blocked_sum(dy.float() * y, 0, DW_ROW_LEAF).to(weight.dtype)
    return dx, dw


# ---------------------------------------------------------------------------------------------
# Triton twin
# ---------------------------------------------------------------------------------------------


def _warps_for(H: int) -> int:
    # A function of H only: the reduction tree inside tl.sum depends on the layout.
    block = next_pow2(H)
    return 1 if block <= 256 else 4 if block <= 2048 else 8


@jit
def _rms_fwd_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, H, stride_x, stride_o, eps,
                    BLOCK_H: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    ss = tl.sum(xf * xf, axis=0)
    var = ss / H
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        out = ((xf * rstd) * (1.0 + w)).to(out_ptr.dtype.element_ty)
    else:
        y = (xf * rstd).to(x.dtype)
        out = (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)
    tl.store(rstd_ptr + row, rstd)


@jit
def _rms_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dwp_ptr, R, H, rows_per_prog,
                    stride_dy, stride_x, stride_dx, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                    ZERO_CENTRED: tl.constexpr):
    # Program p owns rows [p * rows_per_prog, (p + 1) * rows_per_prog): it writes their dx and
    # one fp32 partial of dweight, accumulated tile after tile in row order (fixed order, no
    # atomics). The partials are summed afterwards in program order.
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cok = cols < H
    w = tl.load(w_ptr + cols, mask=cok, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        w = 1.0 + w
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    r_first = pid * rows_per_prog
    r_end = tl.minimum(r_first + rows_per_prog, R)
    for r0 in range(r_first, r_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rok = rows < r_end
        ok = rok[:, None] & cok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
        xf = x.to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rok, other=0.0)
        xhat = xf * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / H
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(x.dtype), mask=ok)
        if ZERO_CENTRED:
            acc += tl.sum(dy * xhat, axis=0)
        else:
            acc += tl.sum(dy * xhat.to(x.dtype).to(tl.float32), axis=0)
    tl.store(dwp_ptr + pid * H + cols, acc, mask=cok)


def _bwd_launch(R: int, H: int) -> tuple[int, int, int]:
    """(BLOCK_R, rows_per_prog, programs) of the Triton backward, a function of (R, H) only: a
    tile of about 4096 elements, and about 512 programs (4 per SM of an H200) so that the dweight
    partials stay small while every SM has work."""
    block_h = next_pow2(H)
    block_r = max(1, min(64, 4096 // block_h))
    per = max(block_r, -(-R // 512))
    per = -(-per // block_r) * block_r
    return block_r, per, -(-R // per)


def _rows(t: torch.Tensor) -> torch.Tensor:
    H = t.shape[-1]
    t2 = t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _triton_fwd(x2, weight, eps, zero_centred: bool = False):
    R, H = x2.shape
    out_dtype = x2.dtype if zero_centred else _out_dtype(x2, weight)
    out = torch.empty((R, H), dtype=out_dtype, device=x2.device)
    rstd = torch.empty((R,), dtype=torch.float32, device=x2.device)
    if R:
        _rms_fwd_kernel[(R,)](x2, weight.contiguous(), out, rstd, H, x2.stride(0), out.stride(0),
                              _eps32(eps), BLOCK_H=next_pow2(H), ZERO_CENTRED=zero_centred,
                              num_warps=_warps_for(H))
    return out, rstd


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm by the Triton schedule (module docstring); forward only. CUDA tensors, or CPU
    tensors under ``TRITON_INTERPRET=1``."""
    _check(x, weight)
    out, _ = _triton_fwd(_rows(x), weight, eps, zero_centred)
    return out.reshape(x.shape)


def rms_norm_backward_triton(dy, x, weight, rstd, zero_centred: bool = False):
    """(dx, dweight) for 2-D row-contiguous ``dy, x`` [R, H]: one fused Triton pass writes dx
    and a fixed-order dweight partial per program; the partials are summed over programs by
    torch (deterministic for a given shape). Not batch invariant in dweight, which is a sum over
    the batch (only forward bits must match trainer and engine)."""
    R, H = x.shape
    dx = torch.empty((R, H), dtype=x.dtype, device=x.device)
    if not R:
        return dx, torch.zeros_like(weight)
    block_r, per, programs = _bwd_launch(R, H)
    dwp = torch.empty((programs, H), dtype=torch.float32, device=x.device)
    _rms_bwd_kernel[(programs,)](dy, x, weight.contiguous(), rstd, dx, dwp, R, H, per,
                                 dy.stride(0), x.stride(0), dx.stride(0), BLOCK_R=block_r,
                                 BLOCK_H=next_pow2(H), ZERO_CENTRED=zero_centred,
                                 num_warps=_warps_for(H))
    dw = dwp.sum(0).to(weight.dtype)
    return dx, dw


# ---------------------------------------------------------------------------------------------
# Dispatcher and autograd
# ---------------------------------------------------------------------------------------------


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centred=False):
        x2 = _rows(x)
        if want_triton(x2):
            out, rstd = _triton_fwd(x2, weight, eps, zero_centred)
        else:
            out, rstd = _ref_fwd(x2, weight, eps, zero_centred)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        ctx.zero_centred = zero_centred
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = _rows(dy)
        if want_triton(x2):
            dx, dw = rms_norm_backward_triton(dy2, x2, weight, rstd, ctx.zero_centred)
        else:
            dx, dw = rms_norm_backward_reference(dy2, x2, weight, rstd, ctx.zero_centred)
        return dx.reshape(ctx.x_shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, zero_centred: bool = False) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim (Triton on CUDA, reference elsewhere);
    differentiable. Rounding schedule: module docstring (``zero_centred``: weight is an offset
    from 1, Qwen3.5 style)."""
    _check(x, weight)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(x, weight, eps, zero_centred)
    x2 = _rows(x)
    if want_triton(x2):
        out, _ = _triton_fwd(x2, weight, eps, zero_centred)
    else:
        out, _ = _ref_fwd(x2, weight, eps, zero_centred)
    return out.reshape(x.shape)
