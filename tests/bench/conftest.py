"""Shared helper of the benchmark format tests (fixture ``ratio_of_rounded``)."""

import math

import pytest


def _ratio_of_rounded(num_ms: float, den_ms: float, ratio: float) -> bool:
    """Whether ``ratio`` (written rounded to 4 decimals) is num/den for some timings that round to
    ``num_ms`` and ``den_ms`` (written rounded to 6 decimals, isoexec.bench.common.row): the
    check allows exactly what rounding allows, so it holds whatever the timings were."""
    h, r = 0.5e-6, 0.5e-4
    lo = (num_ms - h) / (den_ms + h)
    hi = (num_ms + h) / (den_ms - h) if den_ms > h else math.inf
    return lo - r - 1e-12 <= ratio <= hi + r + 1e-12


@pytest.fixture
def ratio_of_rounded():
    return _ratio_of_rounded
