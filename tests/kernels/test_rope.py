"""Gates for the rotary embedding (isoexec_kernels/rope/) and the position-free sin/cos."""

from __future__ import annotations

import math

import pytest
import torch

from isoexec_kernels import _ref, rope

THETA = 1e6


def _f64_rope(x, positions, R, theta=THETA):
    """float64 RoPE from the same fp32 phases (transformers' formula)."""
    inv = rope.reference._inv_freq(R, theta)
    phase = (positions.float()[:, None] * inv[None, :]).double()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos, sin = torch.cos(phase).reshape(shape), torch.sin(phase).reshape(shape)
    xd = x.double()
    x1, x2 = xd[..., : R // 2], xd[..., R // 2:R]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xd[..., R:]], dim=-1)


def test_sincos64_is_accurate_over_the_rope_phase_range():
    p = torch.cat([torch.linspace(-10, 10, 5001), torch.linspace(0, 1.5e6, 5001)]).double()
    s, c = _ref.sincos64(p)
    assert (s - torch.sin(p)).abs().max() < 1e-15
    assert (c - torch.cos(p)).abs().max() < 1e-15
    with pytest.raises(ValueError, match="range"):
        _ref.sincos64(torch.tensor([2e6], dtype=torch.float64))


def test_inv_freq_matches_transformers_formula_within_one_ulp(kb):
    for R, theta in ((64, 1e6), (128, 1e6), (128, 1e4), (32, 5e5)):
        hf = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R))
        ours = rope.reference._inv_freq(R, theta)
        assert int((kb.bits(hf).long() - kb.bits(ours).long()).abs().max()) <= 1


def test_cache_row_depends_only_on_its_position_bitwise(kb):
    small = rope.rope_cache(50, 64, THETA)
    big = rope.rope_cache(1500, 64, THETA)
    kb.assert_bitwise(big[:50], small, "rows 0..49 of two cache sizes")
    pos = torch.tensor([1499, 7, 0, 1234])
    kb.assert_bitwise(rope.rope_cos_sin(pos, 64, THETA), big[pos], "on-the-fly rows vs cache")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,R", [(64, 64), (128, 32)])
def test_apply_rope_matches_float64(kb, dtype, D, R):
    g = torch.Generator().manual_seed(D + R)
    T, NH = 11, 3
    x = torch.randn(T, NH, D, generator=g).to(dtype)
    pos = torch.randint(0, 40000, (T,), generator=g)
    cache = rope.rope_cos_sin(pos, R, THETA)  # rows for these positions only
    out = rope.apply_rope(x, torch.arange(T), cache)
    assert out.dtype == dtype and out.shape == x.shape
    assert kb.rel_l2(out, _f64_rope(x, pos, R)) < kb.TOL[dtype]
    assert kb.rel_l2(rope.apply_rope_native(x, pos, theta=THETA, rotary_dim=R), _f64_rope(x, pos, R)) < 2e-2
    # partial rotary: the pass-through channels are copied bit for bit
    if R < D:
        kb.assert_bitwise(out[..., R:], x[..., R:], "pass-through channels")
    # theta form builds the same rows
    kb.assert_bitwise(rope.apply_rope(x, pos, theta=THETA, rotary_dim=R), out, "theta form")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_token_alone_equals_token_in_batch_bitwise(kb, dtype):
    g = torch.Generator().manual_seed(1)
    NH, D = 4, 64
    cache = rope.rope_cache(1000, D, THETA)
    tok = torch.randn(NH, D, generator=g).to(dtype)
    p = 987
    alone = rope.apply_rope(tok[None], torch.tensor([p]), cache)[0]
    for m in (2, 7, 64, 200):
        batch, idx = kb.needle_batch(tok, m, g)
        pos = torch.randint(0, 1000, (m,), generator=g)
        pos[idx] = p
        kb.assert_bitwise(rope.apply_rope(batch, pos, cache)[idx], alone, f"M={m} row {idx}")


def test_apply_rope_hazards_zeros_and_noncontiguous(kb):
    g = torch.Generator().manual_seed(2)
    T, NH, D = 6, 2, 32
    cache = rope.rope_cache(100, D, THETA)
    pos = torch.arange(T)
    x = torch.randn(T, NH, D, generator=g)
    x[0] = -0.0
    out = rope.apply_rope(x, pos, cache)
    assert bool((out[0] == 0).all())
    qkv = torch.randn(T, 3 * NH * D, generator=g)
    k = qkv[:, NH * D: 2 * NH * D].view(T, NH, D)  # strided view of the k heads
    kb.assert_bitwise(rope.apply_rope(k, pos, cache), rope.apply_rope(k.contiguous(), pos, cache),
                      "strided heads")


