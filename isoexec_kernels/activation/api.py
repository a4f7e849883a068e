"""SwiGLU gate: ``silu(gate) * up``, elementwise and therefore batch invariant once each element
is a pure function of its inputs.

Public API
  ``silu_and_mul(gate, up=None)``        dispatcher (CUDA -> Triton, else reference),
                                          differentiable
  ``silu_and_mul_reference(gate, up)``   torch twin
  ``silu_and_mul_triton(gate, up)``      Triton twin
Two calling forms: ``silu_and_mul(gate, up)`` with two tensors of the same shape, or
``silu_and_mul(gate_up)`` with one concatenated ``[..., 2I]`` tensor whose first half is the
gate and second half the up projection (the layout of a fused gate_up weight).

Rounding schedule (per element)
  g, u = fp32(gate), fp32(up); s = silu(g) = g / (1 + exp(-g)) evaluated in fp32 precision;
  out = round_to_dtype(s * u) (one fp32 product, one final rounding). transformers instead
  rounds silu(gate) to the model dtype before the product.
  * reference (impl ``ref_silu_mul``): silu evaluated in float64 from basic operations
    (``_ref.exp64``) and rounded once to fp32 -- stock torch ``silu``/``sigmoid`` on CPU
    give different bits for the same value at different tensor positions (SIMD body vs
    scalar tail), so they are not used.
  * Triton (impl ``triton_silu_mul``): ``g / (1 + exp(-g))`` with Triton's fp32 exp.
Backward (both paths, in fp32): sig = 1 / (1 + exp(-g)); d_gate = dy * u * sig * (1 + g * (1 -
sig)); d_up = dy * s; each rounded to the input dtype.
"""

from __future__ import annotations

import torch

from .._triton_util import want_triton
from .reference import _bwd_reference, _silu_ref, _split
from .triton_kernels import _bwd_triton, _triton_fwd


class _SiluMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        if want_triton(g):
            return _triton_fwd(g, u)
        return (_silu_ref(g.float()) * u.float()).to(g.dtype)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        if want_triton(g):
            return _bwd_triton(dy, g, u)
        return _bwd_reference(dy, g, u)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``silu(gate) * up`` (or of a concatenated ``[..., 2I]`` gate_up);
    Triton on CUDA, reference elsewhere; differentiable."""
    g, u, _ = _split(gate, up)
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _SiluMulFn.apply(g, u)
    if want_triton(g):
        return _triton_fwd(g, u)
    return (_silu_ref(g.float()) * u.float()).to(g.dtype)
