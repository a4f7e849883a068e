"""Backward of the GDN chunk form (isoexec_kernels/gdn_core/chunk_backward.py): the torch reference
twin and the fused Triton kernels against autograd through ``torch_chunk_form`` in float64, run-to-
run determinism (two calls give the same bits), and the wiring (``chunk_form_backward``, and
``gdn_cpr_varlen`` / the native chunk trainer with ``CPR_BWD_KIND`` / ``NATIVE_BWD_KIND`` =
"shared") on CUDA and under the Triton interpreter.

Lengths cross the chunk grid (1, C - 1, C, C + 1, several chunks, an empty sequence); GQA with
H = 2 Hk (and H = 3 Hk with Dk, Dv that are not powers of two in the masked case)."""

from __future__ import annotations

import pytest
import torch

import gdn_inputs
from isoexec_kernels import gdn_core as G
from isoexec_kernels.gdn_core import chunk_backward as CB
from isoexec_kernels.gdn_core import native as N
from isoexec_kernels.gdn_core.chunk_form import chunk_form_backward, torch_chunk_form
from test_gdn_native_wy import answering

NAMES = ("q", "k", "v", "g", "beta")


def make_inputs(lens, Hk, H, Dk, Dv, seed, **kw):
    """``gdn_inputs.make_inputs`` with an output gradient, grouped as ((q, k, v, g, beta), cu, dO)."""
    *xs, cu, do = gdn_inputs.make_inputs(lens, Hk, H, Dk, Dv, seed, out_grad=True, **kw)
    return tuple(xs), cu, do


def autograd64(xs, cu, do, chunk):
    """Gradients of sum(torch_chunk_form(xs) * do) by autograd in float64 (on the inputs' device)."""
    ref = [x.detach().double().requires_grad_() for x in xs]
    o = torch_chunk_form(*ref, cu, chunk=chunk)
    return torch.autograd.grad(o, ref, do.double())


def check_close(kb, got, want, tol, what):
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape, (what, name, a.shape, b.shape)
        assert float(b.abs().sum()) > 0, (what, name)
        err = kb.rel_l2(a, b)
        assert err < tol, f"{what} d{name}: rel l2 {err:.3g} >= {tol}"


LENS = [1, 63, 0, 64, 65, 130]
SMALL = dict(Hk=2, H=4, Dk=16, Dv=32)


# --------------------------------------------------------------------------- reference twin (CPU)


def test_reference_twin_matches_autograd_float64(kb):
    xs, cu, do = make_inputs(LENS, **SMALL, seed=1, dtype=torch.float64, v_dtype=torch.float64)
    got = CB.chunk_backward_reference(*xs, cu, do, chunk=16)
    assert all(x.dtype == torch.float64 for x in got)
    check_close(kb, got, autograd64(xs, cu, do, 16), 1e-12, "reference float64")


def test_reference_twin_float32_within_fp32_tolerance(kb):
    xs, cu, do = make_inputs(LENS, **SMALL, seed=2)
    got = CB.chunk_backward_reference(*xs, cu, do, chunk=16)
    assert all(x.dtype == torch.float32 for x in got)
    check_close(kb, got, autograd64(xs, cu, do, 16), kb.TOL[torch.float32], "reference float32")


def test_reference_twin_rep3_and_single_chunk_sizes(kb):
    # H = 3 Hk; a chunk as long as the whole batch; lengths below one chunk only
    xs, cu, do = make_inputs([3, 7, 1], Hk=1, H=3, Dk=8, Dv=4, seed=3, dtype=torch.float64,
                             v_dtype=torch.float64)
    for chunk in (8, 16):
        got = CB.chunk_backward_reference(*xs, cu, do, chunk=chunk)
        check_close(kb, got, autograd64(xs, cu, do, chunk), 1e-12, f"rep 3 chunk {chunk}")


