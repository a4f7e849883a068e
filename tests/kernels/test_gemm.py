"""Gates for the batch-invariant linear layer (isoexec_kernels/gemm/) and the fixed-order sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from isoexec_kernels import _ref, gemm

DTYPES = (torch.float32, torch.bfloat16)
BATCH_SIZES = (1, 2, 3, 5, 8, 16, 31, 64, 65, 100, 128, 129, 200, 256)
# 6000 and 10240 rows at N <= 2048 run as two launches (tail_rows_split); they come before the
# last size because the float64 check on the CPU uses the last batch
CUDA_BATCH_SIZES = BATCH_SIZES + (17, 257, 1000, 1025, 2048, 6000, 10240, 4096, 4097)
CUDA_N = (4096, 1024, 1000, 151936)


def _weights(N, K, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return w, b, g


# --------------------------------------------------------------------------- fixed-order sums


def test_tree_sum_is_the_documented_halves_tree():
    t = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0], dtype=torch.float32)
    # pad to 8: [(1e8+3) + (-1e8+0)] + [(1+0) + (1+0)] evaluated in fp32
    a = (torch.tensor(1e8) + 3.0) + (torch.tensor(-1e8) + 0.0)
    want = a + (torch.tensor(1.0) + torch.tensor(1.0))
    assert torch.equal(_ref.tree_sum0(t), want)
    buf = t.clone()
    assert _ref.tree_sum0(torch.zeros(0)).item() == 0.0
    buf8 = torch.cat([buf, torch.zeros(3)])
    assert torch.equal(_ref.tree_sum0_(buf8), want)


def test_blocked_sum_leaf_padding_never_changes_bits(kb):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(300, 7, generator=g) * torch.exp(torch.randn(300, 7, generator=g) * 4)
    a = _ref.blocked_sum(t, 0, 64)
    # same leaves written out by hand with explicit zero padding to the full leaf width
    acc = torch.zeros(7)
    for k0 in range(0, 300, 64):
        leaf = torch.zeros(64, 7)
        leaf[: min(64, 300 - k0)] = t[k0:k0 + 64]
        acc = acc + _ref.tree_sum0(leaf)
    kb.assert_bitwise(a, acc, "blocked_sum vs explicit padding")


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(7, 48, 160), (33, 10, 64), (4, 3, 1), (5, 130, 257)])
def test_linear_reference_matches_float64(kb, dtype, M, N, K):
    w, b, g = _weights(N, K, dtype, seed=M * 1000 + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    want = x.double() @ w.double().T + b.double()
    out = gemm.linear(x, w, b)
    assert out.dtype == dtype and out.shape == (M, N)
    assert kb.rel_l2(out, want) < kb.TOL[dtype]
    assert kb.rel_l2(gemm.linear_native(x, w, b), want) < kb.TOL[dtype]


def test_linear_leading_dims_and_empty_batch(kb):
    w, b, g = _weights(24, 80, torch.float32, seed=3)
    x = torch.randn(2, 5, 80, generator=g)
    out = gemm.linear(x, w, b)
    assert out.shape == (2, 5, 24)
    kb.assert_bitwise(out.reshape(10, 24), gemm.linear(x.reshape(10, 80), w, b), "leading dims")
    assert gemm.linear(torch.zeros(0, 80), w, b).shape == (0, 24)


# --------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_alone_equals_row_in_batch_bitwise(kb, dtype):
    seed = 11 if dtype == torch.float32 else 12
    w, b, g = _weights(48, 160, dtype, seed)  # K = 2.5 blocks: last block partial
    checked = 0
    for m in BATCH_SIZES:
        row = torch.randn(160, generator=g).to(dtype)
        alone = gemm.linear(row[None], w, b)[0]
        batch, idx = kb.needle_batch(row, m, g)
        kb.assert_bitwise(gemm.linear(batch, w, b)[idx], alone, f"seed {seed} M={m} row {idx}")
        checked += 1
    assert checked == len(BATCH_SIZES)


@pytest.mark.parametrize("leaves", (2, 3, 5))
def test_linear_reference_k_leaves_match_float64_and_keep_rows_invariant(kb, leaves):
    # K = 330: 6 blocks (the last partial) cut into uneven leaves for 5
    w, b, g = _weights(24, 330, torch.float32, seed=70 + leaves)
    row = torch.randn(330, generator=g)
    alone = gemm.linear_reference(row[None], w, b, leaves=leaves)[0]
    for m in (2, 17, 64):
        batch, idx = kb.needle_batch(row, m, g)
        out = gemm.linear_reference(batch, w, b, leaves=leaves)
        kb.assert_bitwise(out[idx], alone, f"{leaves} leaves M={m} row {idx}")
        assert kb.rel_l2(out, batch.double() @ w.double().T + b.double()) < kb.TOL[torch.float32]
    one = gemm.linear_reference(row[None], w, b, leaves=1)[0]
    assert kb.bit_report(alone, one)["differing"] > 0, "leaves changed no bit: the leaf sum is not exercised"


def test_linear_reference_k_leaves_are_summed_left_to_right():
    # leaf 0 = 1e8, leaf 1 = 1.0, leaf 2 = -1e8 (one K block each): ((1e8 + 1) - 1e8) = 0 in fp32,
    # while any other order keeps the 1
    w = torch.ones(1, 192)
    x = torch.zeros(1, 192)
    x[0, 0], x[0, 64], x[0, 128] = 1e8, 1.0, -1e8
    assert gemm.linear_reference(x, w, leaves=3).item() == 0.0
    assert gemm.leaf_bounds(330, 5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 6)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_leaves_argument_runs_that_schedule_and_leaves_the_backward_alone(kb, dtype):
    """``linear(..., leaves=L)`` is the reference with L leaves, with and without autograd; the
    backward does not depend on L (isoexec/dist's row- and column-parallel layers pass L)."""
    w, b, g = _weights(24, 330, dtype, seed=80)
    x = torch.randn(3, 330, generator=g).to(dtype)
    probe = torch.randn(3, 24, generator=g)
    grads = []
    for leaves in (1, 5):
        want = gemm.linear_reference(x, w, b, leaves=leaves)
        kb.assert_bitwise(gemm.linear(x, w, b, leaves=leaves), want, f"no grad, {leaves} leaves")
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = gemm.linear(xs, ws, b, leaves=leaves)
        kb.assert_bitwise(out, want, f"autograd, {leaves} leaves")
        (out.float() * probe).sum().backward()
        grads.append((xs.grad, ws.grad))
    kb.assert_bitwise(grads[0][0], grads[1][0], "grad x, 1 vs 5 leaves")
    kb.assert_bitwise(grads[0][1], grads[1][1], "grad w, 1 vs 5 leaves")
    with pytest.raises(ValueError, match="7 K leaves for K=330"):
        gemm.linear(x, w, b, leaves=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_leaf_sum_of_one_leaf_partials_is_the_linear_with_those_leaves(kb, dtype):
    # each leaf alone (one leaf, fp32 out: its accumulator), then leaf_sum: linear(..., leaves=L)
    w, b, g = _weights(24, 330, dtype, seed=90)
    x = torch.randn(7, 330, generator=g).to(dtype)
    for leaves in (2, 3, 5):
        parts = torch.stack([gemm.linear(x[:, a * 64:c * 64], w[:, a * 64:c * 64], out_dtype=torch.float32, leaves=1)
                             for a, c in gemm.leaf_bounds(330, leaves)])
        kb.assert_bitwise(gemm.leaf_sum(parts, b, dtype), gemm.linear(x, w, b, leaves=leaves), f"{leaves} leaves")
    with pytest.raises(ValueError, match=r"\[L, M, N\] float32"):
        gemm.leaf_sum(parts.bfloat16(), b)
    with pytest.raises(ValueError, match=r"bias must be \[N\]=\[24\]"):
        gemm.leaf_sum(parts, b[:5])


def test_k_leaves_depend_on_the_weight_shape_only_and_bad_counts_are_refused(monkeypatch):
    for (n, k), leaves in gemm.K_LEAVES.items():
        assert gemm.k_leaves_for(n, k) == leaves and 1 <= leaves <= k // gemm.BLOCK_K
    assert gemm.k_leaves_for(48, 160) == 1
    monkeypatch.setitem(gemm.K_LEAVES, (48, 160), 8)
    assert gemm.k_leaves_for(48, 160) == 3, "more leaves than K blocks must be capped"
    assert gemm.k_leaves_for(160, 48) == 1
    w = torch.zeros(4, 130)
    with pytest.raises(ValueError, match="4 K leaves for K=130"):
        gemm.linear_reference(torch.zeros(1, 130), w, leaves=4)


def test_linear_row_invariant_across_reference_row_chunks(kb):
    # N large enough that the reference processes rows in several chunks
    N, K = 1100, 70
    w, b, g = _weights(N, K, torch.float32, seed=5)
    assert _ref.rows_per_chunk(gemm.BLOCK_K * N) < 40
    row = torch.randn(K, generator=g)
    alone = gemm.linear(row[None], w, b)[0]
    for m in (13, 40, 97):
        batch, idx = kb.needle_batch(row, m, g)
        kb.assert_bitwise(gemm.linear(batch, w, b)[idx], alone, f"M={m} row {idx}")


def test_linear_hazards_signed_zeros_subnormals_noncontiguous_bitwise(kb):
    K, N = 100, 20
    w, b, g = _weights(N, K, torch.float32, seed=7, bias=False)
    w[3] = -0.0  # a whole output column of -0 weights
    x = torch.randn(9, K, generator=g)
    x[0] = -0.0  # a row of -0
    x[1, ::3] = 1e-40  # fp32 subnormals
    x[2, :50] = -x[2, 50:]  # exact cancellations
    assert int((x.abs() < 1.2e-38).logical_and(x != 0).sum()) > 0, "no subnormal drawn"
    assert int(torch.signbit(x[0]).sum()) == K, "no -0 drawn"
    out = gemm.linear(x, w)
    for i in range(3):
        kb.assert_bitwise(gemm.linear(x[i:i + 1], w)[0], out[i], f"hazard row {i}")
    # an all -0 product row sums to +0 (the accumulator starts at +0)
    assert not torch.signbit(out[0]).any()
    # non-contiguous views give the bits of their contiguous copies
    big = torch.randn(K, 30, generator=g)
    xt = big.t()[:, :]  # [30, K] transposed view
    wt = torch.randn(K, N, generator=g).t()  # [N, K] transposed view
    kb.assert_bitwise(gemm.linear(xt, wt), gemm.linear(xt.contiguous(), wt.contiguous()),
                      "non-contiguous")


def test_stock_cpu_matmul_is_batch_variant_negative_control(kb):
    """Negative control: the stock CPU fp32 matmul changes a row's bits with the batch size on
    this machine, so the invariance gates above are not vacuous."""
    g = torch.Generator().manual_seed(0)
    differing = 0
    for K, N in ((64, 64), (256, 256), (512, 512)):
        x = torch.randn(64, K, generator=g)
        w = torch.randn(N, K, generator=g)
        alone = F.linear(x[:1], w)
        differing += kb.bit_report(F.linear(x, w)[:1], alone)["differing"]
        # ... while the invariant kernel keeps them
        kb.assert_bitwise(gemm.linear(x, w)[:1], gemm.linear(x[:1], w), f"K={K}")
    assert differing > 0, "stock matmul was batch invariant here: negative control unavailable"


# --------------------------------------------------------------------------- autograd


def test_linear_gradients_match_float64(kb):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2, 6, 70, generator=g, requires_grad=True)
    w = (torch.randn(30, 70, generator=g) / 8).requires_grad_()
    b = torch.randn(30, generator=g, requires_grad=True)
    dy = torch.randn(2, 6, 30, generator=g)
    out = gemm.linear(x, w, b)
    (out * dy).sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    (F.linear(x64, w64, b64) * dy.double()).sum().backward()
    for got, want, name in ((x.grad, x64.grad, "x"), (w.grad, w64.grad, "w"), (b.grad, b64.grad, "b")):
        assert got.dtype == torch.float32
        assert kb.rel_l2(got, want) < 1e-5, name


def test_linear_grad_x_row_alone_equals_row_in_batch_bitwise(kb):
    w, _, g = _weights(40, 90, torch.float32, seed=31, bias=False)
    dy_row = torch.randn(40, generator=g)
    x_row = torch.randn(90, generator=g)

    def grad_x(xs, dys):
        xs = xs.clone().requires_grad_()
        gemm.linear(xs, w).backward(dys)
        return xs.grad

    alone = grad_x(x_row[None], dy_row[None])[0]
    for m in (3, 64, 100):
        xb, idx = kb.needle_batch(x_row, m, g)
        dyb = torch.randn(m, 40, generator=g)
        dyb[idx] = dy_row
        kb.assert_bitwise(grad_x(xb, dyb)[idx], alone, f"grad_x M={m}")


def test_linear_forward_with_and_without_autograd_is_bitwise_equal(kb):
    w, b, g = _weights(32, 64, torch.bfloat16, seed=41)
    x = torch.randn(10, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        plain = gemm.linear(x, w, b)
    graded = gemm.linear(x.clone().requires_grad_(), w, b)
    kb.assert_bitwise(graded, plain, "trainer_fwd vs trainer_score")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_residual_in_the_epilogue_equals_the_separate_add_bitwise(kb, dtype):
    # the decoder layer's ``x + o_proj(a)`` as one call: the output rounded, then torch's add
    w, b, g = _weights(40, 200, dtype, seed=43)
    x = torch.randn(2, 7, 200, generator=g).to(dtype)
    r = torch.randn(2, 7, 40, generator=g).to(dtype)
    for bias in (None, b):
        kb.assert_bitwise(gemm.linear(x, w, bias, residual=r), r + gemm.linear(x, w, bias), f"bias={bias is not None}")
    xs, ws, rs = (t.clone().requires_grad_() for t in (x, w, r))
    dy = torch.randn(2, 7, 40, generator=g).to(dtype)
    fused = torch.autograd.grad(gemm.linear(xs, ws, residual=rs), (xs, ws, rs), dy)
    plain = torch.autograd.grad(rs + gemm.linear(xs, ws), (xs, ws, rs), dy)
    for name, f, p in zip(("x", "w", "residual"), fused, plain):
        kb.assert_bitwise(f, p, f"grad {name}")
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        gemm.linear(x, w, residual=r[:, :3])
    with pytest.raises(TypeError, match="residual is"):
        gemm.linear(x, w, residual=r.double())


def test_linear_fp32_output_of_bf16_inputs_equals_fp32_inputs_bitwise(kb):
    # the MoE router's logits: bf16 values with the fp32 accumulator left unrounded are
    # lin(fp32(x), fp32(w)) (the products are exact in fp32), and rounding that accumulator once
    # gives the plain bf16 linear
    w, b, g = _weights(48, 200, torch.bfloat16, seed=42)
    x = torch.randn(9, 200, generator=g).bfloat16()
    wide = gemm.linear(x, w, b, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    kb.assert_bitwise(wide, gemm.linear(x.float(), w.float(), b.float()), "fp32 output vs fp32 inputs")
    kb.assert_bitwise(wide.to(torch.bfloat16), gemm.linear(x, w, b), "one rounding of the same accumulator")
    kb.assert_bitwise(gemm.linear(x, w, b, out_dtype=torch.bfloat16), gemm.linear(x, w, b), "out_dtype = x's")


def test_linear_fp32_output_gradients_equal_autograd_through_fp32_casts_bitwise(kb):
    w, b, g = _weights(30, 70, torch.bfloat16, seed=43)
    x = torch.randn(2, 6, 70, generator=g).bfloat16()
    dy = torch.randn(2, 6, 30, generator=g)

    def grads(f):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        torch.autograd.backward(f(xs, ws, bs), dy)
        return xs.grad, ws.grad, bs.grad

    got = grads(lambda xs, ws, bs: gemm.linear(xs, ws, bs, out_dtype=torch.float32))
    want = grads(lambda xs, ws, bs: gemm.linear(xs.float(), ws.float(), bs.float()))
    for a, e, name in zip(got, want, ("x", "w", "b")):
        assert a.dtype == torch.bfloat16, name
        kb.assert_bitwise(a, e, f"grad {name}")


# --------------------------------------------------------------------------- tiles and errors


def test_tma_residual_epilogue_is_skipped_only_where_it_overflows_shared_memory():
    from isoexec_kernels.gemm.triton_kernels import tma_takes_residual

    def tile(bm, bn, stages, ws):
        return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=8, num_stages=stages, warp_specialize=ws)

    assert not tma_takes_residual(tile(128, 256, 3, False))
    assert tma_takes_residual(tile(128, 256, 3, True)) and tma_takes_residual(tile(128, 256, 2, False))
    assert tma_takes_residual(tile(128, 128, 4, False)) and tma_takes_residual(tile(64, 128, 4, True))
    assert tma_takes_residual(dict(tile(128, 256, 3, False), tma_residual=True))
    # K tiles of 128 (the leaf walk's): 3 stages of 128 x 128 do not leave room for it, 2 do;
    # every entry of the table with a K tile of 128 and a TMA path is one of these or fits
    assert not tma_takes_residual(tile(128, 128, 3, False), 128) and tma_takes_residual(tile(128, 128, 2, False), 128)
    assert tma_takes_residual(tile(64, 128, 4, False), 128) and tma_takes_residual(tile(64, 128, 3, False), 128)


def test_tile_table_never_touches_block_k_and_gates_cover_every_bucket():
    seen = set()
    for n in (1024, 4096, 151936):
        for m in list(BATCH_SIZES) + [257, 1000, 1024, 1025, 2048, 4096, 4097, 10240]:
            cfg = gemm.tile_for_m(m, torch.bfloat16, n)
            assert "BLOCK_K" not in cfg and cfg["path"] in ("tma", "pointer", "split")
            assert cfg.get("K_TILE", gemm.BLOCK_K) % gemm.BLOCK_K == 0   # a K tile is whole BLOCK_K blocks
            seen.add((n, tuple(sorted(cfg.items()))))
    # a shape with K leaves splits K at decode sizes (M <= 64) and walks the leaves from M 65 on
    leafy = (1024, 3072)
    # ... whether the table pins them or the caller passes them (a row-parallel linear's L)
    assert [gemm.tile_for_m(m, torch.bfloat16, *leafy, leaves=4)["path"] for m in (64, 4096)] == ["split", "tma"]
    assert gemm.tile_for_m(4096, torch.bfloat16, *leafy, leaves=4) != gemm.tile_for_m(4096, torch.bfloat16, *leafy)
    saved = dict(gemm.K_LEAVES)
    try:
        gemm.K_LEAVES[leafy] = 4
        paths = {m: gemm.tile_for_m(m, torch.bfloat16, *leafy)["path"] for m in (1, 16, 17, 64, 256, 257, 4096)}
        assert {paths[m] for m in (1, 16, 17, 64)} == {"split"} and {paths[256], paths[257], paths[4096]} == {"tma"}, paths
        assert gemm.gemm_path(*leafy, torch.bfloat16, torch.device("cpu"), M=64) == "split"
    finally:
        gemm.K_LEAVES.clear()
        gemm.K_LEAVES.update(saved)
        assert gemm.block_k_for(n, 4096) == gemm.BLOCK_K
    # the CUDA gate below runs CUDA_BATCH_SIZES for every N of CUDA_N: every bucket
    buckets = {tuple(sorted(gemm.tile_for_m(m, torch.bfloat16, n).items()))
               for n in CUDA_N for m in range(1, 10241, 7)}
    gate = {tuple(sorted(gemm.tile_for_m(m, torch.bfloat16, n).items()))
            for n in CUDA_N for m in CUDA_BATCH_SIZES}
    assert buckets <= gate, "CUDA_BATCH_SIZES misses an M bucket"
    assert gemm.gemm_path(4096, 4096, torch.bfloat16, torch.device("cpu")) == "pointer"


def test_tail_rows_split_leaves_whole_waves_then_less_than_a_wave_of_smaller_tiles():
    from isoexec_kernels.gemm.triton_kernels import tail_rows_split
    sms = 132
    # a caller's K leaves walk one tile at every M: no second launch
    assert tail_rows_split(10240, 1024, 2048, torch.bfloat16, sms) is not None
    assert tail_rows_split(10240, 1024, 2048, torch.bfloat16, sms, leaves=4) is None
    split_seen = False
    for n, k in ((1024, 2048), (1024, 3072), (2048, 1024), (4096, 1024), (151936, 1024)):
        for m in (1, 256, 2048, 2049, 4097, 6000, 8192, 10240, 12345, 20000):
            head = tail_rows_split(m, n, k, torch.bfloat16, sms)
            if head is None:
                continue
            split_seen = True
            big, small = gemm.tile_for_m(m, torch.bfloat16, n, k), gemm.tile_for_m(2048, torch.bfloat16, n, k)
            assert n <= 2048 and m > 2048 and 0 < head < m and head % big["BLOCK_M"] == 0
            tiles_n = -(-n // big["BLOCK_N"])
            full_waves = -(-m // big["BLOCK_M"]) * tiles_n // sms
            head_tiles = head // big["BLOCK_M"] * tiles_n
            # the head is the whole row blocks of the full waves
            assert full_waves * sms - tiles_n < head_tiles <= full_waves * sms
            tail_tiles = -(-(m - head) // small["BLOCK_M"]) * -(-n // small["BLOCK_N"])
            # the tail's smaller tiles fit in about one wave, instead of a third big wave
            assert tail_tiles <= 2 * sms, (n, m, head, tail_tiles)
    assert split_seen
    # Qwen3-0.6B o_proj at 10240 rows: two full waves of 128 x 256 tiles, then 1792 rows
    assert tail_rows_split(10240, 1024, 2048, torch.bfloat16, sms) == 8448
    assert tail_rows_split(8192, 1024, 2048, torch.bfloat16, sms) is None   # 1.94 waves: one launch


def test_linear_errors_name_the_problem():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="K=7"):
        gemm.linear(torch.randn(2, 7), w)
    with pytest.raises(TypeError, match="bfloat16"):
        gemm.linear(torch.randn(2, 8).bfloat16(), w)
    with pytest.raises(TypeError, match="out_dtype"):
        gemm.linear(torch.randn(2, 8), w, out_dtype=torch.int32)


# --------------------------------------------------------------------------- Triton (interpreter)


# Each interp_case_* runs in the TRITON_INTERPRET=1 subprocess (conftest); fp32/fp16 only.
#
# Under the interpreter ``tl.dot`` is numpy's matmul on the host BLAS, whose bits for a row
# depend on the tile shape (BLOCK_M follows the M bucket), the row's place in the tile and the
# BLAS kernels picked for this CPU (OpenBLAS's Haswell kernels, as picked on AMD EPYC, give
# 3 of 40 elements 10 ulp apart for one row alone vs in a batch of 70). So the interpreter
# cannot prove batch invariance here: it checks correctness against float64 and run-to-run
# determinism. Batch invariance is asserted by the torch reference twin above (CPU) and by the
# Triton kernel on the GPU (tests marked gpu).


def _interp_linear(kb, dtype, impl):
    g = torch.Generator().manual_seed(51)
    N, K = 40, 100 if impl == "tma" else 90  # tma needs 16-byte row strides
    w = (torch.randn(N, K, generator=g) / 10).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    row = torch.randn(K, generator=g).to(dtype)
    for m in (1, 70, 300):  # crosses all three M buckets (tile shapes)
        batch, _ = kb.needle_batch(row, m, g)
        out = gemm.linear_triton(batch, w, b, impl=impl)
        want = batch.double() @ w.double().T + b.double()
        assert kb.rel_l2(out, want) < kb.TOL[dtype], (impl, dtype, m, kb.rel_l2(out, want))
        again = gemm.linear_triton(batch, w, b, impl=impl)
        kb.assert_bitwise(again, out, f"{impl} {dtype} M={m}: same call twice")


def interp_case_linear_fp32_pointer_matches_float64_and_repeats_bitwise(kb):
    _interp_linear(kb, torch.float32, "pointer")


def interp_case_linear_fp32_tma_matches_float64_and_repeats_bitwise(kb):
    _interp_linear(kb, torch.float32, "tma")


def interp_case_linear_fp16_pointer_matches_float64_and_repeats_bitwise_every_bucket(kb):
    _interp_linear(kb, torch.float16, "pointer")


# The two cases below compare calls with the same M, so every tl.dot sees operand tiles of the
# same shape and values on both sides: the kernel, not the host BLAS, fixes what is compared.


def interp_case_linear_pointer_and_tma_agree_fp32(kb):
    g = torch.Generator().manual_seed(52)
    w = torch.randn(24, 132, generator=g)
    x = torch.randn(9, 132, generator=g)
    kb.assert_bitwise(gemm.linear_triton(x, w, impl="pointer"), gemm.linear_triton(x, w, impl="tma"),
                      "pointer vs tma (interpreter)")


def interp_case_linear_noncontiguous_and_bias_free(kb):
    g = torch.Generator().manual_seed(53)
    big = torch.randn(72, 20, generator=g)
    x = big.t()  # [20, 72] strided view
    w = torch.randn(16, 72, generator=g)
    kb.assert_bitwise(gemm.linear_triton(x, w), gemm.linear_triton(x.contiguous(), w), "strided x")


def interp_case_linear_split_k_equals_one_program_leaf_walk_fp32(kb):
    # the same tile on every path, so each tl.dot sees the same operand tiles: split-K (leaves in
    # separate programs, summed by a second pass) must give the bits of the fused leaf walk
    g = torch.Generator().manual_seed(54)
    w = torch.randn(40, 5 * 64 + 20, generator=g) / 10
    b = torch.randn(40, generator=g)
    # 40 rows: 3 x 2 tiles on the interpreter's 4 persistent programs, so a program carries its
    # sum from one tile's last leaf to the next tile's first (TMA kernel, LEAF_MAJOR)
    x = torch.randn(40, 5 * 64 + 20, generator=g)
    tile = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2)
    for leaves in (2, 3, 4, 6):   # 6 K blocks: 4 leaves are uneven (the loop per leaf), the rest (tile, leaf) items
        split = gemm.linear_triton(x, w, b, impl="split", tile=tile, leaves=leaves)
        kb.assert_bitwise(gemm.linear_triton(x, w, b, impl="pointer", tile=tile, leaves=leaves), split,
                          f"split vs pointer, {leaves} leaves")
        for major in (True, False):
            kb.assert_bitwise(gemm.linear_triton(x, w, b, impl="tma", tile=dict(tile, leaf_major=major), leaves=leaves),
                              split, f"split vs tma (leaf_major={major}), {leaves} leaves")
        assert kb.rel_l2(split, x.double() @ w.double().T + b.double()) < kb.TOL[torch.float32]


def interp_case_leaf_sum_equals_its_reference(kb):
    # the split-K path's second pass on partials made elsewhere: left to right, bias, one rounding
    from isoexec_kernels.gemm.reference import leaf_sum_reference
    from isoexec_kernels.gemm.triton_kernels import leaf_sum_triton
    g = torch.Generator().manual_seed(57)
    parts = torch.randn(4, 37, 45, generator=g) * torch.logspace(-3, 3, 45)
    b = torch.randn(45, generator=g).half()
    for out_dtype in (torch.float32, torch.float16):
        for bias in (None, b):
            kb.assert_bitwise(leaf_sum_triton(parts, bias, out_dtype), leaf_sum_reference(parts, bias, out_dtype),
                              f"{out_dtype} bias={bias is not None}")


def interp_case_linear_residual_in_the_epilogue_equals_the_separate_add(kb):
    # every kernel path with the residual against the same call plus torch's add (same M and
    # tiles on both sides); fp16 rounds before the add, fp32 keeps the accumulator
    g = torch.Generator().manual_seed(56)
    for dtype in (torch.float16, torch.float32):
        w = (torch.randn(40, 5 * 64 + 16, generator=g) / 10).to(dtype)
        b = torch.randn(40, generator=g).to(dtype)
        x = torch.randn(20, 5 * 64 + 16, generator=g).to(dtype)
        r = torch.randn(20, 40, generator=g).to(dtype)
        tile = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2)
        for impl, leaves, own in (("pointer", 1, None), ("tma", 1, False), ("tma", 1, True), ("tma", 3, True),
                                  ("split", 3, None)):
            # own: whether the TMA kernel adds in its own epilogue or after its launch
            t = tile if own is None else dict(tile, tma_residual=own)
            fused = gemm.linear_triton(x, w, b, impl=impl, tile=t, leaves=leaves, residual=r)
            plain = gemm.linear_triton(x, w, b, impl=impl, tile=tile, leaves=leaves)
            kb.assert_bitwise(fused, r + plain, f"{impl} {leaves} leaves {dtype}")


def interp_case_linear_fp32_output_is_the_unrounded_accumulator_fp16(kb):
    # same M and tiles on both sides: the wide output rounded once is the plain fp16 linear
    g = torch.Generator().manual_seed(55)
    w = (torch.randn(40, 136, generator=g) / 10).half()
    x = torch.randn(70, 136, generator=g).half()
    for impl in ("pointer", "tma"):
        wide = gemm.linear_triton(x, w, impl=impl, out_dtype=torch.float32)
        assert wide.dtype == torch.float32
        kb.assert_bitwise(wide.half(), gemm.linear_triton(x, w, impl=impl), f"{impl}: fp32 output rounded once")
        assert kb.rel_l2(wide, x.double() @ w.double().T) < 1e-6


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_linear_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gemm", case)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (1024, 3072), (1024, 2048), (1000, 200), (151936, 1024),
                                 (6144, 1024), (4096, 12288)])   # 0.6B gate_up, 8B down: their own M <= 256 tiles
