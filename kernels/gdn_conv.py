"""Gated DeltaNet short convolution: depthwise causal conv1d over packed tokens, then SiLU.

Public API (one function per case; the registry binds them per case)
  ``causal_conv1d_varlen(x, weight, cu_seqlens)``                 trainer, differentiable
  ``causal_conv1d_engine(x, weight, cu_seqlens_q, slots, conv_state)``  engine prefill
  ``causal_conv1d_decode(x, weight, slots, conv_state)``           engine decode (one token each)
  ``conv_windows_reference(...)`` / ``causal_conv1d_reference(...)`` / ``causal_conv1d_triton(...)``

Shapes
  x [T, D] packed tokens (any row stride, unit column stride after ``contiguous`` of the rows),
  weight [D, W] (W taps, no bias; transformers' ``conv1d.weight[D, 1, W]`` squeezed),
  cu_seqlens [B+1] int (sequence b owns rows cu[b]:cu[b+1]),
  conv_state [S, D, W-1] per-slot window: the last W-1 inputs of the slot's sequence (zeros for
  a fresh sequence; dtype x.dtype or fp32 so a stored input reads back exactly),
  slots [B] int: the state slot of sequence b.

Semantics: out[t, d] = silu(sum_j weight[d, j] * x[t - (W-1) + j, d]) where inputs before the
first token of t's sequence come from that sequence's window (engine) or are +0 (trainer; the
engine's window of a fresh sequence holds +0 too). The engine updates the window of every slot in
``slots`` in place after reading it (the last W-1 inputs of old window ++ new tokens).

Rounding schedule (per output element; pinned, no constant to choose)
  taps t_j = fp32(input_j) * fp32(weight[d, j]) (each product rounded to fp32);
  acc = t_0; acc = acc + t_1; ...; acc = acc + t_{W-1}  (fp32, taps in increasing j, no FMA);
  out = round_to_x_dtype(silu(acc)), silu in fp32 precision:
  * reference (CPU): silu = fp32(a / (1 + exp64(-a))) in float64 from basic operations
    (``_ref.exp64``: stock CPU sigmoid/silu bits depend on an element's tensor position);
  * Triton (CUDA): the same products and sums compiled with ``enable_fp_fusion=False``;
    silu = acc / (1 + exp(-acc)) with Triton's fp32 exp (differs from the reference in the
    last bit sometimes; each path is invariant on its own).
  A token's output depends only on its W inputs, never on how its sequence was split into
  prefill chunks or what else is in the batch, so any split gives the same bits.

Backward (trainer only; torch ops, same code on every device): s = sigmoid(acc);
  dacc = dy * s * (1 + acc * (1 - s)); dx[u] = sum_j w[:, j] * dacc[u + W-1-j] (j = W-1 .. 0, in
  the sequence only); dweight[:, j] = sum over tokens of dacc * input_j by fixed 64-row leaves.
"""

from __future__ import annotations

import torch

from . import _ref
from ._triton_util import jit, next_pow2, tl, want_triton

__all__ = [
    "causal_conv1d_varlen",
    "causal_conv1d_engine",
    "causal_conv1d_decode",
    "causal_conv1d_reference",
    "causal_conv1d_triton",
    "conv_windows_reference",
    "update_conv_state",
    "IMPL",
]

IMPL = "conv_fixed_taps"
_GRAD_ROW_LEAF = 64
_BLOCK_D = 256


def _silu_ref(a: torch.Tensor) -> torch.Tensor:
    a64 = a.double()
    return (a64 / (1.0 + _ref.exp64(-a64))).float()


def _sigmoid_ref(a: torch.Tensor) -> torch.Tensor:
    return (1.0 / (1.0 + _ref.exp64(-a.double()))).float()


def _check(x, weight, conv_state=None):
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"gdn_conv: x must be [T, D] and weight [D, W]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if weight.shape[1] < 2:
        raise ValueError(f"gdn_conv: need at least 2 taps, got W={weight.shape[1]}")
    if conv_state is not None:
        D, W = weight.shape
        if conv_state.dim() != 3 or conv_state.shape[1:] != (D, W - 1):
            raise ValueError(f"gdn_conv: conv_state must be [S, D={D}, W-1={W - 1}], got "
                             f"{tuple(conv_state.shape)}")
        if conv_state.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"gdn_conv: conv_state dtype {conv_state.dtype} must be x's ({x.dtype}) or float32")