def test_cpu_backward_keeps_the_autograd_path(monkeypatch):
    """On CPU (no interpreter) chunk_form_backward differentiates torch_chunk_form: the Triton
    launcher is never reached."""
    monkeypatch.setattr(CB, "chunk_backward_triton", lambda *a, **k: pytest.fail("Triton path taken"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    xs, cu, do = make_inputs([20, 5], Hk=1, H=2, Dk=8, Dv=8, seed=4)
    inputs = [x.clone().requires_grad_(r) for x, r in zip(xs, (True, False, True, True, False))]
    grads = chunk_form_backward(inputs, cu, 8, do)
    assert grads[1] is None and grads[4] is None
    assert all(gr.dtype == torch.float32 and gr.abs().sum() > 0 for gr in (grads[0], grads[2], grads[3]))


def test_backward_of_a_batch_without_tokens_is_zero():
    """No token at all (a data-parallel or expert-parallel rank holding no sequence, T = 0): zero
    gradients of the inputs' shapes and dtypes, None where none is needed, through the trainer's
    autograd path too."""
    xs, _, do = make_inputs([], Hk=1, H=2, Dk=8, Dv=8, seed=4, v_dtype=torch.bfloat16)
    cu = torch.zeros(1, dtype=torch.int32)
    inputs = [x.clone().requires_grad_(r) for x, r in zip(xs, (True, False, True, True, True))]
    grads = chunk_form_backward(inputs, cu, 8, do)
    assert grads[1] is None
    assert all(gr.shape == x.shape and gr.dtype == x.dtype for gr, x in zip(grads, inputs) if gr is not None)
    leaves = [x.clone().requires_grad_() for x in xs]
    G.gdn_cpr_varlen(*leaves, cu).sum().backward()
    assert all(x.grad is not None and x.grad.numel() == 0 for x in leaves)


# --------------------------------------------------------------------------- Triton interpreter
# Each interp_case_* runs in the TRITON_INTERPRET=1 subprocess (tests/kernels/conftest.py).


def interp_case_chunk_backward_triton_matches_float64_repeats_and_is_wired(kb):
    lens = [1, 15, 0, 16, 17, 40]
    C = 16
    # weak decay (g_scale 0.05): the reverse pass carries the state's gradient across the three chunks
    # of 40 rows, and an error of 0.1% in that carry fails here (at the default decay it moved the
    # gradients by less than the tolerance)
    xs, cu, do = make_inputs(lens, **SMALL, seed=10, g_scale=0.05)
    want = autograd64(xs, cu, do, C)
    first = CB.chunk_backward_triton(*xs, cu, do, chunk=C)
    assert all(x.dtype == torch.float32 for x in first)
    check_close(kb, first, want, kb.TOL[torch.float32], "triton (interpreter)")
    check_close(kb, first, CB.chunk_backward_reference(*xs, cu, do, chunk=C), kb.TOL[torch.float32],
                "triton vs its twin")
    # the second call is the wired one: chunk_form_backward(kernels="shared") -> the Triton backward
    # (under the interpreter CPU tensors take it; sum(o * do) gives the backward exactly dO = do).
    # Its bits equal the first call's only if the kernels repeat their bits and are the ones wired
    # (autograd through the chunk form would round otherwise): one run of the kernels less than a
    # second direct call and a wired call
    leaves = [x.clone().requires_grad_() for x in xs]
    second = chunk_form_backward(leaves, cu, C, do, kernels="shared")
    for name, a, b in zip(NAMES, first, second):
        kb.assert_bitwise(b, a, f"second call (chunk_form_backward) d{name}")


def interp_case_chunk_backward_triton_masked_dims_rep3_bf16_values_strided(kb):
    # Dk = 24, Dv = 20 (masked tiles), H = 3 Hk, bf16 v, inputs as views of wider tensors; a boundary
    # crossed and a partial chunk (the lengths on and around the grid: the case above)
    lens = [20]
    C = 16
    xs, cu, do = make_inputs(lens, Hk=1, H=3, Dk=24, Dv=20, seed=11, v_dtype=torch.bfloat16)
    q, k, v, g, beta = xs
    qk = torch.cat([q, k], dim=-1)
    vv = torch.cat([v, v], dim=-1)
    gb = torch.stack([g, beta], dim=-1)
    dd = torch.cat([do, do], dim=-1)
    views = (qk[..., :24], qk[..., 24:], vv[..., :20], gb[..., 0], gb[..., 1])
    assert not any(x.is_contiguous() for x in views)
    got = CB.chunk_backward_triton(*views, cu, dd[..., :20], chunk=C)
    check_close(kb, got, autograd64(xs, cu, do, C), kb.TOL[torch.float32], "masked / strided")
    dense = CB.chunk_backward_triton(*xs, cu, do, chunk=C)
    for name, a, b in zip(NAMES, got, dense):
        kb.assert_bitwise(a, b, f"strided vs contiguous d{name}")
    # the public wiring casts each gradient to its input's dtype, None where not required; the
    # kernels' answer to these inputs is ``dense`` (``answering``: the kernels repeat their bits, the
    # case above; a wiring to other kernels or with other inputs would still run them)
    inputs = [x.detach().requires_grad_(r) for x, r in zip(xs, (False, True, True, False, True))]
    with answering(kb, CB, "chunk_backward_triton", (*xs, cu, do), dict(chunk=C), dense):
        grads = chunk_form_backward(inputs, cu, C, do)
    assert grads[0] is None and grads[3] is None
    assert grads[2].dtype == torch.bfloat16
    kb.assert_bitwise(grads[1], dense[1], "chunk_form_backward dk")
    kb.assert_bitwise(grads[4], dense[4], "chunk_form_backward dbeta")


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_gdn_chunk_backward_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gdn_chunk_backward", case)


# --------------------------------------------------------------------------- CUDA

QWEN35 = dict(Hk=16, H=32, Dk=128, Dv=128)
# fp32 evaluation of this backward (the reference twin) is 4e-7 .. 7e-7 from float64 at these
# dims on the CPU; tf32x3 dots leave a few times more
GPU_TOL = 2e-5


def _cuda(xs, cu, do):
    return [x.cuda() for x in xs], cu.cuda(), do.cuda()


@pytest.mark.gpu
def test_chunk_backward_cuda_matches_float64(kb):
    xs, cu, do = _cuda(*make_inputs([300, 64, 1, 129, 0, 77], **QWEN35, seed=20, v_dtype=torch.bfloat16))
    got = CB.chunk_backward_triton(*xs, cu, do, chunk=G.CHUNK)
    assert all(x.is_cuda and x.dtype == torch.float32 for x in got)
    check_close(kb, got, autograd64(xs, cu, do, G.CHUNK), GPU_TOL, "cuda vs float64")


@pytest.mark.gpu
def test_chunk_backward_cuda_deterministic_at_trainer_size(kb):
    xs, cu, do = _cuda(*make_inputs([2048, 2048], **QWEN35, seed=21, v_dtype=torch.bfloat16))
    a = CB.chunk_backward_triton(*xs, cu, do, chunk=G.CHUNK)
    b = CB.chunk_backward_triton(*xs, cu, do, chunk=G.CHUNK)
    for name, x, y in zip(NAMES, a, b):
        kb.assert_bitwise(x, y, f"second call d{name}")
        assert torch.isfinite(x).all(), name
    # float64 check on a slice: the first 256 tokens of each sequence (a prefix of a sequence is
    # a sequence of its own: its gradient needs only its own output gradient)
    rows = torch.cat([torch.arange(0, 256), torch.arange(2048, 2048 + 256)]).cuda()
    xs2 = [x[rows] for x in xs]
    cu2 = torch.tensor([0, 256, 512], dtype=torch.int32, device="cuda")
    got = CB.chunk_backward_triton(*xs2, cu2, do[rows], chunk=G.CHUNK)
    check_close(kb, got, autograd64(xs2, cu2, do[rows], G.CHUNK), GPU_TOL, "slice vs float64")


@pytest.mark.gpu
def test_chunk_backward_cuda_through_trainer_autograd(kb, monkeypatch):
    # CPR's trainer and the native chunk trainer take this backward when asked for the shared one
    # (their default is the WY backward, tests/kernels/test_gdn_native_wy.py)
    monkeypatch.setattr(N, "NATIVE_BWD_KIND", "shared")
    monkeypatch.setattr(G.api, "CPR_BWD_KIND", "shared")
    xs, cu, do = _cuda(*make_inputs([700, 64, 129, 1], **QWEN35, seed=22))
    direct = CB.chunk_backward_triton(*xs, cu, do, chunk=G.CHUNK)
    want = autograd64(xs, cu, do, G.CHUNK)
    for fn in (G.gdn_cpr_varlen, N.gdn_chunk_varlen):
        leaves = [x.clone().requires_grad_() for x in xs]
        (fn(*leaves, cu) * do).sum().backward()
        for name, leaf, d in zip(NAMES, leaves, direct):
            kb.assert_bitwise(leaf.grad, d, f"{fn.__name__} grad d{name}")
        check_close(kb, [x.grad for x in leaves], want, GPU_TOL, fn.__name__)
