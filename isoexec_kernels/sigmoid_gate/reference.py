"""Sigmoid output gate: the fixed-order torch twin (runs on any device; the CPU path of the public
API). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


def _check(x, gate):
    if x.shape != gate.shape:
        raise ValueError(f"sigmoid_gate: x {tuple(x.shape)} and gate {tuple(gate.shape)} must match")


def _sigmoid_ref(g):
    return (1.0 / (1.0 + _ref.exp64(-g.double()))).float()


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    _check(x, gate)
    return (x.float() * _sigmoid_ref(gate.float())).to(x.dtype)
