"""The stock path of the hybrid family's small ops: the torch formulas transformers' Qwen3.5 code
uses, with the signatures of the invariant kernels (native composition, negative controls).
No promise about reduction order or about an element's bits being independent of its position.

  ``conv1d_native_varlen(x, weight, cu_seqlens)``                    F.conv1d per sequence + SiLU
  ``conv1d_native_engine(x, weight, cu_seqlens_q, slots, conv_state)``  same, continuing a window
  ``conv1d_native_decode(x, weight, slots, conv_state)``             one token per sequence
  ``gdn_prep_native(q, k, a, b, A_log, dt_bias, eps=1e-6)``          rsqrt l2norm, softplus, sigmoid
  ``gated_rms_norm_native(x, gate, weight, eps=1e-6)``               Qwen3_5RMSNormGated's formula
  ``sigmoid_gate_native(x, gate)``                                   x * torch.sigmoid(gate)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "conv1d_native_varlen",
    "conv1d_native_engine",
    "conv1d_native_decode",
    "gdn_prep_native",
    "gated_rms_norm_native",
    "sigmoid_gate_native",
]


def _conv_silu(window: torch.Tensor, weight: torch.Tensor, keep: int) -> torch.Tensor:
    """window [1 or B, D, L] -> the last ``keep`` outputs of a valid depthwise conv, SiLU'd."""
    D, W = weight.shape
    out = F.conv1d(window.to(weight.dtype), weight[:, None, :], groups=D)
    return F.silu(out[..., out.shape[-1] - keep:])


def conv1d_native_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    D, W = weight.shape
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


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(dim=-1, keepdim=True) + eps)


def gdn_prep_native(q, k, a, b, A_log, dt_bias, eps: float = 1e-6):
    qn = _l2norm(q, eps) * (q.shape[-1] ** -0.5)
    kn = _l2norm(k, eps)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.sigmoid().float()
    return qn, kn, g, beta


def gated_rms_norm_native(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


def sigmoid_gate_native(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)
