"""Sampler: a token depends only on (logits row, params, seed, request id, position)."""

import math

import pytest
import torch

from isoexec.engine import SamplingParams, Sampler
from isoexec.engine.sampler import p_fixed, row_key, row_keys, support_cut
from isoexec.gates.compare import compare_bits
from isoexec_kernels.logprob import token_logprobs

V = 96


def _logits(rows, seed=0, dtype=torch.float32, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, V, generator=g) * scale).to(dtype)


def test_row_keys_are_row_key_of_each_row():
    seeds = [0, 1, 2 ** 63 - 1, 12345678901234]
    rids = [0, 2 ** 40, 7, 2 ** 63 - 5]
    pos = [0, 10 ** 6, 3, 2 ** 31 + 7]
    assert row_keys(seeds, rids, pos).tolist() == [row_key(s, r, p) for s, r, p in zip(seeds, rids, pos)]
    assert all(0 <= k < 2 ** 32 for k in row_keys(seeds, rids, pos).tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_seed_request_position_gives_same_token_whatever_the_batch(dtype):
    s = Sampler()
    logits = _logits(40, 1, dtype)
    params = [SamplingParams(temperature=0.5 + 0.05 * (i % 20), top_k=[0, 5, 40][i % 3],
                             top_p=[1.0, 0.9, 0.6][i % 3 - 1], seed=11 + i % 3) for i in range(40)]
    rids = [1000 + i for i in range(40)]
    pos = [7 * i % 50 for i in range(40)]
    full = s.choose(logits, params, rids, pos)
    alone = torch.stack([s.choose(logits[i:i + 1], params[i:i + 1], rids[i:i + 1], pos[i:i + 1])[0]
                         for i in range(40)])
    assert torch.equal(full, alone)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    shuffled = s.choose(logits[perm], [params[i] for i in perm], [rids[i] for i in perm], [pos[i] for i in perm])
    assert torch.equal(shuffled, full[perm])


def test_different_seeds_or_requests_or_positions_differ():
    s = Sampler()
    logits = torch.zeros(200, V)                       # uniform: the choice is all noise
    p = [SamplingParams(seed=1)] * 200
    base = s.choose(logits, p, [5] * 200, list(range(200)))
    other_seed = s.choose(logits, [SamplingParams(seed=2)] * 200, [5] * 200, list(range(200)))
    other_req = s.choose(logits, p, [6] * 200, list(range(200)))
    assert (base != other_seed).float().mean() > 0.9
    assert (base != other_req).float().mean() > 0.9
    assert len(set(base.tolist())) > 60                # positions draw different tokens


def test_greedy_is_argmax_first_index_on_ties():
    s = Sampler()
    logits = _logits(8, 2)
    logits[3, 10] = logits[3, 50] = logits[3].max() + 1.0       # a tie: the lower id wins
    tok = s.choose(logits, [SamplingParams(temperature=0.0, seed=i) for i in range(8)], list(range(8)), [0] * 8)
    assert torch.equal(tok, torch.argmax(logits, -1))
    assert int(tok[3]) == 10


def test_top_k_restricts_the_support_to_the_k_largest():
    s = Sampler()
    row = _logits(1, 4, scale=0.3)
    n = 600
    tok = s.choose(row.expand(n, V), [SamplingParams(top_k=4, seed=9)] * n, [1] * n, list(range(n)))
    top4 = set(torch.topk(row[0], 4).indices.tolist())
    assert set(tok.tolist()) == top4


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    s = Sampler()
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = torch.full((1, V), -1e4)
    row[0, [7, 3, 60, 11]] = probs.log()
    n = 600
    for p, want in [(0.45, {7}), (0.7, {7, 3}), (0.85, {7, 3, 60}), (1.0, {7, 3, 60, 11})]:
        tok = s.choose(row.expand(n, V), [SamplingParams(top_p=p, seed=4)] * n, [2] * n, list(range(n)))
        assert set(tok.tolist()) == want, p


def test_support_cut_keeps_ties_at_the_cut():
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [3.0, 1.0, 2.0, 2.0, 0.0]])
    one = torch.tensor([1.0, 1.0])
    cut = support_cut(z, one, torch.tensor([2, 0]), torch.tensor([p_fixed(1.0), p_fixed(0.5)]))
    assert cut.tolist() == [2.0, 3.0]          # top-2 keeps both 2.0s; p = 0.5 keeps the 3.0 alone


