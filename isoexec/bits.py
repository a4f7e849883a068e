"""Floats compared bit for bit, through their integer views: the one comparison every gate,
metric and correction uses.

``torch.equal`` and ``==`` on floats call +0.0 and -0.0 equal and NaN unequal to itself, so they
can both miss and invent differences. Integer views (int16 for bf16/fp16, int32 for fp32, int64
for fp64) compare the bits themselves.
"""

from __future__ import annotations

import torch

INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}


def int_view(x: torch.Tensor) -> torch.Tensor:
    """The bits of a float tensor as integers of the same width (integer tensors unchanged)."""
    if x.dtype in INT_VIEW:
        return x.detach().contiguous().view(INT_VIEW[x.dtype])
    if x.dtype.is_floating_point:
        raise TypeError(f"no integer view for dtype {x.dtype}")
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bool: ``a`` and ``b`` (same shape, same dtype) have identical bits."""
    if a.dtype != b.dtype:
        raise ValueError(f"dtype mismatch: {a.dtype} vs {b.dtype}")
    return int_view(a) == int_view(b)


def count_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of ``a`` and ``b`` differ in their bits."""
    return int((~same_bits(a, b)).sum())
