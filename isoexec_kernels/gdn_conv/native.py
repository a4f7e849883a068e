"""Gated DeltaNet short convolution: the stock twin, ``F.conv1d`` per sequence + SiLU (the native
composition and the negative control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._empty import no_token


def _conv_silu(window: torch.Tensor, weight: torch.Tensor, keep: int) -> torch.Tensor:
    """window [1 or B, D, L] -> the last ``keep`` outputs of a valid depthwise conv, SiLU'd."""
    D, W = weight.shape
    out = F.conv1d(window.to(weight.dtype), weight[:, None, :], groups=D)
    return F.silu(out[..., out.shape[-1] - keep:])


def conv1d_native_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    D, W = weight.shape
    if x.shape[0] == 0:   # no token (an FSDP2 rank's empty pass): x and the weight get zero gradients
        return no_token(x.shape, x.dtype, x, weight)
    cu = [int(c) for c in cu_seqlens.tolist()]
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        seq = F.pad(x[s:e].t()[None], (W - 1, 0))
        outs.append(_conv_silu(seq, weight, e - s)[0].t())
    return torch.cat(outs).to(x.dtype) if outs else x.new_empty(x.shape)


@torch.no_grad()
def conv1d_native_engine(x: torch.Tensor, weight: torch.Tensor, cu_seqlens_q: torch.Tensor, slots: torch.Tensor,
                         conv_state: torch.Tensor) -> torch.Tensor:
    D, W = weight.shape
    cu = [int(c) for c in cu_seqlens_q.tolist()]
    outs = []
    for b, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        slot = int(slots[b])
        window = torch.cat([conv_state[slot].to(x.dtype), x[s:e].t()], dim=-1)[None]
        outs.append(_conv_silu(window, weight, e - s)[0].t())
        conv_state[slot] = window[0, :, window.shape[-1] - (W - 1):].to(conv_state.dtype)
    return torch.cat(outs).to(x.dtype) if outs else x.new_empty(x.shape)


@torch.no_grad()
def conv1d_native_decode(x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                         conv_state: torch.Tensor) -> torch.Tensor:
    sl = slots.long()
    window = torch.cat([conv_state[sl].to(x.dtype), x[:, :, None]], dim=-1)
    conv_state[sl] = window[..., 1:].to(conv_state.dtype)
    return _conv_silu(window, weight, 1)[..., 0].to(x.dtype)
