"""Gates for the batch-invariant RMSNorm (isoexec_kernels/rmsnorm/)."""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import rmsnorm

DTYPES = (torch.float32, torch.bfloat16)
BATCH_SIZES = (1, 2, 3, 5, 8, 16, 31, 64, 65, 100, 128, 129, 200, 256)
EPS = 1e-6


def _weight(H, dtype, g):
    return (1.0 + 0.1 * torch.randn(H, generator=g)).to(dtype)


def _f64(x, w, eps=EPS):
    xd = x.double()
    return w.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [64, 100, 256])
def test_rms_norm_matches_float64(kb, dtype, H):
    g = torch.Generator().manual_seed(H)
    x = (torch.randn(9, H, generator=g) * 3).to(dtype)
    w = _weight(H, dtype, g)
    out = rmsnorm.rms_norm(x, w, EPS)
    assert out.dtype == dtype
    assert kb.rel_l2(out, _f64(x, w)) < kb.TOL[dtype]
    assert kb.rel_l2(rmsnorm.rms_norm_native(x, w, EPS), _f64(x, w)) < kb.TOL[dtype]


def test_rms_norm_fp32_weight_on_bf16_input_promotes_like_qwen3(kb):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g).bfloat16()
    w = _weight(64, torch.float32, g)
    out = rmsnorm.rms_norm(x, w, EPS)
    assert out.dtype == torch.float32
    assert kb.rel_l2(out, rmsnorm.rms_norm_native(x, w, EPS)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_alone_equals_row_in_batch_bitwise(kb, dtype):
    g = torch.Generator().manual_seed(3)
    H = 96
    w = _weight(H, dtype, g)
    for m in BATCH_SIZES:
        row = (torch.randn(H, generator=g) * 2).to(dtype)
        alone = rmsnorm.rms_norm(row[None], w, EPS)[0]
        batch, idx = kb.needle_batch(row, m, g)
        kb.assert_bitwise(rmsnorm.rms_norm(batch, w, EPS)[idx], alone, f"M={m} row {idx}")


def test_rms_norm_per_head_qk_norm_each_head_alone_equals_in_batch_bitwise(kb):
    g = torch.Generator().manual_seed(4)
    T, NH, D = 12, 4, 32
    w = _weight(D, torch.bfloat16, g)
    x = torch.randn(T, NH, D, generator=g).bfloat16()
    out = rmsnorm.rms_norm(x, w, EPS)
    assert out.shape == (T, NH, D)
    kb.assert_bitwise(rmsnorm.rms_norm(x[5, 2][None], w, EPS)[0], out[5, 2], "one head alone")
    # a strided view of the heads (e.g. q out of a fused qkv) gives the same bits
    qkv = torch.randn(T, 3 * NH * D, generator=g).bfloat16()
    q = qkv[:, : NH * D].view(T, NH, D)
    kb.assert_bitwise(rmsnorm.rms_norm(q, w, EPS), rmsnorm.rms_norm(q.contiguous(), w, EPS),
                      "strided heads")


def test_rms_norm_hazards_signed_zeros_subnormals_odd_hidden(kb):
    g = torch.Generator().manual_seed(5)
    H = 100  # not a power of two
    w = _weight(H, torch.float32, g)
    x = torch.randn(6, H, generator=g)
    x[0] = -0.0
    x[1, ::2] = 3e-39  # subnormal
    x[1, 1::2] = 0.0
    x[2, :] = 1e-20  # tiny: var underflows, eps dominates
    assert int(((x.abs() < 1.2e-38) & (x != 0)).sum()) > 0 and bool(torch.signbit(x[0]).all())
    out = rmsnorm.rms_norm(x, w, EPS)
    assert torch.isfinite(out).all()
    for i in range(3):
        kb.assert_bitwise(rmsnorm.rms_norm(x[i:i + 1], w, EPS)[0], out[i], f"hazard row {i}")
    assert bool((out[0] == 0).all())
    assert rmsnorm.rms_norm(torch.zeros(0, H), w, EPS).shape == (0, H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gradients_match_float64(kb, dtype):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 7, 80, generator=g).to(dtype).requires_grad_()
    w = _weight(80, dtype, g).requires_grad_()
    dy = torch.randn(2, 7, 80, generator=g).to(dtype)
    rmsnorm.rms_norm(x, w, EPS).backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    _f64(x64, w64).backward(dy.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert kb.rel_l2(x.grad, x64.grad) < tol
    assert kb.rel_l2(w.grad, w64.grad) < tol


def test_rms_norm_grad_x_row_alone_equals_row_in_batch_bitwise(kb):
    g = torch.Generator().manual_seed(7)
    H = 64
    w = _weight(H, torch.float32, g)
    row, dy_row = torch.randn(H, generator=g), torch.randn(H, generator=g)

    def grad_x(xs, dys):
        xs = xs.clone().requires_grad_()
        rmsnorm.rms_norm(xs, w, EPS).backward(dys)
        return xs.grad

    alone = grad_x(row[None], dy_row[None])[0]
    for m in (2, 65, 200):
        xb, idx = kb.needle_batch(row, m, g)
        dyb = torch.randn(m, H, generator=g)
        dyb[idx] = dy_row
        kb.assert_bitwise(grad_x(xb, dyb)[idx], alone, f"grad M={m}")


def test_rms_norm_forward_with_and_without_autograd_is_bitwise_equal(kb):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w = _weight(64, torch.bfloat16, g)
    with torch.no_grad():
        plain = rmsnorm.rms_norm(x, w, EPS)
    kb.assert_bitwise(rmsnorm.rms_norm(x.clone().requires_grad_(), w, EPS), plain, "grad vs no grad")


def test_rms_norm_errors_name_the_problem():
    with pytest.raises(ValueError, match="weight must be"):
        rmsnorm.rms_norm(torch.randn(2, 8), torch.ones(7))


# --------------------------------------------------------------------------- Triton (interpreter)


def interp_case_rms_norm_matches_float64_and_row_invariant(kb):
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(9)
        H = 100
        w = _weight(H, dtype, g)
        row = torch.randn(H, generator=g).to(dtype)
        alone = rmsnorm.rms_norm_triton(row[None], w, EPS)[0]
        for m in (1, 17, 64):
            batch, idx = kb.needle_batch(row, m, g)
            out = rmsnorm.rms_norm_triton(batch, w, EPS)
            assert kb.rel_l2(out, _f64(batch, w)) < kb.TOL[dtype]
            kb.assert_bitwise(out[idx], alone, f"{dtype} M={m}")


def interp_case_rms_norm_head_strided_view_read_in_place_equals_contiguous_copy_bitwise(kb):
    # a q slice of a fused qkv output: [T, heads, D] with a token stride wider than heads * D
    g = torch.Generator().manual_seed(13)
    for dtype in (torch.float32, torch.float16):
        qkv = torch.randn(5, 6 * 16 + 24, generator=g).to(dtype)
        q = qkv[:, :6 * 16].reshape(5, 6, 16)
        w = _weight(16, dtype, g)
        assert rmsnorm.triton_kernels.triton_rows(q) is q            # read in place, no copy
        got = rmsnorm.rms_norm_triton(q, w, EPS)
        kb.assert_bitwise(got, rmsnorm.rms_norm_triton(q.contiguous(), w, EPS), f"{dtype} strided vs copy")
        assert got.shape == q.shape and kb.rel_l2(got, _f64(q, w)) < kb.TOL[dtype]


def interp_case_rms_norm_two_weights_in_one_launch_equal_two_calls_bitwise(kb):
    # the q and k norms of a fused qkv output as one launch over its [T, q + k heads, D] slice
    g = torch.Generator().manual_seed(15)
    for dtype in (torch.float32, torch.float16):
        qkv = torch.randn(5, (6 + 2 + 2) * 16, generator=g).to(dtype)
        qk = qkv[:, :8 * 16].reshape(5, 8, 16)
        wq, wk = _weight(16, dtype, g), _weight(16, dtype, g)
        out, _ = rmsnorm.triton_kernels._triton_fwd(qk, wq, EPS, False, wk, 6)
        want = torch.cat([rmsnorm.rms_norm_triton(qk[:, :6], wq, EPS), rmsnorm.rms_norm_triton(qk[:, 6:], wk, EPS)], 1)
        kb.assert_bitwise(out.reshape(5, 8, 16), want, f"{dtype} one launch vs two")


def interp_case_rms_norm_two_weights_backward_equals_two_calls(kb):
    # one backward launch for both weights: dx as the two calls' (row-wise), each dweight within
    # rounding of its call's (other row ranges per program) and of float64
    g = torch.Generator().manual_seed(18)
    T, hq, hk, D = 9, 6, 2, 16
    qkv = torch.randn(T, (hq + 2 * hk) * D, generator=g)
    x = qkv[:, :(hq + hk) * D].reshape(T, hq + hk, D)
    wq, wk = _weight(D, torch.float32, g), _weight(D, torch.float32, g)
    dy = torch.randn(T, hq + hk, D, generator=g)
    _, rstd = rmsnorm.triton_kernels._triton_fwd(x, wq, EPS, False, wk, hq)
    dx, dwq, dwk = rmsnorm.rms_norm_backward_triton(dy.reshape(-1, D), x, wq, rstd, False, weight2=wk, heads1=hq)
    parts = []
    for sl, w in ((slice(0, hq), wq), (slice(hq, hq + hk), wk)):
        xr = x[:, sl].reshape(-1, D).contiguous()
        _, r = rmsnorm.triton_kernels._triton_fwd(xr, w, EPS)
        parts.append(rmsnorm.rms_norm_backward_triton(dy[:, sl].reshape(-1, D).contiguous(), xr, w, r))
    kb.assert_bitwise(dx.reshape(T, hq + hk, D)[:, :hq], parts[0][0].reshape(T, hq, D), "dx of the q heads")
    kb.assert_bitwise(dx.reshape(T, hq + hk, D)[:, hq:], parts[1][0].reshape(T, hk, D), "dx of the k heads")
    assert kb.rel_l2(dwq, parts[0][1]) < 1e-6 and kb.rel_l2(dwk, parts[1][1]) < 1e-6


def interp_case_rms_norm_backward_matches_reference(kb):
    g = torch.Generator().manual_seed(10)
    x = torch.randn(7, 48, generator=g)
    w = _weight(48, torch.float32, g)
    dy = torch.randn(7, 48, generator=g)
    _, rstd = rmsnorm.triton_kernels._triton_fwd(x, w, EPS)
    dx_t, dw_t = rmsnorm.rms_norm_backward_triton(dy, x, w, rstd)
    dx_r, dw_r = rmsnorm.rms_norm_backward_reference(dy, x, w, rstd)
    assert kb.rel_l2(dx_t, dx_r) < 1e-6 and kb.rel_l2(dw_t, dw_r) < 1e-6


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_rms_norm_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_rmsnorm", case)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("H", [128, 1024, 4096, 5000])
def test_rms_norm_cuda_row_alone_equals_row_in_batch_bitwise(kb, H):
    g = torch.Generator().manual_seed(11)
    w = _weight(H, torch.bfloat16, g).cuda()
    row = torch.randn(H, generator=g).bfloat16()
    alone = rmsnorm.rms_norm(row[None].cuda(), w, EPS)[0]
    for m in BATCH_SIZES + (1000, 4096):
        batch, idx = kb.needle_batch(row, m, g)
        out = rmsnorm.rms_norm(batch.cuda(), w, EPS)
        kb.assert_bitwise(out[idx], alone, f"cuda H={H} M={m}")
    assert kb.rel_l2(out, _f64(batch, w.cpu())) < kb.TOL[torch.bfloat16]


def test_rms_norm_two_weights_equal_two_calls_and_bad_heads_are_refused(kb):
    g = torch.Generator().manual_seed(16)
    qkv = torch.randn(7, 10 * 16, generator=g).bfloat16()
    qk = qkv[:, :8 * 16].reshape(7, 8, 16)
    wq, wk = _weight(16, torch.bfloat16, g), _weight(16, torch.bfloat16, g)
    want = torch.cat([rmsnorm.rms_norm(qk[:, :6], wq, EPS), rmsnorm.rms_norm(qk[:, 6:], wk, EPS)], 1)
    kb.assert_bitwise(rmsnorm.rms_norm(qk, wq, EPS, weight2=wk, heads1=6), want, "no grad")
    xr = qk.detach().clone().requires_grad_()
    kb.assert_bitwise(rmsnorm.rms_norm(xr, wq, EPS, weight2=wk, heads1=6).detach(), want, "autograd")
    for bad in (0, 8, None):
        with pytest.raises(ValueError, match="0 < heads1 < heads"):
            rmsnorm.rms_norm(qk, wq, EPS, weight2=wk, heads1=bad)
    with pytest.raises(TypeError, match="weight2 is torch.float32"):
        rmsnorm.rms_norm(qk, wq, EPS, weight2=wk.float(), heads1=6)


@pytest.mark.gpu
def test_rms_norm_cuda_two_weights_in_one_launch_equal_two_calls_bitwise(kb):
    g = torch.Generator().manual_seed(17)
    for T in (1, 64, 1000):
        qkv = torch.randn(T, 4096, generator=g).bfloat16().cuda()
        qk = qkv[:, :3072].reshape(T, 24, 128)                    # 16 q heads, 8 k heads
        wq, wk = _weight(128, torch.bfloat16, g).cuda(), _weight(128, torch.bfloat16, g).cuda()
        want = torch.cat([rmsnorm.rms_norm(qk[:, :16], wq, EPS), rmsnorm.rms_norm(qk[:, 16:], wk, EPS)], 1)
        kb.assert_bitwise(rmsnorm.rms_norm(qk, wq, EPS, weight2=wk, heads1=16), want, f"T={T}")


@pytest.mark.gpu
def test_rms_norm_cuda_two_weights_under_autograd_equal_two_calls(kb):
    # the trainer's q/k norms: one launch each way; forward and dx bitwise the two calls', each
    # dweight within rounding, and the backward the same twice
    g = torch.Generator().manual_seed(19)
    qkv = torch.randn(300, 4096, generator=g).bfloat16().cuda()
    wq, wk = _weight(128, torch.bfloat16, g).cuda(), _weight(128, torch.bfloat16, g).cuda()
    dy = torch.randn(300, 24, 128, generator=g).bfloat16().cuda()

    def run(pair):
        x = qkv.clone().requires_grad_()
        ws = [wq.clone().requires_grad_(), wk.clone().requires_grad_()]
        qk = x[:, :3072].view(300, 24, 128)
        if pair:
            out = rmsnorm.rms_norm(qk, ws[0], EPS, weight2=ws[1], heads1=16)
        else:
            out = torch.cat([rmsnorm.rms_norm(qk[:, :16], ws[0], EPS), rmsnorm.rms_norm(qk[:, 16:], ws[1], EPS)], 1)
        out.backward(dy)
        return out.detach(), x.grad, ws[0].grad, ws[1].grad

    pair, two, again = run(True), run(False), run(True)
    kb.assert_bitwise(pair[0], two[0], "forward")
    kb.assert_bitwise(pair[1], two[1], "dx")
    for i in (2, 3):
        assert kb.rel_l2(pair[i], two[i]) < 1e-2
    for a, b in zip(pair, again):
        kb.assert_bitwise(a, b, "run to run")


@pytest.mark.gpu
def test_rms_norm_cuda_head_strided_view_equals_contiguous_and_autograd_bitwise(kb):
    g = torch.Generator().manual_seed(14)
    qkv = torch.randn(37, 4096, generator=g).bfloat16().cuda()
    w = _weight(128, torch.bfloat16, g).cuda()
    for lo, heads in ((0, 16), (2048, 8)):                     # the q and the k slice
        x = qkv[:, lo:lo + heads * 128].reshape(37, heads, 128)
        got = rmsnorm.rms_norm(x, w, EPS)
        kb.assert_bitwise(got, rmsnorm.rms_norm(x.contiguous(), w, EPS), f"heads={heads} strided vs copy")
        xr = x.detach().clone().requires_grad_()                # the trainer's autograd path
        kb.assert_bitwise(got, rmsnorm.rms_norm(xr, w, EPS).detach(), f"heads={heads} vs autograd")


@pytest.mark.gpu
def test_rms_norm_cuda_backward_matches_float64(kb):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(33, 256, generator=g).cuda().requires_grad_()
    w = _weight(256, torch.float32, g).cuda().requires_grad_()
    dy = torch.randn(33, 256, generator=g).cuda()
    rmsnorm.rms_norm(x, w, EPS).backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    _f64(x64, w64).backward(dy.double())
    assert kb.rel_l2(x.grad, x64.grad) < 1e-5 and kb.rel_l2(w.grad, w64.grad) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 1024), (65536, 128), (5, 3000)])
def test_rms_norm_cuda_backward_bf16_matches_float64_and_is_deterministic(kb, shape):
    g = torch.Generator().manual_seed(14)
    R, H = shape
    x = torch.randn(R, H, generator=g).bfloat16()
    w = _weight(H, torch.bfloat16, g)
    dy = torch.randn(R, H, generator=g).bfloat16()

    def grads():
        xc, wc = x.cuda().requires_grad_(), w.cuda().requires_grad_()
        rmsnorm.rms_norm(xc, wc, EPS).backward(dy.cuda())
        return xc.grad, wc.grad

    dx, dw = grads()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    _f64(x64, w64).backward(dy.double())
    assert kb.rel_l2(dx, x64.grad) < kb.TOL[torch.bfloat16] and kb.rel_l2(dw, w64.grad) < kb.TOL[torch.bfloat16]
    dx2, dw2 = grads()
    kb.assert_bitwise(dx2, dx, "dx run to run")
    kb.assert_bitwise(dw2, dw, "dw run to run")