def test_linear_cuda_row_alone_equals_row_in_batch_bitwise_every_bucket(kb, N, K):
    # a shape listed in K_LEAVES runs split-K at M <= 256 and the leaf walk above: this also
    # gates split == fused for it
    g = torch.Generator().manual_seed(61)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
    b = torch.randn(N, generator=g).bfloat16().cuda()
    row = torch.randn(K, generator=g).bfloat16()
    alone = gemm.linear(row[None].cuda(), w, b)[0]
    for m in CUDA_BATCH_SIZES:
        batch, idx = kb.needle_batch(row, m, g)
        out = gemm.linear(batch.cuda(), w, b)
        kb.assert_bitwise(out[idx], alone, f"cuda N={N} K={K} M={m} row {idx}")
    want = batch.double() @ w.double().cpu().T + b.double().cpu()
    assert kb.rel_l2(out, want) < kb.TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1024, 3072), (4096, 1024)])
def test_linear_cuda_residual_in_the_epilogue_equals_the_separate_add_bitwise(kb, N, K):
    # every M bucket (pointer, split, TMA, the two-launch tail split at M 10240) and 2 leaves
    g = torch.Generator().manual_seed(63)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
    for m in (1, 16, 64, 256, 1000, 2048, 10240):
        x = torch.randn(m, K, generator=g).bfloat16().cuda()
        r = torch.randn(m, N, generator=g).bfloat16().cuda()
        for leaves in (None, 2):
            kb.assert_bitwise(gemm.linear(x, w, residual=r, leaves=leaves), r + gemm.linear(x, w, leaves=leaves),
                              f"N={N} K={K} M={m} leaves={leaves}")
        strided = torch.randn(m, 2 * N, generator=g).bfloat16().cuda()[:, :N]
        kb.assert_bitwise(gemm.linear(x, w, residual=strided), strided + gemm.linear(x, w), f"strided residual M={m}")


