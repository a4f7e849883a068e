"""isoexec/bits.py: the one bitwise comparison (integer views) that gates, RL metrics and the
trainer's corrections share."""

from __future__ import annotations

import pytest
import torch

from isoexec.bits import count_differing, int_view, same_bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_signed_zeros_differ_and_nan_equals_the_same_nan(dtype):
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=dtype)
    b = torch.tensor([-0.0, 1.0, float("nan"), 2.0], dtype=dtype)
    assert (a == b).tolist() == [True, True, False, True]          # what float == would say
    assert same_bits(a, b).tolist() == [False, True, True, True]   # what the bits say
    assert count_differing(a, b) == 1 and int_view(a).dtype.itemsize == a.dtype.itemsize


def test_a_one_ulp_change_is_counted_and_mixed_dtypes_are_refused():
    a = torch.randn(100)
    b = a.clone()
    b.view(torch.int32)[17] += 1
    assert count_differing(a, b) == 1 and count_differing(a, a.clone()) == 0
    with pytest.raises(ValueError, match="dtype mismatch"):
        same_bits(a, a.double())
    with pytest.raises(TypeError, match="no integer view"):
        int_view(torch.zeros(2, dtype=torch.float8_e4m3fn))   # a float without an integer view here
