"""Gates for the MoE grouped GEMM (isoexec_kernels/moe/triton_kernels.py): the Triton twin of the
expert loop (``reference.experts_forward``).

Three kinds of check, as for the linear (test_gemm.py):
  * interpreter (``interp_case_*``, run in the TRITON_INTERPRET=1 subprocess of conftest.py;
    fp32/fp16): correctness against float64 with experts of 0 rows, 1 row and more rows than a
    tile, run-to-run determinism, gradients (zero weight gradients for a dispatch of no row).
    Under the interpreter ``tl.dot`` is numpy's matmul on the host BLAS, whose bits for a row may
    follow the tile shape and the row's place in it, so
    bit equality is asserted only where both sides issue the same ``tl.dot`` operands: the grouped
    kernel against the linear's pointer kernel at the same tile (each expert's m-tiles start at
    its first row, as in the linear applied to that expert's rows alone), and a token whose tile
    is unchanged while the other experts' loads, or its own expert's later tiles, change. That an
    expert's load (1 row vs many: other rows in the token's tile) never changes a row's bits is
    a property of the GPU's dot, asserted by the GPU tests only.
  * sm90 compile on the CPU: the kernels at their pinned tiles compile for Hopper and fit its
    shared memory (the interpreter accepts kernels that the sm90 compiler refuses).
  * GPU (``@pytest.mark.gpu``, bf16 at Qwen3.5-MoE dims): a token's expert rows are bitwise the
    same alone, in batches of 1..4096 tokens and whatever its experts' loads; they equal the loop
    of the invariant ``linear`` over the experts bitwise; gradients match float64 and repeat.
"""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import gemm
from isoexec_kernels import moe
from isoexec_kernels.activation import silu_and_mul
from isoexec_kernels.moe import triton_kernels as mtk
from isoexec_kernels.moe.types import Dispatch

H200_SHARED_BYTES = 232448  # max dynamic shared memory per block on sm90 (H100/H200)


def _ids_with_loads(T, k, E, g, full=0, single=1, empty=2):
    """ids [T, k] ascending per token: expert ``full`` is chosen by every token, ``single`` by
    token 0 only, ``empty`` by none, the other k-1 (k-2 for token 0) at random among the rest."""
    rest = [e for e in range(E) if e not in (full, single, empty)]
    rows = []
    for t in range(T):
        n = k - 1 - (t == 0)
        pick = [rest[int(i)] for i in torch.randperm(len(rest), generator=g)[:n]]
        rows.append(sorted([full] + ([single] if t == 0 else []) + pick))
    return torch.tensor(rows, dtype=torch.long)


def _inputs(token_lists):
    """(offsets [E+1], idx [R]) of a dispatch whose expert e owns the tokens ``token_lists[e]``."""
    counts = [len(t) for t in token_lists]
    offsets = torch.zeros(len(token_lists) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.long), 0)
    idx = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
    return offsets, idx


def _float64_grouped(x, w, offsets, idx):
    offs = offsets.tolist()
    rows = []
    for e in range(len(offs) - 1):
        src = idx[offs[e]:offs[e + 1]] if idx is not None else torch.arange(offs[e], offs[e + 1])
        rows.append(x.double()[src] @ w[e].double().T)
    return torch.cat(rows)


def _float64_experts(x, disp, gate_up, down):
    I = down.shape[2]
    h = _float64_grouped(x, gate_up, disp.offsets, disp.token)
    a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    return _float64_grouped(a, down, disp.offsets, None)


def _pinned_linear(dtype):
    """The linear's pointer kernel at the grouped GEMM's tile: the same tl.dot operands."""
    tile = dict(mtk.TILES[dtype])
    return lambda x, w: gemm.linear_triton(x, w, impl="pointer", tile=tile)


# --------------------------------------------------------------------------- CPU


