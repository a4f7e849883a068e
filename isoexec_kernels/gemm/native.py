"""The linear layer: the stock twin, ``torch.nn.functional.linear`` (cuBLAS / CPU BLAS) (the native
composition and the negative control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None):
    """``F.linear``; with ``residual``, ``residual + x @ weight.T`` as one cuBLAS ``addmm``
    (the residual taken into the GEMM's epilogue, the fastest stock form) when there is no bias."""
    if residual is None:
        return F.linear(x, weight, bias)
    if bias is None:
        N, K = weight.shape
        out = torch.addmm(residual.reshape(-1, N), x.reshape(-1, K), weight.t())
        return out.reshape(residual.shape)
    return residual + F.linear(x, weight, bias)
