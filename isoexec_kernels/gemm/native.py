"""The linear layer: the stock twin, ``torch.nn.functional.linear`` (cuBLAS / CPU BLAS) (the native
composition and the negative control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    return F.linear(x, weight, bias)
