"""Sigmoid output gate: the stock twin, ``x * torch.sigmoid(gate)`` (the native composition and the
negative control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch


def sigmoid_gate_native(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)