def _token_meta(T: int, cu: torch.Tensor, slots: torch.Tensor | None):
    """Per token: the row of its sequence's first token and its state slot (-1: zero history).
    Device ops only (no host sync)."""
    t = torch.arange(T, device=cu.device, dtype=torch.int64)
    cu64 = cu.to(torch.int64)
    seq = torch.searchsorted(cu64[1:].contiguous(), t, right=True)
    start = cu64[seq]
    if slots is None:
        slot = torch.full_like(t, -1)
    else:
        slot = slots.to(torch.int64)[seq]
    return start, slot


# ---------------------------------------------------------------------------------------------
# Reference twin
# ---------------------------------------------------------------------------------------------


def conv_windows_reference(x: torch.Tensor, W: int, cu_seqlens: torch.Tensor, slots: torch.Tensor | None = None,
                           conv_state: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 windows [T, W, D]: window[t, j] = the input at t - (W-1) + j (history from the
    slot's window, or +0). A gather: no arithmetic."""
    T, D = x.shape
    start, slot = _token_meta(T, cu_seqlens, slots)
    t = torch.arange(T, device=x.device, dtype=torch.int64)
    src = t[:, None] - (W - 1) + torch.arange(W, device=x.device)[None, :]          # [T, W]
    inside = src >= start[:, None]
    xv = x[src.clamp(min=0)].float()                                                 # [T, W, D]
    if conv_state is None:
        hist = torch.zeros_like(xv)
    else:
        hidx = ((W - 1) + (src - start[:, None])).clamp(0, W - 2)
        hist = conv_state[slot.clamp(min=0)[:, None], :, hidx].float()               # [T, W, D]
        hist = torch.where((slot >= 0)[:, None, None], hist, torch.zeros_like(hist))
    return torch.where(inside[..., None], xv, hist)


def _acc_ref(xw: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    wf = weight.float()
    acc = xw[:, 0] * wf[:, 0]
    for j in range(1, wf.shape[1]):
        acc = acc + xw[:, j] * wf[:, j]
    return acc


def causal_conv1d_reference(x, weight, cu_seqlens, slots=None, conv_state=None) -> torch.Tensor:
    """Outputs [T, D] by the reference schedule (no state update)."""
    _check(x, weight, conv_state)
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    xw = conv_windows_reference(x, weight.shape[1], cu_seqlens, slots, conv_state)
    return _silu_ref(_acc_ref(xw, weight)).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Triton twin
# ---------------------------------------------------------------------------------------------


@jit
def _conv_kernel(x_ptr, w_ptr, start_ptr, slot_ptr, state_ptr, out_ptr, D, stride_x, stride_o,
                 stride_ss, stride_sd, W: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    start = tl.load(start_ptr + t)
    slot = tl.load(slot_ptr + t)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j
        inside = src >= start
        xv = tl.load(x_ptr + src * stride_x + d, mask=ok & inside, other=0.0).to(tl.float32)
        if HAS_STATE:
            hidx = (W - 1) + (src - start)
            hv = tl.load(state_ptr + slot * stride_ss + d * stride_sd + hidx,
                         mask=ok & (src < start) & (slot >= 0), other=0.0).to(tl.float32)
            xv = tl.where(inside, xv, hv)
        wv = tl.load(w_ptr + d * W + j, mask=ok, other=0.0).to(tl.float32)
        if j == 0:
            acc = xv * wv
        else:
            acc = acc + xv * wv
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t * stride_o + d, y.to(out_ptr.dtype.element_ty), mask=ok)


def causal_conv1d_triton(x, weight, cu_seqlens, slots=None, conv_state=None) -> torch.Tensor:
    """Outputs [T, D] by the Triton schedule (no state update). CUDA, or CPU under the
    interpreter."""
    _check(x, weight, conv_state)
    T, D = x.shape
    W = weight.shape[1]
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return out
    x2 = x if x.stride(1) == 1 else x.contiguous()
    start, slot = _token_meta(T, cu_seqlens, slots)
    state = conv_state if conv_state is not None else out
    if conv_state is not None and conv_state.stride(2) != 1:
        raise ValueError("gdn_conv: conv_state must be contiguous in its last dim")
    block = min(_BLOCK_D, next_pow2(D))
    grid = (T, -(-D // block))
    _conv_kernel[grid](x2, weight.contiguous(), start, slot, state, out, D, x2.stride(0), out.stride(0),
                       state.stride(0) if conv_state is not None else 0,
                       state.stride(1) if conv_state is not None else 0,
                       W=W, HAS_STATE=conv_state is not None, BLOCK_D=block, num_warps=4,
                       enable_fp_fusion=False)
    return out


def _forward(x, weight, cu, slots=None, conv_state=None):
    if want_triton(x):
        return causal_conv1d_triton(x, weight, cu, slots, conv_state)
    return causal_conv1d_reference(x, weight, cu, slots, conv_state)


# ---------------------------------------------------------------------------------------------
# State update, autograd, dispatchers
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def update_conv_state(x: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                      conv_state: torch.Tensor) -> None:
    """Set each slot's window to the last W-1 inputs of (old window ++ its new tokens). A copy:
    no arithmetic. Device ops only."""
    B = slots.shape[0]
    if B == 0:
        return
    S, D, Wm1 = conv_state.shape
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    p = lens[:, None] - Wm1 + torch.arange(Wm1, device=cu.device)[None, :]          # [B, W-1]
    sl = slots.to(torch.int64)
    old = conv_state[sl]                                                             # [B, D, W-1]
    hidx = (Wm1 + p).clamp(0, Wm1 - 1)
    from_old = old.gather(2, hidx[:, None, :].expand(B, D, Wm1))
    if x.shape[0]:
        tok = (cu[:-1, None] + p).clamp(0, x.shape[0] - 1)
        from_x = x[tok].transpose(1, 2).to(conv_state.dtype)                         # [B, D, W-1]
        new = torch.where((p >= 0)[:, None, :], from_x, from_old)
    else:
        new = from_old
    conv_state[sl] = new


class _ConvVarlenFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cu):
        ctx.save_for_backward(x, weight, cu)
        return _forward(x, weight, cu)

    @staticmethod
    def backward(ctx, dy):
        x, weight, cu = ctx.saved_tensors
        T, D = x.shape
        W = weight.shape[1]
        xw = conv_windows_reference(x.detach(), W, cu)
        acc = _acc_ref(xw, weight)
        s = _sigmoid_ref(acc)
        dacc = dy.float() * s * (1.0 + acc * (1.0 - s))
        # dw [D, W]: a sum over tokens (deterministic, not batch invariant; one kernel on CUDA)
        dw = (dacc[:, None, :] * xw).sum(0).t() if x.is_cuda else torch.stack(
            [_ref.blocked_sum(dacc * xw[:, j], 0, _GRAD_ROW_LEAF) for j in range(W)], dim=1)
        # dx[u] = sum_j w[:, j] * dacc[u + W-1-j], only where u + W-1-j is in u's sequence
        cu64 = cu.to(torch.int64)
        t = torch.arange(T, device=x.device)
        seq = torch.searchsorted(cu64[1:].contiguous(), t, right=True)
        end = cu64[seq + 1]
        wf = weight.float()
        dx = torch.zeros((T, D), dtype=torch.float32, device=x.device)
        for j in reversed(range(W)):
            dst = t + (W - 1 - j)
            ok = dst < end
            term = torch.where(ok[:, None], dacc[dst.clamp(max=max(T - 1, 0))], torch.zeros_like(dacc))
            dx = dx + term * wf[:, j]
        return dx.to(x.dtype), dw.to(weight.dtype), None


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Trainer case: packed sequences, zero history at each sequence start; differentiable."""
    _check(x, weight)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _ConvVarlenFn.apply(x, weight, cu_seqlens)
    return _forward(x, weight, cu_seqlens)


@torch.no_grad()
def causal_conv1d_engine(x: torch.Tensor, weight: torch.Tensor, cu_seqlens_q: torch.Tensor, slots: torch.Tensor,
                         conv_state: torch.Tensor) -> torch.Tensor:
    """Engine prefill: sequence b's new tokens continue from window ``conv_state[slots[b]]``,
    which is then advanced in place."""
    _check(x, weight, conv_state)
    out = _forward(x, weight, cu_seqlens_q, slots, conv_state)
    update_conv_state(x, cu_seqlens_q, slots, conv_state)
    return out


@torch.no_grad()
def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                         conv_state: torch.Tensor) -> torch.Tensor:
    """Engine decode: one new token per sequence (x [B, D]); same arithmetic as the prefill."""
    cu = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    return causal_conv1d_engine(x, weight, cu, slots, conv_state)
