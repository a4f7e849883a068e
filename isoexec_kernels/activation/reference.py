"""SwiGLU activation: the fixed-order torch twin (runs on any device; the CPU path of the public API).
The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


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
    """``silu(gate) * up`` by the reference schedule (api.py's docstring)."""
    g, u, _ = _split(gate, up)
    return (_silu_ref(g.float()) * u.float()).to(g.dtype)


def _bwd_reference(dy, g, u):
    gf, uf, dyf = g.float(), u.float(), dy.float()
    sig = _sigmoid_ref(gf)
    s = _silu_ref(gf)
    dg = dyf * uf * sig * (1.0 + gf * (1.0 - sig))
    return dg.to(g.dtype), (dyf * s).to(u.dtype)