@pytest.mark.gpu
def test_linear_cuda_fp32_and_backward(kb):
    g = torch.Generator().manual_seed(62)
    x = torch.randn(70, 136, generator=g).cuda().requires_grad_()
    w = torch.randn(48, 136, generator=g).cuda().requires_grad_()
    out = gemm.linear(x, w)
    want = x.detach().double() @ w.detach().double().T
    assert kb.rel_l2(out, want) < 1e-5
    out.sum().backward()
    assert kb.rel_l2(x.grad, torch.ones(70, 48, dtype=torch.float64, device="cuda") @ w.detach().double()) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("N", (256, 64, 1))
def test_linear_cuda_fp32_output_row_alone_equals_row_in_batch_and_backward(kb, N):
    # the MoE router's GEMM (E = 256 / 64 experts, and the shared expert's 1-wide gate) at
    # K = 2048: bf16 inputs, fp32 logits, every M bucket
    g = torch.Generator().manual_seed(64)
    K = 2048
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
    row = torch.randn(K, generator=g).bfloat16()
    alone = gemm.linear(row[None].cuda(), w, out_dtype=torch.float32)[0]
    for m in CUDA_BATCH_SIZES:
        batch, idx = kb.needle_batch(row, m, g)
        out = gemm.linear(batch.cuda(), w, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        kb.assert_bitwise(out[idx], alone, f"fp32 out N={N} M={m} row {idx}")
        kb.assert_bitwise(out.bfloat16(), gemm.linear(batch.cuda(), w), f"fp32 out rounded once, M={m}")
    want = batch.double() @ w.double().cpu().T
    assert kb.rel_l2(out, want) < 1e-5
    x = batch[:300].cuda().requires_grad_()
    wg = w.clone().requires_grad_()
    dy = torch.randn(x.shape[0], N, generator=g).cuda()
    gemm.linear(x, wg, out_dtype=torch.float32).backward(dy)
    assert x.grad.dtype == torch.bfloat16 and wg.grad.dtype == torch.bfloat16
    assert kb.rel_l2(x.grad, dy.double() @ w.double()) < kb.TOL[torch.bfloat16]
    assert kb.rel_l2(wg.grad, dy.double().T @ x.detach().double()) < kb.TOL[torch.bfloat16]


@pytest.mark.gpu
def test_stock_cublas_is_batch_variant_negative_control(kb):
    g = torch.Generator().manual_seed(63)
    x = torch.randn(256, 4096, generator=g).bfloat16().cuda()
    w = torch.randn(4096, 4096, generator=g).bfloat16().cuda()
    alone = F.linear(x[:1], w)
    differing = sum(kb.bit_report(F.linear(x[:m], w)[:1], alone)["differing"] for m in (64, 128, 256))
    assert differing > 0, "cuBLAS was batch invariant here: negative control unavailable"


@pytest.mark.gpu
@pytest.mark.parametrize("leaves", (2, 4, 8))
def test_linear_cuda_split_k_equals_one_program_leaf_walk_bitwise(kb, leaves):
    # (1024, 3072) at decode and prefill sizes: split-K partials + the ordered sum pass against
    # the persistent kernel walking the same leaves (the pair the K_LEAVES table relies on)
    g = torch.Generator().manual_seed(62)
    w = (torch.randn(1024, 3072, generator=g) / 3072**0.5).bfloat16().cuda()
    b = torch.randn(1024, generator=g).bfloat16().cuda()
    for m in (1, 7, 64, 256):
        x = torch.randn(m, 3072, generator=g).bfloat16().cuda()
        # K_TILE named: an override keeps the table entry's other keys (its K tile of 128 at M 256
        # would not fit 128 x 128 on 4 stages)
        split = gemm.linear_triton(x, w, b, impl="split", tile=dict(BLOCK_M=16, BLOCK_N=32, num_warps=4,
                                                                     num_stages=4, K_TILE=64), leaves=leaves)
        walk = gemm.linear_triton(x, w, b, impl="tma", tile=dict(BLOCK_M=128, BLOCK_N=128, num_warps=8,
                                                                  num_stages=4, K_TILE=64), leaves=leaves)
        kb.assert_bitwise(split, walk, f"{leaves} leaves M={m}: split vs walk")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1024, 3072), (6144, 1024), (4096, 4096)])
