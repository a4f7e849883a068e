"""The native Gated DeltaNet chunk forward in WY form (isoexec_kernels/gdn_core/native_wy.py) and its
backward (native_wy_backward.py): the stock-style baseline, so correctness at tolerance and
determinism, not invariance.

CPU: the torch twin (blocked inverse against ``torch.linalg.solve_triangular``; the twin against the
float64 recurrence with initial and final states). Triton interpreter (``interp_case_*``): the kernels
against the float64 recurrence and the twin on ragged varlen batches (lengths off the chunk grid,
empty and one-token sequences, GQA rep 2 and 3, masked head dims), initial and final states, the
blocked inverse against the triangular solve, the engine's prefill split plus decode continuing from
the stored state, hazards (repeated keys, beta = 1, no decay, full decay), bf16 operands, and
two calls giving the same bits; the backward against autograd in float64 through
``torch_chunk_form`` (the same function), against its twin with bf16 operands, repeated, and wired
into the native trainer. GPU cases at Qwen3.5 GDN sizes, marked gpu.

Tolerances (relative L2 against float64): fp32 operands ("tf32"/"ieee" modes; under the interpreter
``tl.dot`` is exact fp32) 1e-5, as the other fp32 kernels; bf16 operands 1e-2 (the twin with
round-to-nearest-even is 3.8e-3 from float64 at Qwen3.5 sizes, forward and gradients alike; under
the interpreter, whose bf16 cast truncates, the kernels are compared with the twins run with
truncation).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from gdn_inputs import make_inputs
from isoexec_kernels import gdn_core as G
from isoexec_kernels.gdn_core import native as N
from isoexec_kernels.gdn_core import chunk_backward as CB
from isoexec_kernels.gdn_core import native_wy as NW
from isoexec_kernels.gdn_core import native_wy_backward as NB
from isoexec_kernels.gdn_core.chunk_form import torch_chunk_form, torch_recurrence
from isoexec_kernels.gdn_core.plan import _host_lens, chunk_plan


def recurrence64(inp, init=None):
    """Float64 per-token recurrence (outputs and final states)."""
    return torch_recurrence(*(x.double() for x in inp[:5]), inp[5],
                            initial_state=None if init is None else init.double(), output_final_state=True)


def chunk_a(inp, chunk):
    """A = strict_lower(beta_i (k_i . k_j) exp(G_i - G_j)) of every chunk, float64 [P, H, C, C] in
    the kernels' chunk order (chunks from each sequence's first token, heads per chunk)."""
    q, k, v, g, beta, cu = inp
    starts, lens = _host_lens(cu)
    row0, nrow = chunk_plan(starts, lens, chunk)[:2]
    rep = v.shape[1] // k.shape[1]
    out = []
    for r0, n in zip(row0, nrow):
        kc = torch.zeros(chunk, v.shape[1], k.shape[2], dtype=torch.float64)
        kc[:n] = k[r0:r0 + n].double().repeat_interleave(rep, 1)
        gc = torch.zeros(chunk, v.shape[1], dtype=torch.float64)
        gc[:n] = g[r0:r0 + n].double()
        bc = torch.zeros(chunk, v.shape[1], dtype=torch.float64)
        bc[:n] = beta[r0:r0 + n].double()
        Gc = gc.cumsum(0).T  # [H, C]
        kk = torch.einsum("ihd,jhd->hij", kc, kc)
        strict = torch.ones(chunk, chunk, dtype=torch.bool).tril(-1)
        dG = torch.where(strict, Gc[:, :, None] - Gc[:, None, :], torch.zeros((), dtype=torch.float64))
        out.append(torch.where(strict, bc.T[:, :, None] * kk * dG.exp(), torch.zeros((), dtype=torch.float64)))
    return torch.stack(out)


def run_wy(inp, chunk, init=None, choice=None, t_out=None):
    """The WY kernels on a trainer batch (or from ``init`` [B, H, Dk, Dv]); returns (o, final states)."""
    q, k, v, g, beta, cu = inp
    starts, lens = _host_lens(cu)
    B, H, Dk, Dv = len(lens), v.shape[1], k.shape[2], v.shape[2]
    fin = torch.full((B, H, Dk, Dv), float("nan"), device=v.device)
    o = NW.wy_chunk_triton(q, k, v, g, beta, starts, lens, init, fin, list(range(B)), chunk,
                           choice=choice, t_out=t_out)
    return o, fin


NAMES = ("q", "k", "v", "g", "beta")


def autograd64(inp, do, chunk):
    """Gradients of sum(torch_chunk_form(inputs) * do) by autograd in float64."""
    ref = [x.detach().double().requires_grad_() for x in inp[:5]]
    return torch.autograd.grad(torch_chunk_form(*ref, inp[5], chunk=chunk), ref, do.double())


def out_grad(inp, seed):
    gen = torch.Generator().manual_seed(seed)
    T, H, Dv = inp[2].shape
    return torch.randn(T, H, Dv, generator=gen).to(inp[2].device)


def check_grads(kb, got, want, tol, what):
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, (what, name, a.shape, b.shape, a.dtype)
        err = kb.rel_l2(a, b)
        assert err < tol, f"{what} d{name}: rel l2 {err:.3g} >= {tol}"


@contextlib.contextmanager
def answering(kb, module, name, args, kwargs, result):
    """``module.name`` returns clones of ``result`` when called with ``args`` and ``kwargs`` (tensors
    compared bitwise, with dtype and shape), and runs as it is otherwise: a wiring check that
    compares a trainer's gradients with the bits of a direct call of the kernels it should reach gets
    those bits without a second run of the kernels (they repeat their bits: the cases that call them
    twice). A wiring that reaches other kernels, or hands these other inputs, still runs them."""
    real = getattr(module, name)

    def same(a, b):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
                return False
            return kb.bit_report(a, b)["differing"] == 0 if a.is_floating_point() else torch.equal(a, b)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return False
        return a == b

    def fn(*a, **kw):
        if (len(a) == len(args) and all(map(same, a, args)) and kw.keys() == kwargs.keys()
                and all(same(kw[key], kwargs[key]) for key in kw)):
            return tuple(r.clone() for r in result)
        return real(*a, **kw)

    setattr(module, name, fn)
    try:
        yield
    finally:
        setattr(module, name, real)


def trunc_bf16(x):
    """fp32 -> bf16 by truncation, as the Triton interpreter converts."""
    x32 = x.float().contiguous()
    return (x32.view(torch.int32) & -65536).view(torch.float32).to(x.dtype)


LENS = [70, 0, 130, 1, 64, 33]
FP32 = NW.NativeWYChoice(dot="ieee")
BF16 = NW.NativeWYChoice(dot="bf16")


# --------------------------------------------------------------------------- torch twin (CPU)


def test_blocked_inverse_matches_solve_triangular():
    inp = make_inputs([64, 40, 128], Hk=2, H=4, Dk=16, Dv=16, seed=1, dtype=torch.float64,
                      v_dtype=torch.float64)
    A = chunk_a(inp, 64)
    # the hazard: identical keys, beta = 1, no decay: A is all ones below the diagonal, whose powers
    # grow binomially while (I + A)^-1 has entries 0 and +-1 only
    ones = torch.ones(64, 64, dtype=torch.float64).tril(-1)
    A = torch.cat([A.reshape(-1, 64, 64), ones[None]])
    eye = torch.eye(64, dtype=torch.float64)
    want = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
    for dt, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        got = NW.blocked_unit_lower_inverse(A.to(dt))
        err = float((got.double() - want).norm() / want.norm())
        assert err < tol, (dt, err)
        assert torch.equal(got.triu(1), torch.zeros_like(got)), "nonzero above the diagonal"


@pytest.mark.parametrize("dot,tol", [("tf32", 1e-5), ("bf16", 1e-2)])
def test_wy_torch_twin_matches_float64_recurrence_with_states(kb, dot, tol):
    inp = make_inputs(LENS, Hk=2, H=4, Dk=16, Dv=32, seed=2)
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(len(LENS), 4, 16, 32, generator=gen) * 0.1
    want, want_s = recurrence64(inp, init)
    o, S = NW.wy_chunk_torch(*inp, chunk=64, initial_state=init, output_final_state=True, dot=dot)
    assert kb.rel_l2(o, want) < tol
    assert kb.rel_l2(S, want_s) < tol


@pytest.mark.parametrize("dot,tol", [("tf32", 1e-5), ("bf16", 1e-2)])
def test_wy_backward_torch_twin_matches_float64_autograd(kb, dot, tol):
    inp = make_inputs([70, 0, 75, 1, 64, 33], Hk=2, H=4, Dk=16, Dv=32, seed=4)
    do = out_grad(inp, 5)
    check_grads(kb, NB.wy_chunk_backward_torch(*inp, do, chunk=64, dot=dot), autograd64(inp, do, 64), tol,
                f"twin {dot}")


# --------------------------------------------------------------------------- Triton interpreter
# Each interp_case_* runs in the TRITON_INTERPRET=1 subprocess (tests/kernels/conftest.py).


def interp_case_native_wy_chunk_forward_matches_float64_recurrence(kb):
    # ragged lengths off the chunk grid, an empty and a one-token sequence, GQA rep 2; from zero and
    # from initial states (final states written per sequence, none for the empty one); then the
    # other chunk sizes the kernels take (1 and 2 diagonal blocks of the inverse). Three chunks of 64:
    # the interpreter's time is programs (chunks x heads); a sequence of exactly one chunk: the
    # hazards and blocked inverse cases
    lens = [70, 0, 1]
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=10)
    gen = torch.Generator().manual_seed(11)
    init = torch.randn(len(lens), 2, 16, 16, generator=gen) * 0.1
    nonempty = [b for b, n in enumerate(lens) if n]
    for st in (None, init):
        want, want_s = recurrence64(inp, st)
        o, fin = run_wy(inp, 64, st, FP32)
        assert kb.rel_l2(o, want) < 1e-5, st is None
        assert kb.rel_l2(o, NW.wy_chunk_torch(*inp, chunk=64, initial_state=st)) < 1e-5
        assert kb.rel_l2(fin[nonempty], want_s[nonempty]) < 1e-5, "final states"
        assert torch.isnan(fin[1]).all(), "an empty sequence's final state must not be written"
    small = make_inputs([40, 1], Hk=1, H=2, Dk=16, Dv=16, seed=12)
    want, _ = recurrence64(small)
    for C in (16, 32):
        assert kb.rel_l2(run_wy(small, C, None, FP32)[0], want) < 1e-5, C


def interp_case_native_wy_masked_head_dims_rep3_strided_and_bf16_values(kb):
    # Dk = 24, Dv = 20 (masked tiles), H = 3 Hk, bf16 v ("tf32" resolved from "auto" only for fp32 v,
    # so the fp32 choice is pinned here), inputs as views of wider tensors
    lens = [70]   # a boundary crossed, a partial chunk
    inp = make_inputs(lens, Hk=1, H=3, Dk=24, Dv=20, seed=12, v_dtype=torch.bfloat16)
    q, k, v, g, beta, cu = inp
    qk = torch.cat([q, k], dim=-1)
    gb = torch.stack([g, beta], dim=-1)
    views = (qk[..., :24], qk[..., 24:], v, gb[..., 0], gb[..., 1], cu)
    want, _ = recurrence64(inp)
    o, _ = run_wy(views, 64, None, FP32)
    assert kb.rel_l2(o, want) < 1e-5
    kb.assert_bitwise(o, run_wy(inp, 64, None, FP32)[0], "strided vs contiguous")


def interp_case_native_wy_blocked_inverse_matches_solve_triangular(kb):
    inp = make_inputs([64, 40], Hk=2, H=4, Dk=16, Dv=16, seed=13, g_scale=0.1)   # a whole chunk, a partial one
    A = chunk_a(inp, 64)
    eye = torch.eye(64, dtype=torch.float64)
    want = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
    Tm = torch.zeros(A.shape, dtype=torch.float32)
    run_wy(inp, 64, None, FP32, t_out=Tm)
    assert kb.rel_l2(Tm, want) < 1e-5
    assert torch.equal(Tm.triu(1), torch.zeros_like(Tm))


def interp_case_native_wy_hazards_repeated_keys_unit_beta_no_and_full_decay(kb):
    lens = [64, 50, 3]
    q, k, v, g, beta, cu = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=14)
    k[:40] = k[0]              # one key repeated 40 times
    beta[:40] = 1.0
    g[:64] = 0.0               # no decay over the first chunk
    g[70:80] = -60.0           # full decay (exp underflows to 0) in the second sequence
    inp = (q, k, v, g, beta, cu)
    want, want_s = recurrence64(inp)
    o, fin = run_wy(inp, 64, None, FP32)
    assert torch.isfinite(o).all()
    assert kb.rel_l2(o, want) < 1e-5
    assert kb.rel_l2(fin, want_s) < 1e-5


def interp_case_native_wy_engine_prefill_split_and_decode_continue_from_stored_state(kb):
    from test_gdn_core import _native_decode_triton, run_engine

    lens = [90, 3, 70]
    # two value heads on one key head (rep 2; key heads past the first: the bf16 operands and blocked
    # inverse cases, and the per-token decode kernel in test_gdn_core.py): the interpreter's time is
    # chunks x heads
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=15)
    want, want_s = recurrence64(inp)
    st = G.GDNState.allocate(4, 2, 16, 16, "cpu", chunk=64)
    # pieces off the chunk grid, a piece longer than a chunk, decode steps between prefills
    plan = [("prefill", {0: 19, 1: 2, 2: 0}), ("decode", [0, 1]), ("prefill", {0: 67, 2: 65}),
            ("decode", [0, 2]), ("prefill", {0: 1, 2: 3}), ("decode", [0, 2])]
    assert N.NATIVE_CHUNK_KIND == "wy"
    calls = []
    real = N.wy_chunk_triton
    N.wy_chunk_triton = lambda *a, **kw: calls.append(a[6]) or real(*a, **kw)
    try:
        o = run_engine(inp, lens, plan, [3, 0, 1], st,
                       lambda *a, chunk: N._engine(*a, chunk, "chunk", triton=True), _native_decode_triton, 64)
    finally:
        N.wy_chunk_triton = real
    assert len(calls) == 3, "every prefill call must take the WY kernels"
    assert kb.rel_l2(o, want) < 1e-5
    assert kb.rel_l2(st.running[[3, 0, 1]], want_s) < 1e-5


def interp_case_native_legacy_chunk_path_still_matches_float64_recurrence(kb):
    # the old native chunk forward stays callable (the GPU sweep times it against the WY one)
    lens = [40, 17, 1]
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=19)
    starts, L = _host_lens(inp[5])
    o = N._chunk_triton(*inp[:5], starts, L, None, None, [-1] * 3, 16, kind="legacy")
    assert kb.rel_l2(o, recurrence64(inp)[0]) < 1e-5


def interp_case_native_wy_same_inputs_same_bits(kb):
    lens = [70]   # a boundary crossed, a partial chunk (rows the kernels must mask, not read)
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=16, v_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(17)
    init = torch.randn(len(lens), 2, 16, 16, generator=gen) * 0.1
    for choice in (FP32, BF16):
        a, sa = run_wy(inp, 64, init, choice)
        b, sb = run_wy(inp, 64, init, choice)
        kb.assert_bitwise(a, b, f"second call, {choice.dot}")
        kb.assert_bitwise(sa, sb, f"second call final states, {choice.dot}")


def interp_case_native_wy_bf16_operands_match_twin(kb):
    inp = make_inputs([70, 0, 33], Hk=2, H=4, Dk=16, Dv=16, seed=18, v_dtype=torch.bfloat16)
    o, _ = run_wy(inp, 64, None, NW.NativeWYChoice())   # "auto" with bf16 values: bf16 operands
    keep = NW.round_bf16
    NW.round_bf16 = trunc_bf16   # the interpreter truncates where a GPU rounds to nearest even
    try:
        twin = NW.wy_chunk_torch(*inp, chunk=64, dot="bf16")
    finally:
        NW.round_bf16 = keep
    assert kb.rel_l2(o, twin) < 1e-4
    want, _ = recurrence64(inp)
    assert kb.rel_l2(o, want) < 3e-2   # truncation (biased) rounding, about 1.5e-2 here


def interp_case_native_wy_backward_matches_float64_autograd_and_repeats(kb):
    # ragged lengths (partial chunks, a sequence ending on a boundary, an empty and a one-token
    # sequence), GQA rep 2, C = 64 and 16; four chunks at C = 64 (the interpreter's time is chunks x
    # heads, and each is run twice). At C = 16 a sequence of three chunks, and weak decay: the reverse
    # pass carries the state's gradient on from a chunk that received it, which then counts (a 0.1%
    # error in that carry fails here; two chunks at most and the default decay, as before, missed it)
    for C, lens in ((64, [64, 0, 1, 97]), (16, [40, 5])):
        inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=32, seed=20, g_scale=0.05)
        do = out_grad(inp, 21)
        got = NB.wy_chunk_backward_triton(*inp, do, chunk=C, choice=FP32)
        check_grads(kb, got, autograd64(inp, do, C), 1e-5, f"kernels C={C}")
        check_grads(kb, got, NB.wy_chunk_backward_torch(*inp, do, chunk=C), 1e-5, f"vs twin C={C}")
        again = NB.wy_chunk_backward_triton(*inp, do, chunk=C, choice=FP32)
        for name, a, b in zip(NAMES, got, again):
            kb.assert_bitwise(a, b, f"second call d{name}")


def interp_case_native_wy_backward_masked_dims_rep3(kb):
    inp = make_inputs([70], Hk=1, H=3, Dk=24, Dv=20, seed=22, v_dtype=torch.bfloat16)   # two chunks, one partial
    do = out_grad(inp, 23)
    check_grads(kb, NB.wy_chunk_backward_triton(*inp, do, chunk=64, choice=FP32), autograd64(inp, do, 64), 1e-5,
                "masked dims")


def interp_case_native_wy_backward_bf16_matches_twin_and_is_wired(kb):
    inp = make_inputs([70, 0, 33], Hk=1, H=2, Dk=16, Dv=32, seed=24, v_dtype=torch.bfloat16)
    do = out_grad(inp, 25)
    got = NB.wy_chunk_backward_triton(*inp, do, chunk=64)   # "auto" with bf16 values: bf16 operands
    keep = NW.round_bf16
    NW.round_bf16 = trunc_bf16   # the interpreter truncates where a GPU rounds to nearest even
    try:
        twin = NB.wy_chunk_backward_torch(*inp, do, chunk=64, dot="bf16")
    finally:
        NW.round_bf16 = keep
    check_grads(kb, got, twin, 1e-3, "bf16 vs twin")
    check_grads(kb, got, autograd64(inp, do, 64), 3e-2, "bf16 (truncating) vs float64")
    # the native trainer's backward: this WY backward by default, the shared one on request; each
    # gradient in its input's dtype, None where not required. The WY kernels' answer to these
    # inputs is ``got`` (``answering``: no second run of them for the wiring checks)
    inputs = [x.detach().requires_grad_(r) for x, r in zip(inp[:5], (True, True, True, False, True))]
    assert N.NATIVE_BWD_KIND == "wy"
    wy_answer = (kb, NB, "wy_chunk_backward_triton", (*inp, do), dict(chunk=64), got)
    with answering(*wy_answer):
        wired = N._trainer_backward(inputs, inp[5], 64, do, "chunk")
    assert wired[3] is None and wired[2].dtype == torch.bfloat16
    for i in (0, 1, 4):
        kb.assert_bitwise(wired[i], got[i], f"wired d{NAMES[i]}")
    # the shared one on the last sequence alone (the direct call runs its kernels, 63 substitution
    # steps per chunk under the interpreter; which kernels the wiring reaches is what is checked: the
    # WY backward's bits would differ)
    s = int(inp[5][-2])
    last = [x[s:].detach().requires_grad_(x.requires_grad) for x in inputs]
    cu1 = torch.tensor([0, last[0].shape[0]], dtype=torch.int32)
    direct = CB.chunk_backward_triton(*last, cu1, do[s:], chunk=64)
    with answering(kb, CB, "chunk_backward_triton", (*last, cu1, do[s:]), dict(chunk=64), direct):
        shared = N._trainer_backward(last, cu1, 64, do[s:], "chunk", bwd_kind="shared")
    for i in (0, 1, 4):
        kb.assert_bitwise(shared[i], direct[i], f"shared d{NAMES[i]}")
    # CPR's trainer takes the same WY backward (its forward bits are its own; the gradient is the
    # same function's, at the stock kernels' rounding; sum(o * do) hands the backward dO = do exactly)
    assert G.api.CPR_BWD_KIND == "wy"
    leaves = [x.clone().requires_grad_() for x in inp[:5]]
    with answering(*wy_answer):
        (G.gdn_cpr_varlen(*leaves, inp[5], chunk=64) * do).sum().backward()
    for name, leaf, d in zip(NAMES, leaves, got):
        kb.assert_bitwise(leaf.grad, d.to(leaf.dtype), f"gdn_cpr_varlen grad d{name}")


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_gdn_native_wy_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gdn_native_wy", case)


# --------------------------------------------------------------------------- CUDA

QWEN35 = dict(Hk=16, H=32, Dk=128, Dv=128)


def _cuda(inp):
    return [x.cuda() for x in inp]


@pytest.mark.gpu
@pytest.mark.parametrize("v_dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-2)])
def test_native_wy_cuda_matches_float64_recurrence_and_twin(kb, v_dtype, tol):
    # bf16 v: bf16 operands (twin 3.8e-3 from float64); fp32 v: TF32 dots
    lens = [300, 64, 1, 129, 0, 77]
    inp = _cuda(make_inputs(lens, **QWEN35, seed=40, v_dtype=v_dtype))
    gen = torch.Generator().manual_seed(41)
    init = (torch.randn(len(lens), 32, 128, 128, generator=gen) * 0.05).cuda()
    want, want_s = recurrence64(inp, init)
    o, fin = run_wy(inp, 64, init)
    assert kb.rel_l2(o, want) < tol
    nonempty = [b for b, n in enumerate(lens) if n]
    assert kb.rel_l2(fin[nonempty], want_s[nonempty]) < tol
    dot = NW._resolve_dot(NW.NATIVE_WY, v_dtype)
    twin = NW.wy_chunk_torch(*inp, chunk=64, initial_state=init, dot=dot)
    # kernel and twin round (bf16 operands) or truncate (TF32) after sums in different orders, so
    # single elements may land one bf16/TF32 step apart; a wrong term would be O(1)
    assert kb.rel_l2(o, twin) < 5e-3
    # the exact-fp32 choice: fp32 accuracy
    o32, _ = run_wy(inp, 64, init, NW.NativeWYChoice(dot="tf32x3"))
    assert kb.rel_l2(o32, want) < 1e-5


@pytest.mark.gpu
def test_native_wy_cuda_engine_split_decode_and_legacy_agree(kb):
    from test_gdn_core import random_plan, run_engine

    lens = [300, 64, 129]
    inp = _cuda(make_inputs(lens, **QWEN35, seed=45, v_dtype=torch.bfloat16))
    want, _ = recurrence64(inp)
    st = G.GDNState.allocate(3, 32, 128, 128, "cuda")
    o = run_engine(inp, lens, random_plan(lens, 5, max_decode=10), [2, 0, 1], st, N.gdn_chunk_engine,
                   N.gdn_recurrent_decode, G.CHUNK)
    assert kb.rel_l2(o, want) < 1e-2
    starts, L = _host_lens(inp[5])
    legacy = N._chunk_triton(*inp[:5], starts, L, None, None, [-1] * 3, 64, kind="legacy")
    assert kb.rel_l2(legacy, want) < 1e-2


@pytest.mark.gpu
def test_native_wy_cuda_same_inputs_same_bits_at_bench_size(kb):
    inp = _cuda(make_inputs([2048] * 5, **QWEN35, seed=46, v_dtype=torch.bfloat16))
    a = N.gdn_chunk_varlen(*inp)
    b = N.gdn_chunk_varlen(*inp)
    kb.assert_bitwise(a, b, "second call")
    assert torch.isfinite(a).all()
    # float64 check on the first 256 tokens of two sequences (a prefix is a sequence of its own)
    rows = torch.cat([torch.arange(0, 256), torch.arange(2048, 2048 + 256)]).cuda()
    cu2 = torch.tensor([0, 256, 512], dtype=torch.int32, device="cuda")
    sub = [x[rows] for x in inp[:5]] + [cu2]
    assert kb.rel_l2(N.gdn_chunk_varlen(*sub), recurrence64(sub)[0]) < 1e-2


@pytest.mark.gpu
def test_native_wy_cuda_backward_matches_float64_repeats_and_is_the_trainer_gradient(kb):
    lens = [300, 64, 1, 129, 0, 77]
    inp = _cuda(make_inputs(lens, **QWEN35, seed=47, v_dtype=torch.bfloat16))
    do = out_grad(inp, 48)
    got = NB.wy_chunk_backward_triton(*inp, do)
    check_grads(kb, got, autograd64(inp, do, G.CHUNK), 1e-2, "cuda bf16 vs float64")   # twin: 3.8e-3
    again = NB.wy_chunk_backward_triton(*inp, do)
    for name, a, b in zip(NAMES, got, again):
        kb.assert_bitwise(a, b, f"second call d{name}")
    for fn in (N.gdn_chunk_varlen, G.gdn_cpr_varlen):   # both trainers take this backward
        leaves = [x.clone().requires_grad_() for x in inp[:5]]
        (fn(*leaves, inp[5]) * do).sum().backward()
        for name, leaf, d in zip(NAMES, leaves, got):
            kb.assert_bitwise(leaf.grad, d.to(leaf.dtype), f"{fn.__name__} grad d{name}")
    # fp32 operands at tf32x3: fp32-class gradients
    exact = NB.wy_chunk_backward_triton(*inp, do, choice=NW.NativeWYChoice(dot="tf32x3"))
    check_grads(kb, exact, autograd64(inp, do, G.CHUNK), 2e-5, "cuda tf32x3 vs float64")