def test_apply_rope_gradient_matches_float64(kb):
    g = torch.Generator().manual_seed(3)
    T, NH, D = 5, 2, 32
    cache = rope.rope_cache(64, D, THETA)
    pos = torch.randint(0, 64, (T,), generator=g)
    x = torch.randn(T, NH, D, generator=g).requires_grad_()
    dy = torch.randn(T, NH, D, generator=g)
    rope.apply_rope(x, pos, cache).backward(dy)
    x64 = x.detach().double().requires_grad_()
    _f64_rope(x64, pos, D).backward(dy.double())
    assert kb.rel_l2(x.grad, x64.grad) < 1e-6


def test_apply_rope_errors_name_the_problem():
    cache = rope.rope_cache(10, 16, THETA)
    with pytest.raises(ValueError, match="positions"):
        rope.apply_rope(torch.randn(3, 2, 16), torch.arange(4), cache)
    with pytest.raises(ValueError, match="cos_sin_cache or theta"):
        rope.apply_rope(torch.randn(3, 2, 16), torch.arange(3))
    assert math.isfinite(float(cache.sum()))


# --------------------------------------------------------------------------- Triton (interpreter)


def interp_case_rope_triton_equals_reference_bitwise(kb):
    for dtype in (torch.float32, torch.float16):
        for D, R in ((64, 64), (48, 16)):
            g = torch.Generator().manual_seed(D + R)
            T, NH = 9, 3
            x = torch.randn(T, NH, D, generator=g).to(dtype)
            pos = torch.randint(0, 1000, (T,), generator=g)
            cache = rope.rope_cache(1000, R, THETA)
            kb.assert_bitwise(rope.apply_rope_triton(x, pos, cache),
                              rope.apply_rope_reference(x, pos, cache), f"{dtype} D={D} R={R}")


def interp_case_rope_triton_backward_is_the_transposed_rotation(kb):
    for D, R in ((64, 64), (48, 16)):
        g = torch.Generator().manual_seed(7 * D + R)
        T, NH = 9, 3
        x = torch.randn(T, NH, D, generator=g)
        dy = torch.randn(T, NH, D, generator=g)
        pos = torch.randint(0, 1000, (T,), generator=g)
        cache = rope.rope_cache(1000, R, THETA)
        dx = rope.triton_kernels._rope_triton(dy, pos, cache, transpose=True)
        x64 = x.double().requires_grad_()
        _f64_rope(x64, pos, R).backward(dy.double())
        assert kb.rel_l2(dx, x64.grad) < 1e-6
        kb.assert_bitwise(dx[..., R:], dy[..., R:], "pass-through channels")
        # the transposed rotation undoes the rotation (to fp32 rounding)
        back = rope.triton_kernels._rope_triton(rope.apply_rope_triton(x, pos, cache), pos, cache, transpose=True)
        assert kb.rel_l2(back, x) < 1e-6


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_rope_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_rope", case)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cuda_triton_equals_cpu_reference_bitwise(kb, dtype):
    g = torch.Generator().manual_seed(4)
    T, NH, D = 300, 16, 128
    x = torch.randn(T, NH, D, generator=g).to(dtype)
    pos = torch.randint(0, 32768, (T,), generator=g)
    cache = rope.rope_cache(32768, D, THETA)
    want = rope.apply_rope_reference(x, pos, cache)
    got = rope.apply_rope(x.cuda(), pos.cuda(), cache.cuda())
    kb.assert_bitwise(got, want, "cuda triton vs cpu reference")
    # the autograd path on CUDA (Triton forward of _RopeFn) gives the same bits
    xg = x.cuda().requires_grad_()
    out = rope.apply_rope(xg, pos.cuda(), cache.cuda())
    kb.assert_bitwise(out, got, "cuda grad path")
    dy = torch.randn(T, NH, D, generator=g).to(dtype)
    out.backward(dy.cuda())
    x64 = x.double().requires_grad_()
    _f64_rope(x64, pos, D).backward(dy.double())
    assert kb.rel_l2(xg.grad, x64.grad) < kb.TOL[dtype]