def test_linear_cuda_k_tile_never_changes_bits(kb, N, K):
    # one tl.dot over 128 or 256 K columns chains the same k16 tensor-core steps into the fp32
    # accumulator as two or four dots over 64 (k_tile_for): the bits of BLOCK_K 64, both kernels
    g = torch.Generator().manual_seed(66)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
    b = torch.randn(N, generator=g).bfloat16().cuda()
    for m in (1, 16, 64, 256, 2048):
        x = torch.randn(m, K, generator=g).bfloat16().cuda()
        for impl, tile in (("pointer", dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2)),
                           ("pointer", dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
                           ("tma", dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2)),
                           ("tma", dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2))):
            at64 = gemm.linear_triton(x, w, b, impl=impl, tile=dict(tile, K_TILE=64))
            for kt in (128, 256) if impl == "pointer" else (128,):   # a 256-wide TMA stage may not fit
                kb.assert_bitwise(gemm.linear_triton(x, w, b, impl=impl, tile=dict(tile, K_TILE=kt)), at64,
                                  f"N={N} K={K} M={m} {impl} {tile['BLOCK_M']}x{tile['BLOCK_N']}: K tile {kt} vs 64")
        kb.assert_bitwise(gemm.linear(x, w, b), at64, f"N={N} K={K} M={m}: the table vs K tile 64")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,L", [(1024, 2048, 4), (1024, 3072, 4), (4096, 12288, 4), (4096, 4096, 2)])
