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

from .. import _ref
from .._triton_util import want_triton
from .reference import _acc_ref, _check, _GRAD_ROW_LEAF, _sigmoid_ref, causal_conv1d_reference, conv_windows_reference
from .triton_kernels import causal_conv1d_triton


def _forward(x, weight, cu, slots=None, conv_state=None):
    if want_triton(x):
        return causal_conv1d_triton(x, weight, cu, slots, conv_state)
    return causal_conv1d_reference(x, weight, cu, slots, conv_state)


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
