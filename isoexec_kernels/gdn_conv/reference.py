"""Gated DeltaNet short convolution: the fixed-order torch twin (runs on any device; the CPU path of
the public API). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


_GRAD_ROW_LEAF = 64


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