def test_linear_cuda_k_tile_keeps_the_leaf_walk_bits(kb, N, K, L):
    # with several K leaves a K tile of 128 is kept where every leaf starts on one (k_tile_for):
    # the walk's leaves then hold the same blocks, chained in the same order, as with 64
    g = torch.Generator().manual_seed(68)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
    b = torch.randn(N, generator=g).bfloat16().cuda()
    for m in (300, 2048):
        x = torch.randn(m, K, generator=g).bfloat16().cuda()
        for impl, tile in (("tma", dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)),
                           ("tma", dict(BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=2)),
                           ("pointer", dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2))):
            at64 = gemm.linear_triton(x, w, b, impl=impl, tile=dict(tile, K_TILE=64), leaves=L)
            at128 = gemm.linear_triton(x, w, b, impl=impl, tile=dict(tile, K_TILE=128), leaves=L)
            kb.assert_bitwise(at128, at64, f"N={N} K={K} L={L} M={m} {impl}: K tile 128 vs 64")
        kb.assert_bitwise(gemm.linear(x, w, b, leaves=L), at64, f"N={N} K={K} L={L} M={m}: the table vs K tile 64")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1024, 2048), (6144, 1024), (151936, 1024)])
def test_linear_cuda_host_descriptors_give_the_device_descriptors_bits(kb, N, K):
    # where the TMA descriptors are made (host: kernel parameters, the default; device: written by
    # each program) changes when the loads start, never what they load
    g = torch.Generator().manual_seed(67)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
    b = torch.randn(N, generator=g).bfloat16().cuda()
    for m in (256, 1000, 2048, 4096):
        x = torch.randn(m, K, generator=g).bfloat16().cuda()
        r = torch.randn(m, N, generator=g).bfloat16().cuda()
        for res in (None, r):
            dev = gemm.linear_triton(x, w, b, impl="tma", tile={"host_desc": False}, residual=res)
            host = gemm.linear_triton(x, w, b, impl="tma", tile={"host_desc": True}, residual=res)
            kb.assert_bitwise(host, dev, f"N={N} K={K} M={m} residual={res is not None}: host vs device descriptors")
            kb.assert_bitwise(gemm.linear(x, w, b, residual=res), host, f"N={N} K={K} M={m}: the default")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1024, 2048), (6144, 1024)])
def test_linear_cuda_programs_per_sm_never_changes_bits(kb, N, K):
    # 2 or 3 persistent programs per SM only change which program runs a tile, never its K loop
    g = torch.Generator().manual_seed(65)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
    for m in (64, 256, 2048):
        x = torch.randn(m, K, generator=g).bfloat16().cuda()
        for bm, bn, warps in ((64, 64, 4), (128, 128, 8)):
            # K tile 64: the table's small-M K tiles of 128/256 at 4 stages of 128 x 128 are over the
            # shared memory with host-side descriptors (the table pairs them with smaller tiles)
            tile = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=4, K_TILE=64)
            one = gemm.linear_triton(x, w, impl="tma", tile=tile)
            for k in (2, 3):
                kb.assert_bitwise(gemm.linear_triton(x, w, impl="tma", tile=dict(tile, programs_per_sm=k)), one,
                                  f"N={N} K={K} M={m} {bm}x{bn}: {k} programs per SM")
        kb.assert_bitwise(one, gemm.linear(x, w), f"N={N} K={K} M={m}: tile vs the table")
