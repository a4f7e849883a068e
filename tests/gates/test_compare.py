import torch

from isoexec.gates.compare import compare_bits, merge


def test_signed_zero_counts_as_a_difference():
    a = torch.tensor([0.0, 1.0])
    b = torch.tensor([-0.0, 1.0])
    assert torch.equal(a, b)  # the float comparison misses it ...
    r = compare_bits(a, b)     # ... the integer view does not
    assert (r.differing, r.first_index, r.max_ulp) == (1, [0], 0)


def test_nan_equals_itself_bitwise():
    a = torch.tensor([float("nan"), 2.0])
    assert not torch.equal(a, a.clone())
    assert compare_bits(a, a.clone()).differing == 0


def test_ulp_distance_and_first_index_bf16():
    a = torch.ones(4, 3, dtype=torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[2, 1] += 3
    r = compare_bits(a, b)
    assert (r.compared, r.differing, r.max_ulp, r.first_index) == (12, 1, 3, [2, 1])
    assert float(r.max_abs_diff) > 0


def test_ulp_across_zero_fp32():
    a = torch.tensor([torch.finfo(torch.float32).tiny])
    b = -a
    assert compare_bits(a, b).max_ulp == 2 * int(a.view(torch.int32))


def test_merge_sums_counts():
    a = torch.zeros(5)
    b = a.clone()
    b[3] = 1.0
    m = merge([compare_bits(a, a), compare_bits(a, b)])
    assert (m["compared"], m["differing"], m["first_index"], m["comparisons"]) == (10, 1, [3], 2)