def test_plan_knows_on_the_host_whether_any_row_has_top_p_and_the_cut_is_the_same():
    s = Sampler()
    z = _logits(6, seed=8)
    mixed = [SamplingParams(top_k=5, seed=1), SamplingParams(top_p=0.8, seed=1), SamplingParams(seed=1)] * 2
    only_k = [SamplingParams(top_k=5, seed=1), SamplingParams(seed=1)] * 3
    for params, want in ((mixed, True), (only_k, False)):
        plan = s.plan(params, list(range(6)), [3] * 6, z.device)
        assert plan.any_top_p is want
        f = plan.filtered
        told = support_cut(z[f], plan.temperature[f], plan.top_k, plan.top_p_fix, plan.any_top_p)
        read = support_cut(z[f], plan.temperature[f], plan.top_k, plan.top_p_fix)   # reads the device
        assert torch.equal(told, read)


def test_support_cut_row_alone_equals_row_in_batch():
    g = torch.Generator().manual_seed(6)
    z = torch.randn(23, 5000, generator=g) * 4
    temp = torch.rand(23, generator=g) + 0.3
    k = torch.tensor([[0, 7, 300][i % 3] for i in range(23)])
    p = torch.tensor([p_fixed([1.0, 0.9, 0.35, 0.999][i % 4]) for i in range(23)])
    full = support_cut(z, temp, k, p)
    alone = torch.cat([support_cut(z[i:i + 1], temp[i:i + 1], k[i:i + 1], p[i:i + 1]) for i in range(23)])
    assert torch.equal(full, alone)


def test_sampling_follows_the_tempered_softmax():
    s = Sampler()
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    T, n = 0.8, 20000
    tok = s.choose(row.expand(n, 6), [SamplingParams(temperature=T, seed=17)] * n, [3] * n, list(range(n)))
    freq = torch.bincount(tok, minlength=6).double() / n
    want = torch.softmax(row[0].double() / T, -1)
    assert float((freq - want).abs().max()) < 0.015, (freq, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_untempered_and_come_from_the_logprob_region(dtype):
    s = Sampler()
    logits = _logits(6, 5, dtype)
    params = [SamplingParams(temperature=t, top_k=k, seed=1, logprobs=3) for t, k in
              [(0.0, 0), (0.3, 0), (1.0, 5), (2.0, 0), (0.7, 2), (1.0, 0)]]
    out = s(logits, params, list(range(6)), [4] * 6, token_logprobs)
    assert out.logprobs.dtype == torch.float32
    assert compare_bits(out.logprobs, token_logprobs(logits, out.tokens)).differing == 0
    ref = torch.log_softmax(logits.double(), -1)[torch.arange(6), out.tokens]
    assert float((out.logprobs.double() - ref).abs().max()) < 1e-5
    for r in range(6):
        ids, lps = out.top[r]
        assert ids == torch.sort(logits[r].double(), descending=True, stable=True).indices[:3].tolist()
        assert lps == sorted(lps, reverse=True)
        assert all(math.isfinite(x) for x in lps)
        want = token_logprobs(logits[r:r + 1].expand(3, V).contiguous(), torch.tensor(ids))
        assert compare_bits(torch.tensor(lps), want).differing == 0
    assert out.top[0][0][0] == int(out.tokens[0])          # greedy picks the top-1 candidate
    assert compare_bits(torch.tensor(out.top[0][1][:1]), out.logprobs[:1]).differing == 0
