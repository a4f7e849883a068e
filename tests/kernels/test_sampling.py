"""The fused Gumbel-max sampling kernel (isoexec_kernels/sampling/): its reference twin on CPU, the
Triton kernel under the interpreter and on CUDA. A row's token depends only on (its logits,
temperature, cut, key), the kernel agrees with its twin except at near-ties, and the choice
follows the tempered softmax restricted to the cut."""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import _ref, sampling


def _lowbias32_py(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def _rows(R, V, seed, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(R, V, generator=g) * scale).to(dtype)
    temp = torch.tensor([[0.0, 1.0, 0.6, 1.7][i % 4] for i in range(R)], dtype=torch.float32)
    cut = torch.full((R,), float("-inf"))
    cut[2::3] = 1.5                                       # some rows restricted to z >= 1.5
    keys = torch.randint(0, 2 ** 32, (R,), generator=g, dtype=torch.int64)
    return z, temp, cut, keys


def _ref_scores(z, temp, cut, keys):
    """The reference's scores, to tell a near-tie from a real disagreement."""
    u = sampling.noise_uniform(keys, z.shape[1]).double()
    g = (-_ref.log64(-_ref.log64(u))).float()
    zt = z.float()
    s = torch.where(temp[:, None] > 0, zt / torch.where(temp > 0, temp, 1.0)[:, None] + g, zt)
    return torch.where(zt >= cut[:, None], s, torch.full_like(s, float("-inf")))


def _assert_same_or_near_tie(got, want, scores, what):
    for r in torch.nonzero(got != want).flatten().tolist():
        a, b = float(scores[r, got[r]]), float(scores[r, want[r]])
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{what}: row {r} chose {int(got[r])} ({a}) not {int(want[r])} ({b})"


def test_hash_and_uniforms_are_exact_32bit_arithmetic():
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789, 0xDEADBEEF]
    t = sampling.mix32(torch.tensor(xs, dtype=torch.int64))
    assert t.tolist() == [_lowbias32_py(x) for x in xs] == [sampling.mix32(x) for x in xs]
    keys = torch.tensor([0, 0xFFFFFFFF, 77], dtype=torch.int64)
    u = sampling.noise_uniform(keys, 4096)
    h = [[_lowbias32_py(k ^ _lowbias32_py(v ^ 0x9E3779B9)) for v in (0, 5, 4095)] for k in (0, 0xFFFFFFFF, 77)]
    want = torch.tensor([[((x >> 9) + 0.5) * 2.0 ** -23 for x in row] for row in h], dtype=torch.float64)
    assert torch.equal(u[:, [0, 5, 4095]].double(), want)            # 23 bits + 0.5: exact in fp32
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.double().mean()) - 0.5) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_row_alone_equals_row_in_batch(dtype):
    z, temp, cut, keys = _rows(37, 3000, 1, dtype=dtype)
    full = sampling.gumbel_argmax_reference(z, temp, cut, keys)
    alone = torch.cat([sampling.gumbel_argmax_reference(z[i:i + 1], temp[i:i + 1], cut[i:i + 1], keys[i:i + 1])
                       for i in range(37)])
    assert torch.equal(full, alone)
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sampling.gumbel_argmax_reference(z[perm], temp[perm], cut[perm], keys[perm]), full[perm])
    assert bool((z.float()[torch.arange(37), full] >= cut).all())          # never outside the cut
    greedy = temp == 0
    want = torch.argmax(torch.where(z.float() >= cut[:, None], z.float(), torch.tensor(float("-inf"))), -1)
    assert torch.equal(full[greedy], want[greedy])


def test_reference_samples_follow_the_tempered_softmax():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n, T = 20000, 0.8
    toks = sampling.gumbel_argmax_reference(row.expand(n, 6), torch.full((n,), T), torch.full((n,), float("-inf")),
                                            torch.arange(n, dtype=torch.int64) * 2654435761 % 2 ** 32)
    freq = torch.bincount(toks, minlength=6).double() / n
    want = torch.softmax(row.double() / T, -1)
    assert float((freq - want).abs().max()) < 0.015, (freq, want)


# --------------------------------------------------------------------------- Triton (interpreter)


def interp_case_sampling_triton_matches_reference_and_is_row_invariant(kb):
    for V in (5000, 700):        # stretches with several steps and a partial one; empty stretches
        z, temp, cut, keys = _rows(9, V, V)
        got = sampling.gumbel_argmax_triton(z, temp, cut, keys)
        want = sampling.gumbel_argmax_reference(z, temp, cut, keys)
        _assert_same_or_near_tie(got, want, _ref_scores(z, temp, cut, keys), f"V={V}")
        greedy = temp == 0
        assert torch.equal(got[greedy], want[greedy])
        for i in (0, 4, 8):
            alone = sampling.gumbel_argmax_triton(z[i:i + 1], temp[i:i + 1], cut[i:i + 1], keys[i:i + 1])
            assert int(alone[0]) == int(got[i]), (V, i)
    tie = torch.zeros(2, 3000)
    tie[:, [2100, 40, 2999]] = 5.0                         # equal maxima in different stretches
    out = sampling.gumbel_argmax_triton(tie, torch.zeros(2), torch.full((2,), float("-inf")), torch.zeros(2, dtype=torch.int64))
    assert out.tolist() == [40, 40]


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_sampling_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_sampling", case)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_sampling_cuda_row_alone_equals_row_in_batch_and_agrees_with_the_reference():
    V = 151936
    z, temp, cut, keys = _rows(64, V, 5, dtype=torch.bfloat16)
    zc, tc, cc, kc = z.cuda(), temp.cuda(), cut.cuda(), keys.cuda()
    got = sampling.gumbel_argmax(zc, tc, cc, kc)
    assert torch.equal(got, sampling.gumbel_argmax(zc, tc, cc, kc))          # run to run
    for i in (0, 1, 2, 37, 63):
        alone = sampling.gumbel_argmax(zc[i:i + 1], tc[i:i + 1], cc[i:i + 1], kc[i:i + 1])
        assert int(alone[0]) == int(got[i]), i
    big = torch.cat([zc, zc.flip(0), zc])                                     # the rows elsewhere in a batch
    got3 = sampling.gumbel_argmax(big, tc.repeat(3), cc.repeat(3), kc.repeat(3))
    assert torch.equal(got3[128:], got) and torch.equal(got3[:64], got)
    want = sampling.gumbel_argmax_reference(z, temp, cut, keys)
    _assert_same_or_near_tie(got.cpu(), want, _ref_scores(z, temp, cut, keys), "cuda vs reference")


@pytest.mark.gpu
def test_sampling_cuda_follows_the_tempered_softmax():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n, T = 200000, 0.8
    toks = sampling.gumbel_argmax(row.expand(n, 6).cuda(), torch.full((n,), T, device="cuda"),
                                  torch.full((n,), float("-inf"), device="cuda"),
                                  (torch.arange(n, dtype=torch.int64) * 2654435761 % 2 ** 32).cuda())
    freq = torch.bincount(toks.cpu(), minlength=6).double() / n
    assert float((freq - torch.softmax(row.double() / T, -1)).abs().max()) < 0.005