def test_grid_bound_covers_every_load_and_tiles_pin_the_gemm_block_k():
    assert mtk.BLOCK_K == gemm.BLOCK_K == 64
    g = torch.Generator().manual_seed(3)
    for bm in sorted({c["BLOCK_M"] for c in mtk.TILES.values()}):
        for E in (1, 3, 64, 256):
            for R in (1, 2, 63, 64, 65, 1000, 32768):
                for skew in (0.0, 3.0):
                    p = torch.softmax(torch.randn(E, generator=g) * skew, 0)
                    counts = torch.bincount(torch.multinomial(p, R, replacement=True, generator=g), minlength=E)
                    tiles = int(((counts + bm - 1) // bm).sum())
                    assert tiles <= R // bm + min(E, R), (bm, E, R, counts.tolist())


def test_grouped_linear_errors_name_the_problem():
    x = torch.zeros(4, 8)
    w = torch.zeros(3, 5, 8)
    off = torch.tensor([0, 1, 2, 4])
    with pytest.raises(ValueError, match="weight must be"):
        mtk.grouped_linear(x, w[0], off)
    with pytest.raises(ValueError, match="x must be"):
        mtk.grouped_linear(torch.zeros(4, 7), w, off)
    with pytest.raises(TypeError, match="bfloat16"):
        mtk.grouped_linear(x.bfloat16(), w, off)
    with pytest.raises(ValueError, match="offsets must be"):
        mtk.grouped_linear(x, w, off[:3])


def _sm90_compile(kernel, values: dict, constexprs: dict, num_warps: int, num_stages: int):
    """Compile ``kernel`` for sm90 as the launcher would specialise it for these argument values:
    pointers and integers that are multiples of 16 get the divisibility hint, integers equal to 1
    become constants (Triton's runtime specialisation)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel._get() if hasattr(kernel, "_get") else kernel
    sig, cons, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        v = values[name]
        if isinstance(v, str):  # pointer type
            sig[name] = v
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif v == 1:
            sig[name] = "constexpr"
            cons[name] = 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature=sig, constexprs=cons, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _sm90_compile_available():
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as e:  # pragma: no cover - machine dependent
        return f"triton not importable ({type(e).__name__}: {e})"
    try:
        @triton.jit
        def _probe(x_ptr, B: tl.constexpr):
            i = tl.arange(0, B)
            tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)

        _sm90_compile(_probe, {"x_ptr": "*fp32"}, {"B": 16}, 4, 1)
    except Exception as e:  # pragma: no cover - machine dependent
        return f"triton.compile for a CUDA target unavailable here ({type(e).__name__}: {e})"
    return None


# Qwen3.5-MoE-like dims: H 2048, I 512 (gate_up [E, 1024, 2048], down [E, 2048, 512]), E 256
_QWEN = dict(H=2048, I=512, E=256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_grouped_kernels_compile_for_sm90_and_fit_shared_memory(dtype):
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET set: the lazy jit would hand out the interpreted kernel")
    why = _sm90_compile_available()
    if why:
        pytest.skip(why)
    ty = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    H, I, E = _QWEN["H"], _QWEN["I"], _QWEN["E"]
    cfg = mtk.TILES[dtype]
    wcfg = mtk.WGRAD_TILES[dtype]
    figures = {}
    # forward (and the input gradient, same kernel): gate_up with the token gather, down without
    for name, (N, K, gather) in {"gate_up": (2 * I, H, True), "down": (H, I, False),
                                 "dgrad_gate_up": (H, 2 * I, False)}.items():
        transposed = name.startswith("dgrad")
        vals = dict(x_ptr=ty, idx_ptr="*i64", w_ptr=ty, out_ptr="*fp32" if transposed else ty, offsets_ptr="*i64",
                    N=N, K=K, E=E, stride_xm=K, stride_xk=1, stride_we=N * K,
                    stride_wn=1 if transposed else K, stride_wk=N if transposed else 1,
                    stride_om=N, stride_on=1)
        k = _sm90_compile(mtk._grouped_gemm_kernel, vals,
                          dict(GATHER=gather, E_POW2=mtk._e_pow2(E), BLOCK_M=cfg["BLOCK_M"],
                               BLOCK_N=cfg["BLOCK_N"], BLOCK_K_=mtk.BLOCK_K),
                          cfg["num_warps"], cfg["num_stages"])
        figures[name] = k.metadata.shared
        assert k.metadata.shared <= H200_SHARED_BYTES, (name, dtype, k.metadata.shared)
        if dtype != torch.float32:
            assert "wgmma" in k.asm["ptx"], f"{name} {dtype}: the 16-bit dot did not lower to wgmma"
    # weight gradient: dW_gate_up [E, 2I, H] from g [R, 2I] and gathered x; dW_down [E, H, I]
    for name, (N, K, gather) in {"wgrad_gate_up": (2 * I, H, True), "wgrad_down": (H, I, False)}.items():
        vals = dict(g_ptr=ty, x_ptr=ty, idx_ptr="*i64", out_ptr=ty, offsets_ptr="*i64", N=N, K=K,
                    stride_gm=N, stride_gn=1, stride_xm=K, stride_xk=1, stride_oe=N * K, stride_on=K,
                    stride_ok=1)
        k = _sm90_compile(mtk._grouped_wgrad_kernel, vals,
                          dict(GATHER=gather, BLOCK_N=wcfg["BLOCK_N"], BLOCK_KW=wcfg["BLOCK_KW"],
                               BLOCK_R=wcfg["BLOCK_R"]),
                          wcfg["num_warps"], wcfg["num_stages"])
        figures[name] = k.metadata.shared
        assert k.metadata.shared <= H200_SHARED_BYTES, (name, dtype, k.metadata.shared)
    print(f"sm90 shared memory bytes ({dtype}): {figures}")


# --------------------------------------------------------------------------- Triton (interpreter)
# Each interp_case_* runs in the TRITON_INTERPRET=1 subprocess (conftest); fp32/fp16 only.


def _interp_loads_case(kb, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    T, k, E, H, I = 70, 2, 6, 96, 40  # expert 0: 70 rows (> one 64-row tile); 1: one row; 2: none
    ids = _ids_with_loads(T, k, E, g)
    disp = moe.dispatch(ids, E)
    counts = disp.counts.tolist()
    assert counts[0] == T > mtk.TILES[dtype]["BLOCK_M"] and counts[1] == 1 and counts[2] == 0, counts
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    return g, disp, x, gate_up, down


def _interp_grouped_matches_float64(kb, dtype):
    g, disp, x, gate_up, down = _interp_loads_case(kb, dtype, seed=21)
    h = mtk.grouped_linear(x, gate_up, disp.offsets, disp.token)
    assert h.dtype == dtype and h.shape == (disp.token.numel(), gate_up.shape[1])
    want = _float64_grouped(x, gate_up, disp.offsets, disp.token)
    assert kb.rel_l2(h, want) < kb.TOL[dtype], (dtype, kb.rel_l2(h, want))
    kb.assert_bitwise(mtk.grouped_linear(x, gate_up, disp.offsets, disp.token), h, f"{dtype} gather: twice")
    a = torch.randn(h.shape[0], down.shape[2], generator=g).to(dtype)  # rows read in place (no gather)
    y = mtk.grouped_linear(a, down, disp.offsets)
    want = _float64_grouped(a, down, disp.offsets, None)
    assert kb.rel_l2(y, want) < kb.TOL[dtype], (dtype, kb.rel_l2(y, want))
    kb.assert_bitwise(mtk.grouped_linear(a, down, disp.offsets), y, f"{dtype} rows: twice")
    # no rows at all
    empty = moe.dispatch(torch.zeros(0, 2, dtype=torch.long), gate_up.shape[0])
    assert mtk.grouped_linear(x, gate_up, empty.offsets, empty.token).shape == (0, gate_up.shape[1])


def interp_case_grouped_fp32_matches_float64_and_repeats_bitwise(kb):
    _interp_grouped_matches_float64(kb, torch.float32)


def interp_case_grouped_fp16_matches_float64_and_repeats_bitwise(kb):
    _interp_grouped_matches_float64(kb, torch.float16)


def interp_case_grouped_equals_the_linear_pointer_kernel_per_expert_bitwise(kb):
    # Both sides issue the same tl.dot operands (same tile; an expert's m-tiles start at its first
    # row as in the linear on its rows alone), so the kernel, not the host BLAS, fixes the bits.
    for dtype in (torch.float32, torch.float16):
        g, disp, x, gate_up, down = _interp_loads_case(kb, dtype, seed=22)
        h = mtk.grouped_linear(x, gate_up, disp.offsets, disp.token)
        lin = _pinned_linear(dtype)
        offs = disp.offsets.tolist()
        for e in range(len(offs) - 1):
            r0, r1 = offs[e], offs[e + 1]
            if r1 > r0:
                kb.assert_bitwise(h[r0:r1], lin(x[disp.token[r0:r1]], gate_up[e]), f"{dtype} expert {e}")
        # the whole expert layer: equal to the reference loop run on that linear
        y = mtk.experts_forward_triton(x, disp, gate_up, down)
        kb.assert_bitwise(y, moe.experts_forward(x, disp, gate_up, down, lin, silu_and_mul),
                          f"{dtype} experts_forward_triton vs the loop on the pinned linear")


def interp_case_grouped_row_unchanged_when_other_experts_or_later_tiles_change(kb):
    # The token's tile keeps the same rows in the same places; what moves is the tile's global
    # position (other experts' loads before it, a different program slot) and the tiles after it
    # (its expert gaining rows in a later tile). Load changes INSIDE its tile (1 row vs many) are
    # the GPU tests' job (module docstring).
    for dtype in (torch.float32, torch.float16):
        bm = mtk.TILES[dtype]["BLOCK_M"]
        g = torch.Generator().manual_seed(23)
        T, E, K, N = 2 * bm + 30, 5, 80, 72
        x = torch.randn(T, K, generator=g).to(dtype)
        w = (torch.randn(E, N, K, generator=g) / K ** 0.5).to(dtype)
        first = list(range(bm))  # expert 3: exactly one full tile holding tokens 0..bm-1
        base = [[], [5], list(range(0, T, 3)), first, [7, 9]]
        off, idx = _inputs(base)
        ref = mtk.grouped_linear(x, w, off, idx)[int(off[3]):int(off[3]) + bm]
        variants = {
            "other experts' loads": [list(range(T)), [], [1, 2], first, list(range(40))],
            "no rows before it": [[], [], [], first, []],
            "later tiles of its expert": [[], [5], list(range(0, T, 3)), list(range(T)), [7, 9]],
        }
        for what, lists in variants.items():
            off, idx = _inputs(lists)
            got = mtk.grouped_linear(x, w, off, idx)[int(off[3]):int(off[3]) + bm]
            kb.assert_bitwise(got, ref, f"{dtype}: {what}")


def interp_case_experts_forward_triton_matches_reference_and_float64(kb):
    for dtype in (torch.float32, torch.float16):
        g, disp, x, gate_up, down = _interp_loads_case(kb, dtype, seed=24)
        y = mtk.experts_forward_triton(x, disp, gate_up, down)
        ref = moe.experts_forward(x, disp, gate_up, down)
        assert y.dtype == ref.dtype == dtype and y.shape == ref.shape
        assert kb.rel_l2(y, ref.double()) < kb.TOL[dtype], (dtype, kb.rel_l2(y, ref.double()))
        want = _float64_experts(x, disp, gate_up, down)
        assert kb.rel_l2(y, want) < kb.TOL[dtype], (dtype, kb.rel_l2(y, want))
        kb.assert_bitwise(mtk.experts_forward_triton(x, disp, gate_up, down), y, f"{dtype}: twice")


def interp_case_experts_gradients_match_float64_and_repeat_bitwise(kb):
    g, disp, x, gate_up, down = _interp_loads_case(kb, torch.float32, seed=25)
    wy = torch.randn(disp.token.numel(), x.shape[1], generator=g)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
        y = mtk.experts_forward_triton(leaves[0], disp, leaves[1], leaves[2])
        (y * wy).sum().backward()
        return [t.grad for t in leaves]

    got = grads()
    leaves = [t.double().requires_grad_() for t in (x, gate_up, down)]
    (_float64_experts(leaves[0], disp, leaves[1], leaves[2]) * wy.double()).sum().backward()
    for name, a, b in zip(("x", "gate_up", "down"), got, leaves):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert kb.rel_l2(a, b.grad) < 1e-5, (name, kb.rel_l2(a, b.grad))
    assert float(got[1][2].abs().max()) == 0.0, "the expert with no rows got a weight gradient"
    for name, a, b in zip(("x", "gate_up", "down"), grads(), got):
        kb.assert_bitwise(a, b, f"grad {name}: twice")


def interp_case_experts_of_no_row_give_zero_weight_gradients(kb):
    # a batch of no token (the FSDP2 trainer's empty pass): the forward launches nothing, and the
    # backward returns zeros for both stacked weights (not None: every rank's reduce-scatter must
    # see the same parameters) and an empty input gradient, for the gathered gate_up as well
    for dtype in (torch.float32, torch.float16):
        g, _, x, gate_up, down = _interp_loads_case(kb, dtype, seed=26)
        empty = moe.dispatch(torch.zeros(0, 2, dtype=torch.long), gate_up.shape[0])
        leaves = [x[:0].clone().requires_grad_(), gate_up.clone().requires_grad_(), down.clone().requires_grad_()]
        y = mtk.experts_forward_triton(leaves[0], empty, leaves[1], leaves[2])
        assert y.shape == (0, x.shape[1]) and y.dtype == dtype and y.requires_grad
        y.backward(torch.zeros_like(y))
        for name, t in zip(("x", "gate_up", "down"), leaves):
            assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == dtype, (dtype, name)
            assert int(torch.count_nonzero(t.grad)) == 0, (dtype, name)


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_grouped_gemm_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_moe_grouped_gemm", case)


# --------------------------------------------------------------------------- CUDA
# bf16 at Qwen3.5-MoE-like dims: H 2048, I 512, k 8, E 64/128/256.

# with k = 8, 1023 and 1024 tokens sit on both sides of the grouped GEMM's tile switch
# (triton_kernels.LARGE_ROWS = 8192 dispatch rows)
CUDA_TOKENS = (1, 2, 3, 8, 16, 63, 64, 65, 256, 1000, 1023, 1024, 4096)


def _cuda_layer(E, seed, H=_QWEN["H"], I=_QWEN["I"], dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype).cuda()
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype).cuda()
    return g, gate_up, down


def _random_ids(T, k, E, g):
    return torch.stack([torch.randperm(E, generator=g)[:k].sort().values for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)


def _token_rows(y, disp, t):
    """The k expert rows of token t in slot order (ascending expert)."""
    k = disp.top_k
    return y[disp.row_of_pair[t * k:(t + 1) * k]]


def test_the_gpu_token_counts_cross_the_grouped_tile_switch():
    # the GPU gates below must see both launches of the grouped GEMM (k = 8)
    rows = [T * 8 for T in CUDA_TOKENS]
    assert min(rows) < mtk.LARGE_ROWS <= max(rows)
    assert mtk.grouped_tile(mtk.LARGE_ROWS - 1, torch.bfloat16) != mtk.grouped_tile(mtk.LARGE_ROWS, torch.bfloat16)
    for tiles in (mtk.TILES, mtk.TILES_LARGE):
        assert all("BLOCK_K" not in t and "BLOCK_K_" not in t for t in tiles.values())


@pytest.mark.gpu
@pytest.mark.parametrize("E", [64, 128, 256])
def test_cuda_token_rows_bitwise_alone_in_batch_and_any_load(kb, E):
    k = 8
    g, gate_up, down = _cuda_layer(E, seed=100 + E)
    H = gate_up.shape[2]
    row = torch.randn(H, generator=g).bfloat16()
    mine = torch.arange(k)  # the token's experts: 0..7
    alone_disp = moe.dispatch(mine[None].cuda(), E)
    alone = mtk.experts_forward_triton(row[None].cuda(), alone_disp, gate_up, down)
    assert alone_disp.counts[:k].tolist() == [1] * k
    checked = 0
    for T in CUDA_TOKENS:
        for skew in ("uniform", "all_on_mine"):
            batch, idx = kb.needle_batch(row, T, g)
            ids = _random_ids(T, k, E, g)
            if skew == "all_on_mine":  # every token picks the token's experts: loads T each
                ids[:] = mine
            ids[idx] = mine
            disp = moe.dispatch(ids.cuda(), E)
            y = mtk.experts_forward_triton(batch.cuda(), disp, gate_up, down)
            kb.assert_bitwise(_token_rows(y, disp, idx), alone, f"E={E} T={T} {skew} token {idx}")
            kb.assert_bitwise(moe.moe_experts(batch.cuda(), disp, gate_up, down), y, f"E={E} T={T}: region")
            checked += 1
    assert checked == 2 * len(CUDA_TOKENS)
    want = _float64_experts(row[None], moe.dispatch(mine[None], E), gate_up.cpu(), down.cpu())
    assert kb.rel_l2(alone, want) < kb.TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("E", [64, 128, 256])
def test_cuda_grouped_equals_the_invariant_linear_per_expert_bitwise(kb, E):
    k = 8
    g, gate_up, down = _cuda_layer(E, seed=200 + E)
    H = gate_up.shape[2]
    for T in (1, 5, 64, 300, 4096):
        x = torch.randn(T, H, generator=g).bfloat16().cuda()
        ids = _random_ids(T, k, E, g)
        ids[: T // 2] = torch.arange(k)  # heavy experts 0..7 (many tiles at large T) beside light ones
        disp = moe.dispatch(ids.cuda(), E)
        h = mtk.grouped_linear(x, gate_up, disp.offsets, disp.token)
        offs = disp.offsets.tolist()
        for e in range(E):
            r0, r1 = offs[e], offs[e + 1]
            if r1 > r0:
                kb.assert_bitwise(h[r0:r1], gemm.linear(x[disp.token[r0:r1]], gate_up[e]), f"E={E} T={T} expert {e}")
        y = mtk.experts_forward_triton(x, disp, gate_up, down)
        loop = moe.experts_forward(x, disp, gate_up, down, gemm.linear, silu_and_mul)
        kb.assert_bitwise(y, loop, f"E={E} T={T}: grouped vs loop of the invariant linear")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_gradients_match_float64_and_repeat_bitwise(kb, dtype):
    g = torch.Generator().manual_seed(300)
    T, k, E, H, I = 90, 4, 8, 136, 48
    # every token picks expert 0 (90 rows: two m-tiles) and 3 of experts 1..6; expert 7 gets none
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long),
                                  (torch.randperm(6, generator=g)[:k - 1] + 1).sort().values]) for _ in range(T)])
    disp = moe.dispatch(ids.cuda(), E)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    wy = torch.randn(T * k, H, generator=g)

    def grads():
        leaves = [t.cuda().requires_grad_() for t in (x, gate_up, down)]
        y = mtk.experts_forward_triton(leaves[0], disp, leaves[1], leaves[2])
        (y.float() * wy.cuda()).sum().backward()
        return [t.grad for t in leaves]

    got = grads()
    leaves = [t.double().requires_grad_() for t in (x, gate_up, down)]
    (_float64_experts(leaves[0], moe.dispatch(ids, E), leaves[1], leaves[2]) * wy.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("x", "gate_up", "down"), got, leaves):
        assert a.dtype == dtype and a.shape == b.shape
        assert kb.rel_l2(a, b.grad) < tol, (name, dtype, kb.rel_l2(a, b.grad))
    assert float(got[1][7].abs().max()) == 0.0, "the expert with no rows got a weight gradient"
    for name, a, b in zip(("x", "gate_up", "down"), grads(), got):
        kb.assert_bitwise(a, b, f"{dtype} grad {name}: twice")


@pytest.mark.gpu
def test_cuda_experts_capture_in_a_cuda_graph_and_replay_bitwise(kb):
    E, k, T = 64, 8, 48
    g, gate_up, down = _cuda_layer(E, seed=400)
    x = torch.randn(T, gate_up.shape[2], generator=g).bfloat16().cuda()
    disp = moe.dispatch(_random_ids(T, k, E, g).cuda(), E)
    eager = mtk.experts_forward_triton(x, disp, gate_up, down)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mtk.experts_forward_triton(x, disp, gate_up, down)  # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mtk.experts_forward_triton(x, disp, gate_up, down)
    # new routing of the same size: the captured launches read offsets and tokens on the device
    new = moe.dispatch(_random_ids(T, k, E, g).cuda(), E)
    disp.token.copy_(new.token)
    disp.offsets.copy_(new.offsets)
    graph.replay()
    kb.assert_bitwise(out, mtk.experts_forward_triton(x, new, gate_up, down), "graph replay, new routing")
    assert kb.bit_report(out, eager)["differing"] > 0, "new routing gave the old rows"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["softmax_topk", "sigmoid_group_topk"])
def test_cuda_moe_forward_token_alone_equals_token_in_batch_bitwise(kb, kind):
    # the dispatcher's CUDA path (Triton linear, grouped-GEMM experts, torch combine)
    g = torch.Generator().manual_seed(500)
    E, H, I, Is = 64, 256, 128, 128
    kw = dict(kind=kind, top_k=8, norm_topk_prob=True)
    if kind == "sigmoid_group_topk":
        kw.update(n_group=8, topk_group=4, routed_scaling_factor=2.5)
    w = moe.MoEWeights(
        router=torch.randn(E, H, generator=g).cuda() / H ** 0.5,
        gate_up=(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16().cuda(),
        down=(torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16().cuda(),
        correction_bias=(torch.randn(E, generator=g) * 0.1).cuda() if kind == "sigmoid_group_topk" else None,
        shared_gate_up=(torch.randn(2 * Is, H, generator=g) / H ** 0.5).bfloat16().cuda(),
        shared_down=(torch.randn(H, Is, generator=g) / Is ** 0.5).bfloat16().cuda(),
        shared_gate=torch.randn(1, H, generator=g).cuda() / H ** 0.5 if kind == "softmax_topk" else None,
    )
    row = torch.randn(H, generator=g).bfloat16()
    alone = moe.moe_forward(row[None].cuda(), w, **kw)[0]
    for T in CUDA_TOKENS:
        batch, idx = kb.needle_batch(row, T, g)
        kb.assert_bitwise(moe.moe_forward(batch.cuda(), w, **kw)[idx], alone, f"{kind} T={T} token {idx}")
    ref = moe.moe_forward_reference(batch, moe.MoEWeights(**{k: (v.cpu() if v is not None else None)
                                                             for k, v in vars(w).items()}), **kw)
    out = moe.moe_forward(batch.cuda(), w, **kw)
    assert kb.rel_l2(out, ref.double()) < 2 * kb.TOL[torch.bfloat16]
