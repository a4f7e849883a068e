"""Gates for token logprobs / log-softmax (isoexec_kernels/logprob/) and the position-free log."""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import _ref, logprob

BATCH_SIZES = (1, 2, 3, 5, 8, 16, 31, 64, 65, 100, 128, 129, 200, 256)


def _f64_logprobs(z, t):
    ls = torch.log_softmax(z.double(), dim=-1)
    return ls.gather(-1, t.long()[:, None])[:, 0]


def test_log64_is_accurate_and_handles_specials():
    y = torch.exp(torch.linspace(-700, 700, 20001, dtype=torch.float64))
    assert (_ref.log64(y) - torch.log(y)).abs().max() < 1e-12
    sp = _ref.log64(torch.tensor([0.0, 1.0, float("inf"), -1.0], dtype=torch.float64))
    assert sp[0] == -float("inf") and sp[1] == 0 and sp[2] == float("inf") and torch.isnan(sp[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [1, 7, 1000, 1024, 3001])
def test_logprobs_match_float64(kb, dtype, V):
    g = torch.Generator().manual_seed(V)
    z = (torch.randn(6, V, generator=g) * 3).to(dtype)
    t = torch.randint(0, V, (6,), generator=g)
    lp = logprob.token_logprobs(z, t)
    assert lp.dtype == torch.float32 and lp.shape == (6,)
    want = _f64_logprobs(z, t)
    assert (lp.double() - want).abs().max() < 1e-5
    ls = logprob.log_softmax(z)
    assert kb.rel_l2(ls, torch.log_softmax(z.double(), -1)) < 1e-6
    assert (logprob.token_logprobs_native(z, t).double() - want).abs().max() < 1e-5


def test_token_logprobs_equal_gathered_log_softmax_bitwise(kb):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(9, 2500, generator=g) * 4
    t = torch.randint(0, 2500, (9,), generator=g)
    kb.assert_bitwise(logprob.token_logprobs(z, t),
                      logprob.log_softmax(z).gather(1, t[:, None])[:, 0], "token vs full")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_row_alone_equals_row_in_batch_bitwise(kb, dtype):
    g = torch.Generator().manual_seed(2)
    V = 1500  # one full reference leaf and a partial one
    for m in BATCH_SIZES:
        row = (torch.randn(V, generator=g) * 3).to(dtype)
        tgt = int(torch.randint(0, V, (1,), generator=g))
        alone = logprob.token_logprobs(row[None], torch.tensor([tgt]))[0]
        alone_full = logprob.log_softmax(row[None])[0]
        batch, idx = kb.needle_batch(row, m, g, scale=3.0)
        tb = torch.randint(0, V, (m,), generator=g)
        tb[idx] = tgt
        kb.assert_bitwise(logprob.token_logprobs(batch, tb)[idx], alone, f"M={m} row {idx}")
        if m in (1, 64, 256):
            kb.assert_bitwise(logprob.log_softmax(batch)[idx], alone_full, f"full M={m}")


def test_logprob_invariant_across_reference_row_chunks(kb):
    g = torch.Generator().manual_seed(3)
    V = 70000  # the reference processes few rows per chunk at this vocabulary
    assert _ref.rows_per_chunk(V, budget=1 << 19) < 10
    row = torch.randn(V, generator=g)
    alone = logprob.token_logprobs(row[None], torch.tensor([5]))[0]
    batch, idx = kb.needle_batch(row, 12, g)
    t = torch.full((12,), 5)
    kb.assert_bitwise(logprob.token_logprobs(batch, t)[idx], alone, "chunked rows")


def test_logprob_hazards_signed_zeros_ties_masked_vocab_noncontiguous(kb):
    V = 300
    z = torch.randn(6, V, generator=torch.Generator().manual_seed(4))
    z[0] = -0.0  # all -0: max is -0 (normalised to +0), uniform distribution
    z[1] = 0.0
    z[2, :] = 1.0  # ties everywhere
    z[3, 100:] = -float("inf")  # masked vocabulary
    z[4, ::2] = -0.0
    t = torch.tensor([3, 3, 7, 5, 0, 1])
    assert int(torch.signbit(z[0]).sum()) == V and bool(torch.isinf(z[3]).any())
    lp = logprob.token_logprobs(z, t)
    kb.assert_bitwise(lp[0], lp[1], "-0 row vs +0 row")
    assert abs(lp[0].item() + torch.log(torch.tensor(float(V))).item()) < 1e-6
    assert abs(lp[3].item() - torch.log_softmax(z[3].double(), 0)[5].item()) < 1e-6
    for i in range(6):
        kb.assert_bitwise(logprob.token_logprobs(z[i:i + 1], t[i:i + 1])[0], lp[i], f"row {i}")
    # logits as a strided view (e.g. every other row of a bigger buffer)
    big = torch.randn(12, V + 5, generator=torch.Generator().manual_seed(5))
    view = big[::2, :V]
    tt = torch.randint(0, V, (6,))
    kb.assert_bitwise(logprob.token_logprobs(view, tt), logprob.token_logprobs(view.contiguous(), tt),
                      "strided logits")
    assert logprob.token_logprobs(torch.zeros(0, V), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_logprob_gradients_match_float64(kb):
    g = torch.Generator().manual_seed(6)
    z = (torch.randn(5, 400, generator=g) * 2).requires_grad_()
    t = torch.randint(0, 400, (5,), generator=g)
    dy = torch.randn(5, generator=g)
    logprob.token_logprobs(z, t).backward(dy)
    z64 = z.detach().double().requires_grad_()
    (_f64_logprobs(z64, t) * dy.double()).sum().backward()
    assert kb.rel_l2(z.grad, z64.grad) < 1e-6
    z.grad = None
    dyf = torch.randn(5, 400, generator=g)
    logprob.log_softmax(z).backward(dyf)
    z64.grad = None
    (torch.log_softmax(z64, -1) * dyf.double()).sum().backward()
    assert kb.rel_l2(z.grad, z64.grad) < 1e-6


@pytest.mark.parametrize("V", [1024, 3001, 5000])
def test_logprob_shards_rebuild_the_reference_from_any_leaf_aligned_cut(kb, V):
    """``logprob.shards``: slices cut on REF_LEAF_V boundaries, each reduced alone, joined in
    vocabulary order, give the reference's logprob and gradient bit for bit."""
    g = torch.Generator().manual_seed(V + 1)
    z = torch.randn(5, V, generator=g) * 4
    t = torch.randint(0, V, (5,), generator=g)
    dy = torch.randn(5, generator=g)
    n_leaves = -(-V // logprob.REF_LEAF_V)
    for cuts in ([0, V], [0, logprob.REF_LEAF_V, V], [0] + [j * logprob.REF_LEAF_V for j in range(1, n_leaves)] + [V]):
        cuts = sorted(set(cuts))
        parts = list(zip(cuts, cuts[1:]))
        m = torch.stack([logprob.shards.row_max(z[:, a:b]) for a, b in parts]).max(0).values + 0.0
        lse = logprob.shards.lse_from_leaf_sums(torch.cat([logprob.shards.leaf_sums(z[:, a:b], m) for a, b in parts]))
        got = z.gather(1, t[:, None])[:, 0] - m - lse
        kb.assert_bitwise(got, logprob.token_logprobs_reference(z, t), f"V={V} cuts {cuts}")
        grad = torch.cat([logprob.shards.token_grad(z[:, a:b], m, lse, torch.where((t >= a) & (t < b), t - a, -1),
                                                    dy, z.dtype) for a, b in parts], dim=1)
        zg = z.clone().requires_grad_()
        logprob.token_logprobs(zg, t).backward(dy)
        kb.assert_bitwise(grad, zg.grad, f"gradient V={V} cuts {cuts}")


def test_logprob_forward_with_and_without_autograd_is_bitwise_equal(kb):
    g = torch.Generator().manual_seed(7)
    z = torch.randn(4, 900, generator=g).bfloat16()
    t = torch.randint(0, 900, (4,), generator=g)
    with torch.no_grad():
        plain = logprob.token_logprobs(z, t)
    kb.assert_bitwise(logprob.token_logprobs(z.clone().requires_grad_(), t), plain, "grad vs no grad")


# --------------------------------------------------------------------------- Triton (interpreter)


def interp_case_logprob_matches_float64_row_invariant_and_token_equals_full(kb):
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(8)
        V = 5000  # one full BLOCK_V chunk and a partial one
        row = (torch.randn(V, generator=g) * 3).to(dtype)
        tgt = 17
        alone = logprob.token_logprobs_triton(row[None], torch.tensor([tgt]))[0]
        for m in (1, 6):
            batch, idx = kb.needle_batch(row, m, g, scale=3.0)
            tb = torch.randint(0, V, (m,), generator=g)
            tb[idx] = tgt
            lp = logprob.token_logprobs_triton(batch, tb)
            assert (lp.double() - _f64_logprobs(batch, tb)).abs().max() < 1e-5
            kb.assert_bitwise(lp[idx], alone, f"{dtype} M={m}")
            full = logprob.log_softmax_triton(batch)
            kb.assert_bitwise(full.gather(1, tb[:, None])[:, 0], lp, "token vs full")


def interp_case_logprob_hazards_masked_and_signed_zero(kb):
    V = 4200
    z = torch.randn(3, V)
    z[0] = -0.0
    z[1, :4096] = -float("inf")  # a whole first chunk masked
    z[2] = 0.0
    t = torch.tensor([0, 4100, 0])
    lp = logprob.token_logprobs_triton(z, t)
    kb.assert_bitwise(lp[0], lp[2], "-0 vs +0 row")
    assert abs(lp[1].item() - torch.log_softmax(z[1].double(), 0)[4100].item()) < 1e-5


def interp_case_logprob_triton_backward_matches_float64_and_is_deterministic(kb):
    g = torch.Generator().manual_seed(12)
    V = 5000  # a full backward block and a partial one
    z = torch.randn(4, V, generator=g) * 3
    t = torch.randint(0, V, (4,), generator=g)
    dy = torch.randn(4, generator=g)
    lp, _, stats = logprob.triton_kernels._triton_launch(z, t, True, False, want_stats=True)
    kb.assert_bitwise(lp, logprob.token_logprobs_triton(z, t), "forward with stats vs without")
    dz = logprob.triton_kernels._token_logprobs_backward_triton(z, t, stats, dy)
    z64 = z.double().requires_grad_()
    (_f64_logprobs(z64, t) * dy.double()).sum().backward()
    assert kb.rel_l2(dz, z64.grad) < 1e-6
    kb.assert_bitwise(logprob.triton_kernels._token_logprobs_backward_triton(z, t, stats, dy), dz, "run to run")


def _compose_slices(z, t, bounds):
    """The Triton schedule's pieces (triton_shards) run slice by slice and joined in vocabulary
    order, as the ranks of a vocabulary-parallel group run them: (logprobs, stats)."""
    ts = logprob.triton_shards
    V = z.shape[1]
    cmax = torch.cat([ts.chunk_maxes_triton(z[:, a:b]) for a, b in bounds], dim=1)
    prefix = ts.prefix_maxes_triton(cmax)
    sums = torch.cat([ts.chunk_sums_triton(z[:, a:b], prefix, a // logprob.BLOCK_V, V) for a, b in bounds], dim=1)
    return ts.chain_triton(prefix, sums, z.gather(1, t[:, None])[:, 0].float())


def _chunk_bounds(V, parts):
    """``parts`` slices of whole BLOCK_V chunks, as even as possible."""
    C = -(-V // logprob.BLOCK_V)
    cuts = [j * C // parts * logprob.BLOCK_V for j in range(parts)] + [V]
    return list(zip(cuts[:-1], cuts[1:]))


def interp_case_logprob_triton_slices_compose_to_the_one_row_kernel_bitwise(kb):
    g = torch.Generator().manual_seed(21)
    for V, dtype in ((9000, torch.float32), (12289, torch.bfloat16), (4096, torch.float32)):
        z = (torch.randn(5, V, generator=g) * 4).to(dtype)
        z[1, :4096] = -float("inf")   # a masked first chunk: the running max is -inf there (shift 0)
        z[2, ::5] = -float("inf")
        z[3, V - 1] = 40.0            # the max in the last chunk: every earlier chunk is rescaled
        t = torch.randint(0, V, (5,), generator=g)
        t[1] = V - 1
        want, _, want_stats = logprob.triton_kernels._triton_launch(z, t, True, False, want_stats=True)
        C = -(-V // logprob.BLOCK_V)
        for parts in range(1, C + 1):
            lp, stats = _compose_slices(z, t, _chunk_bounds(V, parts))
            kb.assert_bitwise(lp, want, f"V={V} {dtype} in {parts} slice(s)")
            kb.assert_bitwise(stats, want_stats, f"V={V} {dtype} stats in {parts} slice(s)")
        # the slices' gradients side by side are the one-row backward's
        dy = torch.randn(5, generator=g)
        whole = logprob.triton_kernels._token_logprobs_backward_triton(z, t, want_stats, dy)
        bounds = _chunk_bounds(V, C)
        sides = torch.cat([logprob.triton_shards.slice_grad_triton(z[:, a:b], t - a, want_stats, dy)
                           for a, b in bounds], dim=1)
        kb.assert_bitwise(sides, whole, f"V={V} {dtype} gradient slices")


def interp_case_logprob_triton_slices_negative_control_rescaled_at_the_end(kb):
    # the chunk sums joined another way (each rescaled once to the row's final max, then added):
    # a stock reduction that must not give the one-row kernel's log s on every row, or the test
    # above could not tell schedules apart
    ts = logprob.triton_shards
    g = torch.Generator().manual_seed(22)
    V = 16384
    # one dominant logit at the end and a gentle ramp below it: each chunk's max is a little above
    # the last one's, so every chunk is rescaled on the way and still counts in s (about 8; here
    # about one row in six comes out different)
    z = torch.randn(64, V, generator=g) * 0.5 - 9 + torch.arange(V) / 8192
    z[:, -1] = 0.0
    t = torch.randint(0, V, (64,), generator=g)
    _, _, stats = logprob.triton_kernels._triton_launch(z, t, True, False, want_stats=True)
    prefix = ts.prefix_maxes_triton(ts.chunk_maxes_triton(z))
    sums = ts.chunk_sums_triton(z, prefix, 0, V)
    s = (sums * torch.exp(prefix - prefix[:, -1:])).sum(dim=1)
    assert kb.bit_report(torch.log(s), stats[:, 1])["differing"], "another join gave the same bits on every row"


def interp_case_logprob_triton_slice_pieces_match_their_torch_twins(kb):
    ts = logprob.triton_shards
    g = torch.Generator().manual_seed(23)
    z = torch.randn(6, 9000, generator=g) * 3
    z[0, :4096] = -float("inf")
    cmax = ts.chunk_maxes_triton(z[:, 4096:])
    kb.assert_bitwise(cmax, ts.chunk_maxes_torch(z[:, 4096:]), "chunk maxes (exact)")
    full = torch.cat([ts.chunk_maxes_triton(z[:, :4096]), cmax], dim=1)
    prefix = ts.prefix_maxes_triton(full)
    kb.assert_bitwise(prefix, ts.prefix_maxes_torch(full), "running maxes (exact)")
    sums = ts.chunk_sums_triton(z[:, 4096:], prefix, 1, 9000)
    assert torch.allclose(sums, ts.chunk_sums_torch(z[:, 4096:], prefix, 1), rtol=1e-5)
    all_sums = torch.cat([ts.chunk_sums_triton(z[:, :4096], prefix, 0, 9000), sums], dim=1)
    zt = z[:, 5000]   # outside the masked first chunk of row 0
    lp, stats = ts.chain_triton(prefix, all_sums, zt)
    lp2, stats2 = ts.chain_torch(prefix, all_sums, zt)
    assert torch.allclose(lp, lp2, atol=1e-5) and torch.allclose(stats, stats2, atol=1e-5)
    assert (lp.double() - torch.log_softmax(z.double(), 1)[:, 5000]).abs().max() < 1e-5
    try:
        ts.chunk_sums_triton(z[:, 4096:], prefix, 2, 9000)   # 2 chunks from chunk 2 of 3: does not fit
    except ValueError as exc:
        assert "does not fit" in str(exc), exc
    else:
        raise AssertionError("a slice past the running maxes was accepted")


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_logprob_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_logprob", case)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("V", [1000, 151936])
def test_logprob_cuda_row_alone_equals_row_in_batch_bitwise(kb, V):
    g = torch.Generator().manual_seed(9)
    row = (torch.randn(V, generator=g) * 3).bfloat16()
    tgt = 11
    alone = logprob.token_logprobs(row[None].cuda(), torch.tensor([tgt]).cuda())[0]
    for m in (2, 64, 257, 1024):
        batch, idx = kb.needle_batch(row, m, g, scale=3.0)
        tb = torch.randint(0, V, (m,), generator=g)
        tb[idx] = tgt
        lp = logprob.token_logprobs(batch.cuda(), tb.cuda())
        kb.assert_bitwise(lp[idx], alone, f"cuda V={V} M={m}")
    assert (lp.cpu().double() - _f64_logprobs(batch, tb)).abs().max() < 1e-4
    full = logprob.log_softmax(batch.cuda())
    kb.assert_bitwise(full.gather(1, tb.cuda()[:, None])[:, 0], lp, "token vs full")


@pytest.mark.gpu
def test_logprob_cuda_backward_matches_float64_and_is_deterministic(kb):
    g = torch.Generator().manual_seed(13)
    V = 151936
    z = (torch.randn(33, V, generator=g) * 3).bfloat16()
    t = torch.randint(0, V, (33,), generator=g)
    dy = torch.randn(33, generator=g)

    def grad():
        zc = z.cuda().requires_grad_()
        logprob.token_logprobs(zc, t.cuda()).backward(dy.cuda())
        return zc.grad

    first = grad()
    z64 = z.double().requires_grad_()
    (_f64_logprobs(z64, t) * dy.double()).sum().backward()
    assert kb.rel_l2(first, z64.grad) < kb.TOL[torch.bfloat16]
    kb.assert_bitwise(grad(), first, "cuda backward run to run")
