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

from . import _ref
from ._triton_util import jit, tl, want_triton

__all__ = [
    "silu_and_mul",
    "silu_and_mul_reference",
    "silu_and_mul_triton",
    "IMPL_REFERENCE",
    "IMPL_TRITON",
]

IMPL_REFERENCE = "ref_silu_mul"
IMPL_TRITON = "triton_silu_mul"
_BLOCK = 1024


def _split(gate, up):
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(
                f"silu_and_mul: concatenated gate_up must have an even last dim, got {gate.shape}"
            )
        i = gate.shape[-1] // 2
        return gate[..., :i], gate[..., i:], True
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"silu_and_mul: gate {tuple(gate.shape)}/{gate.dtype} and up "
            f"{tuple(up.shape)}/{up.dtype} must match"
        )
    return gate, up, False


def _sigmoid_ref(g: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid of fp32 ``g`` via float64 basic ops (position-free)."""
    g64 = g.double()
    return (1.0 / (1.0 + _ref.exp64(-g64))).float()


def _silu_ref(g: torch.Tensor) -> torch.Tensor:
    g64 = g.double()
    return (g64 / (1.0 + _ref.exp64(-g64))).float()


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` by the reference schedule (module docstring)."""
    g, u, _ = _split(gate, up)
    return (_silu_ref(g.float()) * u.float()).to(g.dtype)


@jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g_raw = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(g_raw.dtype), mask=ok)


@jit
def _silu_mul_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, stride_dy, stride_g,
                         stride_u, stride_dg, stride_du, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g_raw = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    s = g / (1.0 + tl.exp(-g))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + row * stride_dg + cols, dg.to(g_raw.dtype), mask=ok)
    tl.store(du_ptr + row * stride_du + cols, (dy * s).to(g_raw.dtype), mask=ok)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _triton_fwd(g, u):
    shape = g.shape
    g2, u2 = _as_rows(g), _as_rows(u)
    R, C = g2.shape
    out = torch.empty((R, C), dtype=g.dtype, device=g.device)
    if R and C:
        grid = (R, (C + _BLOCK - 1) // _BLOCK)
        _silu_mul_kernel[grid](g2, u2, out, C, g2.stride(0), u2.stride(0), out.stride(0),
                               BLOCK=_BLOCK, num_warps=4)
    return out.reshape(shape)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` in Triton (module docstring). CUDA, or CPU under the interpreter."""
    g, u, _ = _split(gate, up)
    return _triton_fwd(g, u)


def _bwd_reference(dy, g, u):
    gf, uf, dyf = g.float(), u.float(), dy.float()
    sig = _sigmoid_ref(gf)
    s = _silu_ref(gf)
    dg = dyf * uf * sig * (1.0 + gf * (1.0 - sig))
    return dg.to(g.dtype), (dyf * s).to(u.dtype)


def _bwd_triton(dy, g, u):
    shape = g.shape
    dy2, g2, u2 = _as_rows(dy), _as_rows(g), _as_rows(u)
    R, C = g2.shape
    dg = torch.empty((R, C), dtype=g.dtype, device=g.device)
    du = torch.empty((R, C), dtype=u.dtype, device=g.device)
    if R and C:
        grid = (R, (C + _BLOCK - 1) // _BLOCK)
        _silu_mul_bwd_kernel[grid](dy2, g2, u2, dg, du, C, dy2.stride(0), g2.stride(0),
                                   u2.stride(0), dg.stride(0), du.stride(0), BLOCK=_BLOCK,
                                   num_warps=4)
    return dg.reshape(shape), du.reshape(shape)


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
