"""Gates for the GDN input preparation (isoexec_kernels/gdn_prep/): q/k L2 norm, g and beta against
float64, the stock twin, row invariance, softplus extremes and the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from isoexec_kernels import gdn_prep


def _inputs(T, Hk, Dk, H, dtype, seed, a_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, Hk, Dk, generator=g) * 2).to(dtype)
    k = torch.randn(T, Hk, Dk, generator=g).to(dtype)
    a = (torch.randn(T, H, generator=g) * a_scale).to(dtype)
    b = (torch.randn(T, H, generator=g) * 3).to(dtype)
    A_log = torch.log(1 + 15 * torch.rand(H, generator=g))
    dt = 1 + 0.1 * torch.randn(H, generator=g)
    return q, k, a, b, A_log, dt


def _f64(q, k, a, b, A_log, dt, eps=1e-6):
    def l2(x):
        x = x.double()
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)
    qn = l2(q) * q.shape[-1] ** -0.5
    g = -torch.exp(A_log.double()) * F.softplus(a.double() + dt.double())
    return qn, l2(k), g, torch.sigmoid(b.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prep_matches_float64_and_native(kb, dtype):
    args = _inputs(37, 2, 16, 4, dtype, 1)
    outs = gdn_prep.gdn_prep(*args)
    want = _f64(*args)
    nat = gdn_prep.gdn_prep_native(*args)
    for name, o, w, n in zip(("q", "k", "g", "beta"), outs, want, nat):
        assert o.dtype == torch.float32, name
        assert kb.rel_l2(o, w) < 1e-6, name
        assert kb.rel_l2(n, w) < 1e-2, name


def test_softplus_extremes_and_threshold(kb):
    u = torch.tensor([-100.0, -30.0, -5.0, -1e-3, 0.0, 3.0, 19.9, 20.0, 20.5, 80.0])
    z = torch.zeros(10, 1, 4)
    _, _, g, _ = gdn_prep.gdn_prep(z, z, u[:, None], torch.zeros(10, 1), torch.zeros(1), torch.zeros(1))
    want = F.softplus(u.double())
    # softplus(-100) = 3.7e-44 is an fp32 subnormal (spacing 1.4e-45): absolute check there
    assert torch.allclose(-g[1:, 0].double(), want[1:], rtol=1e-6, atol=0)
    assert abs(-g[0, 0].double() - want[0]) <= 1.5e-45
    assert (g[:, 0] <= 0).all() and g[0, 0] < 0  # exp(-100): a tiny decay, not zero


def test_row_in_batch_equals_row_alone_bitwise(kb):
    args = _inputs(1, 2, 32, 4, torch.bfloat16, 2)
    alone = gdn_prep.gdn_prep(*args)
    g = torch.Generator().manual_seed(3)
    for m in (2, 7, 65):
        big = _inputs(m, 2, 32, 4, torch.bfloat16, int(torch.randint(0, 1000, (1,), generator=g)))
        idx = int(torch.randint(0, m, (1,), generator=g))
        q, k, a, b = (t.clone() for t in big[:4])
        q[idx], k[idx], a[idx], b[idx] = args[0][0], args[1][0], args[2][0], args[3][0]
        outs = gdn_prep.gdn_prep(q, k, a, b, args[4], args[5])
        for name, o, al in zip("qkgb", outs, alone):
            kb.assert_bitwise(o[idx], al[0], f"{name} M={m}")


def test_views_of_a_wider_tensor_give_the_same_bits(kb):
    T, Hk, Dk = 9, 2, 16
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(T, 3 * Hk * Dk, generator=g)
    q, k = wide[:, :Hk * Dk].reshape(T, Hk, Dk), wide[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk)
    ab = torch.randn(T, 8, generator=g)
    A_log, dt = torch.zeros(4), torch.ones(4)
    a = gdn_prep.gdn_prep(q, k, ab[:, 4:], ab[:, :4], A_log, dt)
    b = gdn_prep.gdn_prep(q.contiguous(), k.contiguous(), ab[:, 4:].contiguous(), ab[:, :4].contiguous(), A_log, dt)
    for x, y in zip(a, b):
        kb.assert_bitwise(x, y, "view vs contiguous")


def test_backward_matches_float64():
    args = _inputs(11, 2, 8, 4, torch.float32, 5)
    leaves = [t.clone().requires_grad_() for t in args]
    outs = gdn_prep.gdn_prep(*leaves)
    g = torch.Generator().manual_seed(6)
    cot = [torch.randn(o.shape, generator=g) for o in outs]
    sum((o * c).sum() for o, c in zip(outs, cot)).backward()
    l64 = [t.double().requires_grad_() for t in args]
    sum((o * c.double()).sum() for o, c in zip(_f64(*l64), cot)).backward()
    for name, a, b in zip(("q", "k", "a", "b", "A_log", "dt_bias"), leaves, l64):
        err = ((a.grad.double() - b.grad).norm() / b.grad.norm()).item()
        assert err < 1e-5, (name, err)


def test_errors_name_the_problem():
    z = torch.zeros(2, 1, 4)
    with pytest.raises(ValueError, match="a and b must be"):
        gdn_prep.gdn_prep(z, z, torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="A_log and dt_bias must be"):
        gdn_prep.gdn_prep(z, z, torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(3), torch.zeros(2))


# --------------------------------------------------------------------------- Triton (interpreter)


def interp_case_prep_triton_matches_reference(kb):
    args = _inputs(13, 2, 24, 4, torch.float32, 7)
    ref = gdn_prep.gdn_prep_reference(*args)
    tri = gdn_prep.gdn_prep_triton(*args)
    for name, r, t in zip("qkgb", ref, tri):
        assert kb.rel_l2(t, r) < 1e-6, name
    one = gdn_prep.gdn_prep_triton(*(t[:1] if t.dim() > 1 else t for t in args))
    for name, r, t in zip("qkgb", one, tri):
        kb.assert_bitwise(r[0], t[0], f"triton row alone {name}")


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_gdn_prep_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gdn_prep", case)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_prep_cuda_matches_float64_and_is_row_invariant(kb):
    args = [t.cuda() for t in _inputs(300, 16, 128, 32, torch.bfloat16, 8)]
    outs = gdn_prep.gdn_prep(*args)
    for name, o, w in zip("qkgb", outs, _f64(*(t.cpu() for t in args))):
        assert kb.rel_l2(o, w) < 1e-5, name
    one = gdn_prep.gdn_prep(*(t[123:124] if t.dim() > 1 else t for t in args))
    for name, o, w in zip("qkgb", one, outs):
        kb.assert_bitwise(o[0], w[123], f"cuda row alone {name}")
