"""Gates for ``isoexec_kernels.gemm.leaf_partials``: a row-parallel rank's K leaves, each leaf's fp32
accumulator from the K slice holding them, in one call (one launch on CUDA), against what each
leaf's one-leaf fp32-output linear gives (the loop of calls it replaces). Bits compared through
integer views (``kb``)."""

from __future__ import annotations

import pytest
import torch

from isoexec.dist.partition import row_shard_leaves
from isoexec_kernels import gemm

# K = 620 is 10 blocks of 64, the last 44 wide; 4 leaves of 2, 3, 2, 3 blocks (the larger last)
RAGGED = dict(K=620, L=4, N=40)
# (tp, rank) slices: whole K, each half, single leaves at the middle and at the ragged end
SLICES = ((1, 0), (2, 0), (2, 1), (4, 1), (4, 3))


def _inputs(M, K, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over a few decades: sums that round
    x = (torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, K, generator=g))).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    return x, w


def _slice(x, w, K, L, tp, rank):
    """(x columns, w columns, first leaf, count, the leaves' column ranges in the slice)."""
    mine = row_shard_leaves(K, L, tp, rank)
    k0, k1 = mine[0][0], mine[-1][1]
    return x[:, k0:k1], w[:, k0:k1], rank * (L // tp), L // tp, [(a - k0, b - k0) for a, b in mine]


def _one_leaf_loop(linear, xs, ws, cols, **kw):
    """What row_parallel_linear computed before the one launch: each leaf alone, fp32 out, stacked."""
    return torch.stack([linear(xs[:, a:b], ws[:, a:b], out_dtype=torch.float32, leaves=1, **kw) for a, b in cols])


def _leaf_partials(fn, xs, ws, K, L, first, count, **kw):
    return fn(xs, ws, in_features=K, leaves=L, first_leaf=first, count=count, **kw)


# --------------------------------------------------------------------------- reference twin (CPU)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_leaf_partials_equal_the_one_leaf_loop_bitwise(kb, dtype):
    K, L, N = RAGGED["K"], RAGGED["L"], RAGGED["N"]
    for M in (1, 5, 70):
        x, w = _inputs(M, K, N, dtype, seed=M)
        for tp, rank in SLICES:
            xs, ws, first, count, cols = _slice(x, w, K, L, tp, rank)
            got = _leaf_partials(gemm.leaf_partials, xs, ws, K, L, first, count)
            assert got.shape == (count, M, N) and got.dtype == torch.float32
            kb.assert_bitwise(got, _one_leaf_loop(gemm.linear, xs, ws, cols), f"{dtype} M={M} tp={tp} rank {rank}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_leaf_partials_gradients_equal_the_one_leaf_loops_bitwise(kb, dtype):
    K, L, N = RAGGED["K"], RAGGED["L"], RAGGED["N"]
    x, w = _inputs(6, K, N, dtype, seed=7)
    xs, ws, first, count, cols = _slice(x, w, K, L, 2, 1)
    probe = torch.randn(count, 6, N, generator=torch.Generator().manual_seed(8))
    grads = []
    for run in (lambda a, b: _leaf_partials(gemm.leaf_partials, a, b, K, L, first, count),
                lambda a, b: _one_leaf_loop(gemm.linear, a, b, cols)):
        a, b = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        out = run(a, b)
        (out * probe).sum().backward()
        grads.append((out.detach(), a.grad, b.grad))
    for name, new, old in zip(("partials", "grad x", "grad w"), *grads):
        kb.assert_bitwise(new, old, f"{dtype} {name}: one call vs the one-leaf loop")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_leaf_partials_shared_gradient_equals_the_one_leaf_loops_bitwise(kb, dtype):
    # a row-parallel sum gives every leaf the same gradient, expanded (stride 0 over the leaves):
    # the backward then takes two products over the whole slice, which on the CPU twin (output
    # columns independent) are the leaf-by-leaf products side by side
    K, L, N = RAGGED["K"], RAGGED["L"], RAGGED["N"]
    x, w = _inputs(6, K, N, dtype, seed=17)
    xs, ws, first, count, cols = _slice(x, w, K, L, 1, 0)
    probe = torch.randn(6, N, generator=torch.Generator().manual_seed(18))
    grads, strides = [], []
    for run in (lambda a, b: _leaf_partials(gemm.leaf_partials, a, b, K, L, first, count),
                lambda a, b: _one_leaf_loop(gemm.linear, a, b, cols)):
        a, b = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        out = run(a, b)
        out.register_hook(lambda g: strides.append(g.stride(0)))
        (out.sum(0) * probe).sum().backward()
        grads.append((a.grad, b.grad))
    assert strides[0] == 0, strides   # the shared gradient did arrive expanded
    for name, new, old in zip(("grad x", "grad w"), *grads):
        kb.assert_bitwise(new, old, f"{dtype} {name}: shared gradient vs the one-leaf loop")


def test_leaf_partials_errors_name_the_problem():
    K, L, N = RAGGED["K"], RAGGED["L"], RAGGED["N"]
    x, w = _inputs(3, K, N, torch.float32, seed=9)
    xs, ws, first, count, _ = _slice(x, w, K, L, 2, 1)    # leaves 2, 3: columns [320, 620)

    def call(a=xs, b=ws, **kw):
        args = dict(in_features=K, leaves=L, first_leaf=first, count=count) | kw
        return gemm.leaf_partials(a, b, **args)

    with pytest.raises(ValueError, match=r"columns \[320, 620\) of 620, so x must be \[M, 300\].*\(3, 299\)"):
        call(a=xs[:, :299])
    with pytest.raises(ValueError, match=r"so weight must be \[N, 300\].*\(40, 299\)"):
        call(b=ws[:, :299])
    with pytest.raises(ValueError, match=r"columns \[128, 620\)"):   # leaves 1..3: a wider slice
        call(first_leaf=1, count=3)
    with pytest.raises(ValueError, match=r"so x must be \[M, 300\].*\(1, 3, 300\)"):
        call(a=xs[None])
    with pytest.raises(ValueError, match=r"leaves 2 \.\. 4 .* not among the 4 leaves"):
        call(count=3)
    with pytest.raises(ValueError, match=r"not among"):
        call(first_leaf=-1)
    with pytest.raises(ValueError, match=r"not among"):
        call(count=0)
    with pytest.raises(ValueError, match=r"11 K leaves for in_features=620 \(10 blocks"):
        call(leaves=11)
    with pytest.raises(TypeError, match=r"torch.float32 and torch.bfloat16"):
        call(b=ws.bfloat16())
    with pytest.raises(TypeError, match=r"torch.float64"):
        call(a=xs.double(), b=ws.double())


# --------------------------------------------------------------------------- Triton (interpreter)


# Each interp_case_* runs in the TRITON_INTERPRET=1 subprocess (conftest.py). Both sides of each
# comparison use the same tile, so every tl.dot sees operand tiles of the same shape and values:
# under the interpreter tl.dot is the host BLAS's matmul, whose bits depend on the tile shape,
# including its K width. bf16: the interpreter's bf16 dot does not compute the products (it gives
# nonsense values) but depends on exactly the operand tiles loaded, so equality still checks which
# columns each leaf reads and where it stores them; fp32 checks the arithmetic too.


def _interp_slices(kb, K, L, N, dtype, slices, sizes, seed):
    from isoexec_kernels.gemm.triton_kernels import k_tile_for, tile_for_m

    for M in sizes:
        x, w = _inputs(M, K, N, dtype, seed=seed + M)
        for tp, rank in slices:
            xs, ws, first, count, cols = _slice(x, w, K, L, tp, rank)
            got = _leaf_partials(gemm.leaf_partials_triton, xs, ws, K, L, first, count)
            # a one-leaf call takes K tiles of 128/256 where its leaf's width allows (k_tile_for);
            # the one launch takes them only where every leaf of K starts on one. On a GPU both
            # give the bits of 64-wide blocks (test_gemm.py's K tile gates); here the loop is told
            # the launch's K tile
            cfg = tile_for_m(M, dtype, N, max(b - a for a, b in cols), leaves=1)
            kt = k_tile_for(cfg, gemm.BLOCK_K, K, L, dtype)
            want = _one_leaf_loop(gemm.linear_triton, xs, ws, cols, tile={"K_TILE": kt})
            kb.assert_bitwise(got, want, f"{dtype} K={K} M={M} tp={tp} rank {rank} (K tile {kt})")


def interp_case_leaf_partials_of_a_ragged_k_slice_equal_the_one_leaf_loop(kb):
    for dtype in (torch.float32, torch.bfloat16):
        _interp_slices(kb, RAGGED["K"], RAGGED["L"], RAGGED["N"], dtype, SLICES[1:], (1, 5, 70), seed=10)


def interp_case_leaf_partials_with_wide_k_tiles_equal_the_one_leaf_loop(kb):
    # K = 1024 in 4 leaves of 256 columns: the launch and the loop take K tiles of 256 (M 1) and
    # 128 (M 70), the leaves starting on tile bounds
    _interp_slices(kb, 1024, 4, 40, torch.bfloat16, ((2, 1), (4, 2)), (1, 70), seed=20)


def interp_case_leaf_partials_of_the_whole_k_are_the_split_paths(kb):
    # all L leaves from the whole K (first leaf 0) summed by the second pass: the split path's
    # output (the same kernel, the same tile)
    from isoexec_kernels.gemm.triton_kernels import leaf_sum_triton

    K, L, N = RAGGED["K"], RAGGED["L"], RAGGED["N"]
    x, w = _inputs(20, K, N, torch.float32, seed=30)
    b = torch.randn(N, generator=torch.Generator().manual_seed(31))
    tile = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2)
    parts = _leaf_partials(gemm.leaf_partials_triton, x, w, K, L, 0, L, tile=tile)
    kb.assert_bitwise(leaf_sum_triton(parts, b), gemm.linear_triton(x, w, b, impl="split", tile=tile, leaves=L),
                      "whole-K partials summed vs the split path")


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_leaf_partials_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gemm_leaf_partials", case)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K,N", [(2048, 1024), (3072, 1024), (12288, 4096)])   # Qwen3-0.6B o / down, 8B down
def test_leaf_partials_cuda_one_launch_equals_the_one_leaf_loop_bitwise(kb, K, N):
    L = 4
    g = torch.Generator().manual_seed(72)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
    for M in (1, 64, 2048):
        x = torch.randn(M, K, generator=g).bfloat16().cuda()
        for tp in (2, 4):
            for rank in range(tp):
                xs, ws, first, count, cols = _slice(x, w, K, L, tp, rank)
                got = _leaf_partials(gemm.leaf_partials, xs, ws, K, L, first, count)
                kb.assert_bitwise(got, _one_leaf_loop(gemm.linear, xs, ws, cols),
                                  f"K={K} N={N} M={M} tp={tp} rank {rank}: one launch vs the one-leaf loop")
