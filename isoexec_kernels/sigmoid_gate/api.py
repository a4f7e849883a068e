"""Output gate of gated attention: ``x * sigmoid(gate)``, elementwise.

Public API
  ``sigmoid_gate(x, gate)``             dispatcher (CUDA -> Triton, else reference), differentiable
  ``sigmoid_gate_reference(x, gate)`` / ``sigmoid_gate_triton(x, gate)``

Rounding schedule (per element): out = round_to_x_dtype(fp32(x) * sigmoid(fp32(gate))), one
fp32 product and one final rounding (transformers rounds sigmoid(gate) to the model dtype first).
  * reference (CPU): sigmoid = fp32(1 / (1 + exp64(-g))) in float64 from basic operations
    (stock CPU sigmoid bits depend on an element's tensor position);
  * Triton (CUDA): 1 / (1 + exp(-g)) with Triton's fp32 exp.
Backward (both paths): s = sigmoid(g); dx = dy * s; dgate = dy * x * s * (1 - s) (fp32, rounded
to the input dtypes).
"""

from __future__ import annotations

import torch

from .._triton_util import want_triton
from .reference import _check, sigmoid_gate_reference
from .triton_kernels import sigmoid_gate_triton


def _forward(x, gate):
    if want_triton(x):
        return sigmoid_gate_triton(x, gate)
    return sigmoid_gate_reference(x, gate)


class _SigmoidGateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate):
        ctx.save_for_backward(x, gate)
        return _forward(x, gate)

    @staticmethod
    def backward(ctx, dy):
        x, gate = ctx.saved_tensors
        s = torch.sigmoid(gate.float())
        dyf = dy.float()
        return (dyf * s).to(x.dtype), (dyf * x.float() * s * (1.0 - s)).to(gate.dtype)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``x * sigmoid(gate)``; Triton on CUDA, reference elsewhere; differentiable."""
    _check(x, gate)
    if torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad):
        return _SigmoidGateFn.apply(x, gate)
    return _forward(x, gate)
