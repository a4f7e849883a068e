"""SwiGLU activation: the stock twin, ``F.silu(gate) * up`` (the native composition and the negative
control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_native(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    if up is None:
        i = gate.shape[-1] // 2
        gate, up = gate[..., :i], gate[..., i:]
    return F.silu(gate) * up
