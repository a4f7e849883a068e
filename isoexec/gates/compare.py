"""Bitwise comparison of tensors through their integer views.

``torch.equal`` on floats calls +0.0 and -0.0 equal and NaN unequal to itself, so it can both
miss and invent differences. Every gate compares integer views instead (``isoexec.bits``)
and reports the counts docs/gates.md asks for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..bits import INT_VIEW as _INT_VIEW
from ..bits import int_view
_SIGN = {torch.int16: 0x7FFF, torch.int32: 0x7FFFFFFF, torch.int64: 0x7FFFFFFFFFFFFFFF}


@dataclass(frozen=True)
class BitReport:
    compared: int
    differing: int
    max_abs_diff: str          # a decimal string: artifacts hold no raw floats
    max_ulp: int
    first_index: list[int] | None
    dtype: str

    @property
    def equal(self) -> bool:
        return self.differing == 0

    def as_dict(self) -> dict:
        return asdict(self)


def _ordered(v: torch.Tensor, dtype) -> torch.Tensor:
    """Map sign-magnitude float bits to integers ordered like the floats (for ULP distances)."""
    v = v.to(torch.int64)
    mag = v & _SIGN.get(_INT_VIEW.get(dtype, torch.int64), _SIGN[torch.int64])
    return torch.where(v < 0, -mag, mag)


def compare_bits(a: torch.Tensor, b: torch.Tensor) -> BitReport:
    """Element counts of bitwise differences between ``a`` and ``b`` (same shape and dtype)."""
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"dtype mismatch: {a.dtype} vs {b.dtype}")
    a, b = a.detach().cpu(), b.detach().cpu()
    ia, ib = int_view(a), int_view(b)
    neq = ia != ib
    differing = int(neq.sum())
    first = None
    max_abs = "0"
    max_ulp = 0
    if differing:
        first = [int(i) for i in torch.nonzero(neq)[0].tolist()]
        if a.dtype.is_floating_point:
            da, db = a[neq].double(), b[neq].double()
            d = (da - db).abs()
            finite = d[torch.isfinite(d)]
            max_abs = repr(float(finite.max())) if finite.numel() else "inf"
            if finite.numel() < d.numel():
                max_abs = "nan" if torch.isnan(d).any() else "inf"
            ulp = (_ordered(ia[neq], a.dtype) - _ordered(ib[neq], a.dtype)).abs()
            max_ulp = int(ulp.max())
        else:
            max_abs = str(int((ia[neq].long() - ib[neq].long()).abs().max()))
            max_ulp = 0
    return BitReport(compared=int(a.numel()), differing=differing, max_abs_diff=max_abs, max_ulp=max_ulp,
                     first_index=first, dtype=str(a.dtype).replace("torch.", ""))


def merge(reports: list[BitReport]) -> dict:
    """Sum of several comparisons (the counts a gate artifact carries)."""
    out = {"compared": 0, "differing": 0, "max_abs_diff": "0", "max_ulp": 0, "first_index": None, "comparisons":
           len(reports)}
    best = 0.0
    for r in reports:
        out["compared"] += r.compared
        out["differing"] += r.differing
        out["max_ulp"] = max(out["max_ulp"], r.max_ulp)
        if r.differing and out["first_index"] is None:
            out["first_index"] = r.first_index
        try:
            v = float(r.max_abs_diff)
        except ValueError:
            v = float("inf")
        if v > best or (r.max_abs_diff in ("nan", "inf") and out["max_abs_diff"] not in ("nan",)):
            best = v
            out["max_abs_diff"] = r.max_abs_diff
    return out
