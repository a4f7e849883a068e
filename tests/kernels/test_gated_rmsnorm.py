"""Gates for the gated output RMSNorm (isoexec_kernels/gated_rmsnorm/), the attention output gate
(isoexec_kernels/sigmoid_gate/) and the zero-centred RMSNorm (isoexec_kernels/rmsnorm/, zero_centred=True):
float64 correctness, the stock twins, row invariance, backward; the default RMSNorm path unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from isoexec_kernels import gated_rmsnorm, rmsnorm, sigmoid_gate

EPS = 1e-6


def _gated64(x, z, w):
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    return n * w.double() * F.silu(z.double())


def _zc64(x, w):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * (1 + w.double())


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    z = (torch.randn(shape, generator=g) * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, z, w, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_matches_float64_and_native(kb, dtype):
    x, z, w, _ = _data((7, 4, 48), dtype, 1)
    want = _gated64(x, z, w)
    out = gated_rmsnorm.gated_rms_norm(x, z, w, EPS)
    assert out.dtype == dtype and kb.rel_l2(out, want) < kb.TOL[dtype]
    assert kb.rel_l2(gated_rmsnorm.gated_rms_norm_native(x, z, w, EPS), want) < kb.TOL[dtype]


def test_gated_norm_row_in_batch_equals_row_alone_bitwise(kb):
    x, z, w, g = _data((1, 100), torch.bfloat16, 2)
    alone = gated_rmsnorm.gated_rms_norm(x, z, w, EPS)[0]
    for m in (2, 17, 64, 129):
        xb, idx = kb.needle_batch(x[0], m, g)
        zb = torch.randn(m, 100, generator=g).bfloat16()
        zb[idx] = z[0]
        kb.assert_bitwise(gated_rmsnorm.gated_rms_norm(xb, zb, w, EPS)[idx], alone, f"M={m}")


def test_gated_norm_backward_matches_float64():
    x, z, w, g = _data((9, 32), torch.float32, 3)
    dy = torch.randn(9, 32, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, z, w)]
    gated_rmsnorm.gated_rms_norm(*leaves, EPS).backward(dy)
    l64 = [t.double().requires_grad_() for t in (x, z, w)]
    _gated64(*l64).backward(dy.double())
    for name, a, b in zip("xzw", leaves, l64):
        assert ((a.grad.double() - b.grad).norm() / b.grad.norm()) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_matches_float64_native_and_is_position_free(kb, dtype):
    x, z, _, g = _data((5, 77), dtype, 4)
    want = x.double() * torch.sigmoid(z.double())
    out = sigmoid_gate.sigmoid_gate(x, z)
    assert kb.rel_l2(out, want) < kb.TOL[dtype]
    assert kb.rel_l2(sigmoid_gate.sigmoid_gate_native(x, z), want) < kb.TOL[dtype]
    alone = sigmoid_gate.sigmoid_gate(x[2:3, 5:], z[2:3, 5:])
    kb.assert_bitwise(out[2:3, 5:], alone, "element bits independent of position")
    xl, zl = x.float().clone().requires_grad_(), z.float().clone().requires_grad_()
    dy = torch.randn(5, 77, generator=g)
    sigmoid_gate.sigmoid_gate(xl, zl).backward(dy)
    x6, z6 = x.detach().double().requires_grad_(), z.detach().double().requires_grad_()
    (x6 * torch.sigmoid(z6)).backward(dy.double())
    assert kb.rel_l2(xl.grad, x6.grad) < 1e-6 and kb.rel_l2(zl.grad, z6.grad) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_matches_float64_and_native(kb, dtype):
    x, _, _, g = _data((9, 3, 64), dtype, 5)
    w = (0.1 * torch.randn(64, generator=g)).to(dtype)
    want = _zc64(x, w)
    out = rmsnorm.rms_norm(x, w, EPS, zero_centred=True)
    assert out.dtype == dtype and kb.rel_l2(out, want) < kb.TOL[dtype]
    assert kb.rel_l2(rmsnorm.rms_norm_native(x, w, EPS, zero_centred=True), want) < kb.TOL[dtype]
    # not the plain formula: with w near 0 the plain norm would scale by ~0
    assert kb.rel_l2(rmsnorm.rms_norm(x, w, EPS), want) > 0.5


def test_zero_centred_rms_norm_row_invariant_and_backward(kb):
    x, _, _, g = _data((1, 96), torch.bfloat16, 6)
    w = (0.1 * torch.randn(96, generator=g)).bfloat16()
    alone = rmsnorm.rms_norm(x, w, EPS, zero_centred=True)[0]
    for m in (3, 64, 65):
        xb, idx = kb.needle_batch(x[0], m, g)
        kb.assert_bitwise(rmsnorm.rms_norm(xb, w, EPS, zero_centred=True)[idx], alone, f"M={m}")
    xf = torch.randn(8, 40, generator=g).requires_grad_()
    wf = (0.1 * torch.randn(40, generator=g)).requires_grad_()
    dy = torch.randn(8, 40, generator=g)
    rmsnorm.rms_norm(xf, wf, EPS, zero_centred=True).backward(dy)
    x6, w6 = xf.detach().double().requires_grad_(), wf.detach().double().requires_grad_()
    _zc64(x6, w6).backward(dy.double())
    assert kb.rel_l2(xf.grad, x6.grad) < 1e-5 and kb.rel_l2(wf.grad, w6.grad) < 1e-5


def test_default_rms_norm_bits_unchanged_by_the_zero_centred_flag(kb):
    """zero_centred=False is the Qwen3 formula; (1 + w) as plain weight in fp32 matches the flag."""
    x, _, _, g = _data((6, 64), torch.float32, 7)
    w = 0.1 * torch.randn(64, generator=g)
    kb.assert_bitwise(rmsnorm.rms_norm(x, w, EPS, zero_centred=False), rmsnorm.rms_norm(x, w, EPS), "default")
    kb.assert_bitwise(rmsnorm.rms_norm(x, w, EPS, zero_centred=True), rmsnorm.rms_norm(x, 1.0 + w, EPS),
                      "fp32: (x_hat * (1 + w)) == plain norm with weight 1 + w")


# --------------------------------------------------------------------------- Triton (interpreter)


def interp_case_gated_norm_and_gate_triton_match_reference(kb):
    for dtype in (torch.float32, torch.float16):
        x, z, w, g = _data((11, 48), dtype, 8)
        ref = gated_rmsnorm.gated_rms_norm_reference(x, z, w, EPS)
        tri = gated_rmsnorm.gated_rms_norm_triton(x, z, w, EPS)
        assert kb.rel_l2(tri, ref) < kb.TOL[dtype]
        kb.assert_bitwise(gated_rmsnorm.gated_rms_norm_triton(x[4:5], z[4:5], w, EPS)[0], tri[4], "row alone")
        s_ref = sigmoid_gate.sigmoid_gate_reference(x, z)
        s_tri = sigmoid_gate.sigmoid_gate_triton(x, z)
        assert kb.rel_l2(s_tri, s_ref) < kb.TOL[dtype]


def interp_case_zero_centred_rms_norm_triton_matches_reference(kb):
    x, _, _, g = _data((7, 48), torch.float32, 9)
    w = 0.1 * torch.randn(48, generator=g)
    ref = rmsnorm.rms_norm_reference(x, w, EPS, zero_centred=True)
    tri = rmsnorm.rms_norm_triton(x, w, EPS, zero_centred=True)
    assert kb.rel_l2(tri, ref) < 1e-6
    dy = torch.randn(7, 48, generator=g)
    _, rstd = rmsnorm.triton_kernels._triton_fwd(x, w, EPS, True)
    dx_t, dw_t = rmsnorm.rms_norm_backward_triton(dy, x, w, rstd, True)
    dx_r, dw_r = rmsnorm.rms_norm_backward_reference(dy, x, w, rstd, True)
    assert kb.rel_l2(dx_t, dx_r) < 1e-6 and kb.rel_l2(dw_t, dw_r) < 1e-6


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_gated_norms_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gated_rmsnorm", case)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_gated_norms_cuda_match_float64_and_are_row_invariant(kb):
    x, z, w, g = _data((300, 32, 128), torch.bfloat16, 10)
    x, z, w = x.cuda(), z.cuda(), w.cuda()
    out = gated_rmsnorm.gated_rms_norm(x, z, w, EPS)
    assert kb.rel_l2(out, _gated64(x.cpu(), z.cpu(), w.cpu())) < 1e-2
    kb.assert_bitwise(gated_rmsnorm.gated_rms_norm(x[7:8], z[7:8], w, EPS)[0], out[7], "cuda row alone")
    wz = (0.1 * torch.randn(4096, generator=g)).bfloat16().cuda()
    h = torch.randn(257, 4096, generator=g).bfloat16().cuda()
    zc = rmsnorm.rms_norm(h, wz, EPS, zero_centred=True)
    assert kb.rel_l2(zc, _zc64(h.cpu(), wz.cpu())) < 1e-2
    kb.assert_bitwise(rmsnorm.rms_norm(h[100:101], wz, EPS, zero_centred=True)[0], zc[100], "cuda zc row alone")
    s = sigmoid_gate.sigmoid_gate(h, h.flip(0))
    kb.assert_bitwise(sigmoid_gate.sigmoid_gate(h[5:6], h.flip(0)[5:6])[0], s[5], "cuda gate row alone")
