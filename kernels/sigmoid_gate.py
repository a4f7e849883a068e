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

from . import _ref
from ._triton_util import jit, tl, want_triton

__all__ = ["sigmoid_gate", "sigmoid_gate_reference", "sigmoid_gate_triton", "IMPL"]

IMPL = "sigmoid_gate_fp32"
_BLOCK = 1024


def _check(x, gate):
    if x.shape != gate.shape:
        raise ValueError(f"sigmoid_gate: x {tuple(x.shape)} and gate {tuple(gate.shape)} must match")


def _sigmoid_ref(g):
    return (1.0 / (1.0 + _ref.exp64(-g.double()))).float()


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    _check(x, gate)
    return (x.float() * _sigmoid_ref(gate.float())).to(x.dtype)


@jit
def _gate_kernel(x_ptr, g_ptr, out_ptr, n_cols, stride_x, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    xr = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_o + cols, (xr.to(tl.float32) * s).to(xr.dtype), mask=ok)


def _as_rows(t):
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def sigmoid_gate_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """By the Triton schedule. CUDA, or CPU under the interpreter."""
    _check(x, gate)
    x2, g2 = _as_rows(x), _as_rows(gate)
    R, C = x2.shape
    out = torch.empty((R, C), dtype=x.dtype, device=x.device)
    if R and C:
        _gate_kernel[(R, -(-C // _BLOCK))](x2, g2, out, C, x2.stride(0), g2.stride(0), out.stride(0),
                                          BLOCK=_BLOCK, num_warps=4)
    return out.reshape(x.shape)


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
