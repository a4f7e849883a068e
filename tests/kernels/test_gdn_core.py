"""Gated DeltaNet core: CPR (isoexec_kernels/gdn_core/) and the stock baselines (its native.py).

Invariance (bitwise, int32 views): trainer varlen == engine prefill split anywhere == decode;
a sequence alone == inside a batch; padded decode lanes are inert; reset restarts a slot.
Correctness (tolerance): transformers 5.17 ``torch_recurrent_gated_delta_rule`` and a float64
recurrence; gradients by gradcheck (float64) and against autograd through the recurrence.
Negative controls: the native chunk form and the native recurrence round differently, and a
native prefill split off the chunk grid changes bits.
Triton twins: fp32 cases in the Triton CPU interpreter (``interp_case_*``), GPU cases marked gpu.
"""

from __future__ import annotations

import sys

import pytest
import torch

from gdn_inputs import make_inputs
from isoexec_kernels import gdn_core as G
from isoexec_kernels.gdn_core import native as N
from isoexec_kernels.gdn_core.plan import HostPlan

SMALL = dict(Hk=2, H=4, Dk=16, Dv=16, C=16)


def assert_same(kb, a, b, what):
    """Bitwise for floats (int views), exact for integer tensors (fill counts)."""
    if a.is_floating_point():
        kb.assert_bitwise(a, b, what)
    else:
        assert torch.equal(a.cpu(), b.cpu()), f"{what}: {a.tolist()} vs {b.tolist()}"


def take(x, rows):
    return x[torch.as_tensor(rows, dtype=torch.long, device=x.device)]


def run_engine(inputs, lens, plan, slots, state, engine, decode, chunk, host: bool = False):
    """Drive the engine over ``plan``: a list of calls, each ("prefill", {b: n}) or
    ("decode", [b, ...]); returns o [T, H, Dv] assembled from the calls' rows. ``host``: give each
    prefill its layout on the host (``HostPlan``, as the engine's batches do)."""
    q, k, v, g, beta, cu = inputs
    out = torch.full((q.shape[0], v.shape[1], v.shape[2]), float("nan"), device=v.device)
    pos = [0] * len(lens)
    for kind, arg in plan:
        if kind == "prefill":
            rows, cus, sl, done = [], [0], [], []
            for b, n in arg.items():
                s = int(cu[b]) + pos[b]
                rows += range(s, s + n)
                cus.append(cus[-1] + n)
                sl.append(slots[b])
                done.append(pos[b])
                pos[b] += n
            kw = dict(host=HostPlan.of(list(arg.values()), sl, done)) if host else {}
            o = engine(*(take(x, rows) for x in (q, k, v, g, beta)),
                       torch.tensor(cus, dtype=torch.int32, device=v.device),
                       torch.tensor(sl, device=v.device), state, chunk=chunk, **kw)
        else:
            rows = [int(cu[b]) + pos[b] for b in arg]
            for b in arg:
                pos[b] += 1
            o = decode(*(take(x, rows) for x in (q, k, v, g, beta)),
                       torch.tensor([slots[b] for b in arg], device=v.device), state, chunk=chunk)
        if rows:
            out[torch.tensor(rows, dtype=torch.long, device=v.device)] = o
    assert pos == list(lens), "plan does not cover every token"
    return out


def random_plan(lens, seed, max_decode=20):
    """Each sequence: random prefill pieces (some empty, some longer than a chunk), then the
    last tokens by decode; calls interleave sequences (mixed prefill and decode rounds)."""
    gen = torch.Generator().manual_seed(seed)
    todo = []
    for b, L in enumerate(lens):
        d = int(torch.randint(0, min(L, max_decode) + 1, (1,), generator=gen))
        pre = L - d
        cuts = sorted(torch.randint(0, pre + 1, (int(torch.randint(0, 4, (1,), generator=gen)),),
                                    generator=gen).tolist())
        pieces = [b2 - a for a, b2 in zip([0] + cuts, cuts + [pre])]
        todo.append([("prefill", n) for n in pieces] + [("decode", 1)] * d)
    plan = []
    while any(todo):
        pf = {b: t.pop(0)[1] for b, t in enumerate(todo) if t and t[0][0] == "prefill"}
        if pf:
            plan.append(("prefill", pf))
        dec = [b for b, t in enumerate(todo) if t and t[0][0] == "decode" and b not in pf]
        if dec:
            for b in dec:
                todo[b].pop(0)
            plan.append(("decode", dec))
    return plan


def transformers_recurrence(q, k, v, g, beta, cu, Dk):
    sys.modules.setdefault("fla", None)
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    rep = v.shape[1] // k.shape[1]
    outs = []
    for b in range(cu.numel() - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        # transformers scales q by Dk^-0.5 itself
        o, _ = torch_recurrent_gated_delta_rule(
            (q[s:e] * Dk ** 0.5).repeat_interleave(rep, 1)[None], k[s:e].repeat_interleave(rep, 1)[None],
            v[s:e].float()[None], g[s:e][None], beta[s:e][None])
        outs.append(o[0])
    return torch.cat(outs)


def recurrence64(inp):
    """Float64 per-token recurrence on the inputs' device (the correctness reference on GPU and
    under the interpreter)."""
    return N.torch_recurrence(*(x.double() for x in inp[:5]), inp[5])


LENS = [37, 0, 50, 16, 5, 1, 33]


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_cpr_reference_matches_transformers_recurrence_and_float64(kb, v_dtype):
    inp = make_inputs(LENS, **{k: SMALL[k] for k in ("Hk", "H", "Dk", "Dv")}, seed=1, v_dtype=v_dtype)
    q, k, v, g, beta, cu = inp
    o = G.gdn_cpr_varlen(*inp, chunk=SMALL["C"])
    assert o.dtype == torch.float32 and o.shape == (sum(LENS), 4, 16)
    want = transformers_recurrence(q, k, v, g, beta, cu, SMALL["Dk"])
    assert kb.rel_l2(o, want) < 1e-5
    want64 = N.torch_recurrence(q.double(), k.double(), v.double(), g.double(), beta.double(), cu)
    assert kb.rel_l2(o, want64) < 1e-5
    assert kb.rel_l2(o, torch.zeros_like(o) + 1) > 0.5  # not a trivial output


def test_cpr_reference_matches_at_qwen35_head_dims_and_chunk_64(kb):
    # 128-dim heads, chunk 64, GQA 2:1, sequences crossing several boundaries, strong decay
    inp = make_inputs([150, 64, 3], Hk=1, H=2, Dk=128, Dv=128, seed=2, g_scale=2.0)
    o = G.gdn_cpr_varlen(*inp)
    want = transformers_recurrence(*inp, 128)
    assert kb.rel_l2(o, want) < 1e-5


def test_chunk_update_equals_token_recurrence_state(kb):
    q, k, v, g, beta, cu = make_inputs([16], Hk=1, H=1, Dk=16, Dv=8, seed=3)
    S0 = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(4)) * 0.3
    Sc = G.chunk_update_reference(S0, k[:, 0][None], v[:, 0][None], g[:, 0][None], beta[:, 0][None])
    _, Sr = N.torch_recurrence(q.double(), k.double(), v.double(), g.double(), beta.double(), cu,
                               initial_state=S0.double()[:, None], output_final_state=True)
    assert kb.rel_l2(Sc[0], Sr[0, 0]) < 1e-6


# --------------------------------------------------------------------------- invariance (reference)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_cpr_trainer_equals_engine_prefill_random_splits_and_decode_bitwise(kb, seed, v_dtype):
    p = SMALL
    inp = make_inputs(LENS, p["Hk"], p["H"], p["Dk"], p["Dv"], seed=10 + seed, v_dtype=v_dtype)
    o_train = G.gdn_cpr_varlen(*inp, chunk=p["C"])
    state = G.GDNState.allocate(len(LENS) + 2, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    slots = list(torch.randperm(len(LENS) + 2, generator=torch.Generator().manual_seed(seed))[:len(LENS)].tolist())
    plan = random_plan(LENS, seed)
    assert any(k == "decode" for k, _ in plan) and any(k == "prefill" for k, _ in plan)
    o_eng = run_engine(inp, LENS, plan, slots, state, G.gdn_cpr_engine, G.gdn_cpr_decode, p["C"])
    rep = kb.bit_report(o_eng, o_train)
    assert rep["elements"] == o_train.numel() and rep["differing"] == 0, rep
    # the final state of each slot equals a one-shot prefill of the whole sequence
    one = G.GDNState.allocate(len(LENS) + 2, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    G.gdn_cpr_engine(*inp[:5], inp[5], torch.tensor(slots), one, chunk=p["C"])
    for f in ("boundary", "running", "fill"):
        assert_same(kb, getattr(state, f)[slots], getattr(one, f)[slots], f"state.{f}")
    C = p["C"]
    for b, L in enumerate(LENS):
        r = L % C
        kb.assert_bitwise(state.buf_v[slots[b], :r], one.buf_v[slots[b], :r], "buf_v")


@pytest.mark.parametrize("form", ["rows", "wy"])
def test_cpr_reference_boundary_forms_keep_cases_bitwise_and_accurate(kb, monkeypatch, form):
    # either form of chunk_update (reference.BOUNDARY: the pinned one, or the other) keeps the
    # trainer == engine split == decode and the float64 recurrence's values; the two forms differ
    monkeypatch.setattr(G.reference, "BOUNDARY", form)
    lens = [150, 64, 3, 77]
    inp = make_inputs(lens, Hk=1, H=2, Dk=32, Dv=16, seed=5, g_scale=2.0)
    o = G.gdn_cpr_varlen_reference(*inp)
    assert kb.rel_l2(o, transformers_recurrence(*inp, 32)) < 1e-5
    S0 = torch.randn(1, 32, 16, generator=torch.Generator().manual_seed(6)) * 0.3
    q, k, v, g, beta, _ = make_inputs([64], Hk=1, H=1, Dk=32, Dv=16, seed=7)
    Sc = G.chunk_update_reference(S0, k[:, 0][None], v[:, 0][None], g[:, 0][None], beta[:, 0][None])
    _, Sr = N.torch_recurrence(q.double(), k.double(), v.double(), g.double(), beta.double(),
                               torch.tensor([0, 64]), initial_state=S0.double()[:, None], output_final_state=True)
    assert kb.rel_l2(Sc[0], Sr[0, 0]) < 1e-6
    state = G.GDNState.allocate(5, 2, 32, 16, "cpu")
    o_eng = run_engine(inp, lens, random_plan(lens, 3, max_decode=70), [4, 0, 1, 2], state,
                       G.gdn_cpr_engine_reference, G.gdn_cpr_decode_reference, G.CHUNK)
    kb.assert_bitwise(o_eng, o, f"reference engine/decode vs trainer, {form} form")
    other = "rows" if form == "wy" else "wy"
    monkeypatch.setattr(G.reference, "BOUNDARY", other)
    assert kb.bit_report(G.gdn_cpr_varlen_reference(*inp), o)["differing"] > 0


def test_cpr_prefill_split_at_every_token_equals_one_shot_bitwise(kb):
    p = SMALL
    L = 2 * p["C"] + 5
    inp = make_inputs([L], p["Hk"], p["H"], p["Dk"], p["Dv"], seed=7)
    one_state = G.GDNState.allocate(1, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    o_one = G.gdn_cpr_engine(*inp, torch.tensor([0]), one_state, chunk=p["C"])
    for cut in range(0, L + 1, 3):
        st = G.GDNState.allocate(1, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
        o = run_engine(inp, [L], [("prefill", {0: cut}), ("prefill", {0: L - cut})], [0], st,
                       G.gdn_cpr_engine, G.gdn_cpr_decode, p["C"])
        kb.assert_bitwise(o, o_one, f"split at {cut}")
        kb.assert_bitwise(st.running, one_state.running, f"running after split at {cut}")


def test_cpr_sequence_alone_equals_sequence_in_batch_bitwise(kb):
    p = SMALL
    gen = torch.Generator().manual_seed(5)
    needle = make_inputs([45], p["Hk"], p["H"], p["Dk"], p["Dv"], seed=6)
    o_alone = G.gdn_cpr_varlen(*needle, chunk=p["C"])
    for trial in range(3):
        n = int(torch.randint(2, 7, (1,), generator=gen))
        lens = torch.randint(0, 80, (n,), generator=gen).tolist()
        at = int(torch.randint(0, n, (1,), generator=gen))
        lens[at] = 45
        batch = list(make_inputs(lens, p["Hk"], p["H"], p["Dk"], p["Dv"], seed=100 + trial))
        s = int(batch[5][at])
        for i in range(5):
            batch[i][s:s + 45] = needle[i]
        o = G.gdn_cpr_varlen(*batch, chunk=p["C"])
        kb.assert_bitwise(o[s:s + 45], o_alone, f"needle at {at} of {lens}")
    # decode lanes: a lane alone == the same lane among others
    st1 = G.GDNState.allocate(4, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    stn = G.GDNState.allocate(4, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    others = make_inputs([3, 3, 3], p["Hk"], p["H"], p["Dk"], p["Dv"], seed=8)
    for t in range(p["C"] + 3):  # crosses a resync
        row = [x[t:t + 1] for x in needle[:5]]
        o1 = G.gdn_cpr_decode(*row, torch.tensor([2]), st1, chunk=p["C"])
        lanes = [torch.cat([others[i][:2], row[i], others[i][2:3]]) for i in range(5)]
        on = G.gdn_cpr_decode(*lanes, torch.tensor([0, 1, 2, 3]), stn, chunk=p["C"])
        kb.assert_bitwise(on[2:3], o1, f"decode step {t}")
        kb.assert_bitwise(o1, o_alone[t:t + 1], f"decode step {t} vs trainer")


def test_state_reset_zeroes_slots_and_restarts_the_sequence(kb):
    p = SMALL
    inp = make_inputs([20, 30], p["Hk"], p["H"], p["Dk"], p["Dv"], seed=9)
    st = G.GDNState.allocate(3, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    G.gdn_cpr_engine(*inp, torch.tensor([0, 2]), st, chunk=p["C"])
    kept = {f: getattr(st, f)[2].clone() for f in ("boundary", "running", "buf_k", "fill")}
    assert int(st.fill[0]) == 20 % p["C"] and float(st.running[0].abs().sum()) > 0
    st.reset_(torch.tensor([0]))
    for f in ("boundary", "running", "buf_k", "buf_v", "buf_g", "buf_beta", "fill"):
        assert not getattr(st, f)[0].any(), f
    for f, t in kept.items():
        assert_same(kb, getattr(st, f)[2], t, f"slot 2 {f} after resetting slot 0")
    q, k, v, g, beta, cu = inp
    o_again = G.gdn_cpr_engine(q[:20], k[:20], v[:20], g[:20], beta[:20], cu[:2], torch.tensor([0]), st,
                               chunk=p["C"])
    o_fresh = G.gdn_cpr_varlen(q[:20], k[:20], v[:20], g[:20], beta[:20], cu[:2], chunk=p["C"])
    kb.assert_bitwise(o_again, o_fresh, "restart after reset")


def _padded_decode_check(kb, decode, device, chunk, heads=(SMALL["Hk"], SMALL["H"]), after=4):
    """Decode with and without padded lanes (garbage inputs, all pointing at scratch slot 4)
    gives the same real outputs and leaves real slots bitwise identical, across a resync
    (``after`` steps after the one that completes the chunk and resyncs; ``heads`` = (Hk, H))."""
    p = SMALL
    Hk, H = heads
    L = chunk + after
    real = make_inputs([L] * 2, Hk, H, p["Dk"], p["Dv"], seed=11)
    junk = make_inputs([L] * 3, Hk, H, p["Dk"], p["Dv"], seed=12)
    real = [x.to(device) for x in real]
    junk = [(x * 1e3).to(device) if x.is_floating_point() else x for x in junk]
    a = G.GDNState.allocate(5, H, p["Dk"], p["Dv"], device, chunk=chunk)
    b = G.GDNState.allocate(5, H, p["Dk"], p["Dv"], device, chunk=chunk)
    for t in range(L):
        r = [torch.stack([x[t], x[L + t]]) for x in real[:5]]
        oa = decode(*r, torch.tensor([1, 3], device=device), a, chunk=chunk)
        j = [torch.stack([x[t], x[L + t], x[2 * L + t]]) for x in junk[:5]]
        rb = [torch.cat([jj[:1], rr[:1], jj[1:2], rr[1:], jj[2:]]) for jj, rr in zip(j, r)]
        ob = decode(*rb, torch.tensor([4, 1, 4, 3, 4], device=device), b, chunk=chunk)
        kb.assert_bitwise(ob[[1, 3]], oa, f"decode step {t} outputs")
    for f in ("boundary", "running", "buf_k", "buf_v", "buf_g", "buf_beta", "fill"):
        assert_same(kb, getattr(b, f)[:4], getattr(a, f)[:4], f"state.{f} real slots")
    assert float(a.boundary[1].abs().sum()) > 0  # a resync happened


def test_cpr_decode_padded_lanes_do_not_disturb_other_slots(kb):
    _padded_decode_check(kb, G.gdn_cpr_decode, "cpu", SMALL["C"])


def _hazard_inputs(Hk, H):
    """Zero decay (g = -0.0 and +0.0), beta at 0 and 1, repeated identical keys (an ill-
    conditioned UT system), non-contiguous q/k/v/g/beta views."""
    p = SMALL
    q, k, v, g, beta, cu = make_inputs([40, 17], Hk, H, p["Dk"], p["Dv"], seed=22)
    g[:5] = -0.0
    g[5:10] = 0.0
    beta[10:14] = 1.0
    beta[14:16] = 0.0
    k[20:30] = k[20:21]
    assert (g == 0).sum() > 0 and torch.signbit(g[:5]).all() and (beta == 1).any() and (beta == 0).any()
    qk = torch.cat([q, k], dim=-1)
    vv = torch.cat([v, v], dim=-1)
    gb = torch.stack([g, beta], dim=-1)
    views = (qk[..., :p["Dk"]], qk[..., p["Dk"]:], vv[..., :p["Dv"]], gb[..., 0], gb[..., 1])
    assert not any(x.is_contiguous() for x in views)
    return (q, k, v, g, beta), views, cu


def _hazard_check(kb, varlen, reference, heads=(SMALL["Hk"], SMALL["H"])):
    """``reference(q, k, v, g, beta, cu)``: the recurrence the output is held to; ``heads`` = (Hk, H)."""
    Hk, H = heads
    dense, views, cu = _hazard_inputs(Hk, H)
    o = varlen(*dense, cu, chunk=SMALL["C"])
    kb.assert_bitwise(varlen(*views, cu, chunk=SMALL["C"]), o, "non-contiguous inputs")
    assert kb.rel_l2(o, reference(*dense, cu)) < 1e-5
    z = torch.zeros(0, Hk, SMALL["Dk"])
    empty = varlen(z, z, torch.zeros(0, H, SMALL["Dv"]), torch.zeros(0, H),
                   torch.zeros(0, H), torch.zeros(2, dtype=torch.int32), chunk=SMALL["C"])
    assert empty.shape == (0, H, SMALL["Dv"])


def test_cpr_hazards_zero_decay_extreme_beta_repeated_keys_noncontiguous_empty(kb):
    _hazard_check(kb, G.gdn_cpr_varlen, lambda *inp: transformers_recurrence(*inp, SMALL["Dk"]))


def interp_case_cpr_triton_hazards(kb):
    # half SMALL's heads, the same 2 value heads per key head (the hazards are in the values; key
    # heads past the first: the engine split and sequence-in-batch cases)
    _hazard_check(kb, G.gdn_cpr_varlen_triton, lambda *inp: recurrence64(inp), heads=(1, 2))


def test_cpr_rejects_mismatched_shapes_and_state():
    q, k, v, g, beta, cu = make_inputs([5], 2, 4, 16, 16, seed=0)
    with pytest.raises(ValueError, match="multiple of key heads"):
        G.gdn_cpr_varlen(q, k, v[:, :3], g[:, :3], beta[:, :3], cu)
    with pytest.raises(ValueError, match="g and beta must be"):
        G.gdn_cpr_varlen(q, k, v, g[:, :2], beta, cu)
    st = G.GDNState.allocate(1, 4, 16, 8, "cpu", chunk=16)
    with pytest.raises(ValueError, match="allocate the state"):
        G.gdn_cpr_engine(q, k, v, g, beta, cu, torch.tensor([0]), st, chunk=16)


# --------------------------------------------------------------------------- gradients


def test_cpr_gradcheck_float64():
    d = torch.float64
    q, k, v, g, beta, cu = make_inputs([6, 3, 5], Hk=1, H=2, Dk=4, Dv=3, seed=13, dtype=d, v_dtype=d)
    xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    assert torch.autograd.gradcheck(lambda *a: G.gdn_cpr_varlen(*a, cu, chunk=4), xs)


def test_cpr_grad_matches_autograd_through_recurrence(kb):
    inp = make_inputs([37, 20, 9], Hk=2, H=4, Dk=16, Dv=8, seed=14)
    cu = inp[5]
    xs = [x.clone().requires_grad_() for x in inp[:5]]
    ref = [x.detach().double().requires_grad_() for x in inp[:5]]
    w = torch.randn(sum([37, 20, 9]), 4, 8, generator=torch.Generator().manual_seed(15))
    (G.gdn_cpr_varlen(*xs, cu, chunk=16) * w).sum().backward()
    (N.torch_recurrence(*ref, cu) * w.double()).sum().backward()
    for name, a, b in zip("q k v g beta".split(), xs, ref):
        assert a.grad.dtype == a.dtype
        assert kb.rel_l2(a.grad, b.grad) < 1e-4, name
        assert float(b.grad.abs().sum()) > 0, name


def test_cpr_grad_with_bf16_values_has_value_dtype(kb):
    q, k, v, g, beta, cu = make_inputs([20], 1, 2, 8, 8, seed=16, v_dtype=torch.bfloat16)
    v = v.requires_grad_()
    G.gdn_cpr_varlen(q, k, v, g, beta, cu, chunk=8).sum().backward()
    assert v.grad.dtype == torch.bfloat16 and v.grad.abs().sum() > 0


# --------------------------------------------------------------------------- native baselines


def test_native_chunk_and_recurrent_differ_in_bits_but_match_recurrence(kb):
    inp = make_inputs([100, 70], 2, 4, 16, 16, seed=17)
    oc = N.gdn_chunk_varlen(*inp, chunk=16)
    orr = N.gdn_recurrent_varlen(*inp)
    want = transformers_recurrence(*inp, 16)
    assert kb.rel_l2(oc, want) < 1e-5 and kb.rel_l2(orr, want) < 1e-5
    rep = kb.bit_report(oc, orr)
    assert rep["differing"] > 0, f"native chunk and recurrence gave identical bits: {rep}"


def test_native_chunk_prefill_split_off_the_grid_changes_bits(kb):
    """Negative control: the native chunk engine re-chunks each piece from its first token."""
    p = SMALL
    L = 50
    inp = make_inputs([L], p["Hk"], p["H"], p["Dk"], p["Dv"], seed=18)
    one = G.GDNState.allocate(1, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    o_one = N.gdn_chunk_engine(*inp, torch.tensor([0]), one, chunk=p["C"])
    st = G.GDNState.allocate(1, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    o_split = run_engine(inp, [L], [("prefill", {0: 7}), ("prefill", {0: L - 7})], [0], st,
                         N.gdn_chunk_engine, N.gdn_recurrent_decode, p["C"])
    want = transformers_recurrence(*inp, p["Dk"])
    assert kb.rel_l2(o_split, want) < 1e-5 and kb.rel_l2(o_one, want) < 1e-5
    assert kb.bit_report(o_split, o_one)["differing"] > 0
    # CPR on the same split: identical
    a = G.GDNState.allocate(1, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    c1 = G.gdn_cpr_engine(*inp, torch.tensor([0]), a, chunk=p["C"])
    b = G.GDNState.allocate(1, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    c2 = run_engine(inp, [L], [("prefill", {0: 7}), ("prefill", {0: L - 7})], [0], b,
                    G.gdn_cpr_engine, G.gdn_cpr_decode, p["C"])
    kb.assert_bitwise(c2, c1, "CPR split at 7")


def test_native_engine_and_decode_match_recurrence(kb):
    p = SMALL
    lens = [40, 23]
    inp = make_inputs(lens, p["Hk"], p["H"], p["Dk"], p["Dv"], seed=19)
    want = transformers_recurrence(*inp, p["Dk"])
    plan = random_plan(lens, 3)
    for eng in (N.gdn_chunk_engine, N.gdn_recurrent_engine):
        st = G.GDNState.allocate(3, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
        o = run_engine(inp, lens, plan, [2, 0], st, eng, N.gdn_recurrent_decode, p["C"])
        assert kb.rel_l2(o, want) < 1e-5, eng.__name__


def _engines_with_state():
    from isoexec_kernels.gdn_core import cpr_chunk_reference as R4

    return [("native chunk", N.gdn_chunk_engine, N.gdn_recurrent_decode, {}),
            ("native recurrent", N.gdn_recurrent_engine, N.gdn_recurrent_decode, {}),
            ("cpr v3", G.gdn_cpr_engine, G.gdn_cpr_decode, {}),
            ("cpr v4", R4.cpr4_engine_reference, R4.cpr4_decode_reference, {"with_q": True})]


@pytest.mark.parametrize("which", range(4))
def test_engine_prefill_with_the_host_plan_gives_the_readback_bits_and_state(kb, which):
    # the engine's batches give each prefill its layout on the host (HostPlan: no readbacks); the
    # outputs and every field of the state must be those of the call that reads the layout back
    name, engine, decode, alloc = _engines_with_state()[which]
    p = SMALL
    lens = [40, 23, 9]
    inp = make_inputs(lens, p["Hk"], p["H"], p["Dk"], p["Dv"], seed=23, v_dtype=torch.bfloat16)
    plan = random_plan(lens, 5)
    assert sum(k == "prefill" for k, _ in plan) >= 2, "the plan must prefill onto an open chunk"
    runs = []
    for host in (False, True):
        st = G.GDNState.allocate(5, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"], value_dtype=torch.bfloat16,
                                 **alloc)
        runs.append((run_engine(inp, lens, plan, [3, 0, 4], st, engine, decode, p["C"], host=host), st))
    (o0, s0), (o1, s1) = runs
    kb.assert_bitwise(o1, o0, f"{name}: outputs with the host plan")
    assert torch.equal(s1.fill, s0.fill), f"{name}: state.fill with the host plan"
    for f in ("boundary", "running", "buf_k", "buf_v", "buf_g", "buf_beta", "buf_q", "buf_vn", "buf_T"):
        if getattr(s0, f) is not None:
            kb.assert_bitwise(getattr(s1, f), getattr(s0, f), f"{name}: state.{f} with the host plan")


def test_a_host_plan_that_does_not_describe_the_inputs_is_refused():
    p = SMALL
    inp = make_inputs([7, 5], p["Hk"], p["H"], p["Dk"], p["Dv"], seed=3)
    st = G.GDNState.allocate(3, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    wrong = HostPlan.of([7, 4], [0, 1], [0, 0])
    with pytest.raises(ValueError, match="host plan describes 2 sequences of 11 new tokens, the inputs 2 "
                                         "sequences of 12"):
        N.gdn_chunk_engine(*inp[:5], inp[5], torch.tensor([0, 1]), st, chunk=p["C"], host=wrong)


def test_native_trainer_backward_matches_recurrence(kb):
    inp = make_inputs([30, 11], 1, 2, 8, 8, seed=20)
    w = torch.randn(41, 2, 8, generator=torch.Generator().manual_seed(21))
    grads = []
    for fn in (N.gdn_chunk_varlen, N.gdn_recurrent_varlen):
        xs = [x.clone().requires_grad_() for x in inp[:5]]
        (fn(*xs, inp[5], chunk=8) * w).sum().backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert kb.rel_l2(a, b) < 1e-4


# --------------------------------------------------------------------------- Triton interpreter
# Each interp_case_* runs in the TRITON_INTERPRET=1 subprocess (conftest); fp32 only.
# Under the interpreter tl.dot is the host BLAS, whose bits for a row can depend on the tile and
# the row's place in it (tests/kernels/test_gemm.py). The bitwise checks below still hold on any
# host: CPR feeds every tl.dot (chunk prep and state kernels) the same C tokens of one sequence
# from the same boundary state in every case compared (alone or in a batch, trainer, engine
# pieces, decode resync), and the per-token step and its outputs use tl.sum, not tl.dot.
# Accuracy is held to the float64 recurrence (``recurrence64``), not to transformers' fp32 one: its
# import alone took 2.7 s of the interpreter subprocess's CPU, and the CPU tests above hold the
# reference to both (test_cpr_reference_matches_transformers_recurrence_and_float64).


def interp_case_cpr_triton_varlen_engine_split_decode_bitwise_and_matches_reference(kb):
    p = SMALL
    lens = [37, 0, 20, 18]
    inp = make_inputs(lens, p["Hk"], p["H"], p["Dk"], p["Dv"], seed=30)
    o = G.gdn_cpr_varlen_triton(*inp, chunk=p["C"])
    assert kb.rel_l2(o, G.gdn_cpr_varlen_reference(*inp, chunk=p["C"])) < 1e-5
    assert kb.rel_l2(o, recurrence64(inp)) < 1e-5
    st = G.GDNState.allocate(5, p["H"], p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    # pieces crossing a boundary from a partly filled chunk, ending exactly on one, decode resync
    plan = [("prefill", {0: 5, 1: 0, 2: 17, 3: 2}), ("prefill", {0: 20, 3: 13}), ("decode", [0, 2, 3]),
            ("prefill", {0: 6, 2: 1}), ("decode", [0, 2, 3]), ("prefill", {0: 4, 3: 1})]
    o_eng = run_engine(inp, lens, plan, [4, 0, 1, 2], st, G.gdn_cpr_engine_triton, G.gdn_cpr_decode_triton,
                       p["C"])
    kb.assert_bitwise(o_eng, o, "triton engine/decode vs triton varlen")


def interp_case_cpr_triton_sequence_alone_equals_in_batch(kb):
    p = SMALL
    needle = make_inputs([21], p["Hk"], p["H"], p["Dk"], p["Dv"], seed=31)
    alone = G.gdn_cpr_varlen_triton(*needle, chunk=p["C"])
    lens = [9, 21, 5]   # the needle off the chunk grid, a sequence on each side
    batch = list(make_inputs(lens, p["Hk"], p["H"], p["Dk"], p["Dv"], seed=32))
    for i in range(5):
        batch[i][9:30] = needle[i]
    kb.assert_bitwise(G.gdn_cpr_varlen_triton(*batch, chunk=p["C"])[9:30], alone, "needle")


def interp_case_cpr_triton_decode_padded_lanes_inert(kb):
    # half the heads of SMALL (the same 2 value heads per key head; key heads past the first: the
    # engine split case), and one step after the resync instead of four: the interpreter's time is
    # programs (lanes x heads) x steps
    _padded_decode_check(kb, G.gdn_cpr_decode_triton, "cpu", SMALL["C"], heads=(1, 2), after=1)


def interp_case_native_triton_chunk_and_recurrent_match_recurrence(kb):
    p = SMALL
    lens = [37, 3, 20]
    # one key head for two value heads (SMALL's ratio at half its heads): the per-token kernel meets
    # key heads past the first in the CPR cases (SMALL), the WY kernels in test_gdn_native_wy.py
    inp = make_inputs(lens, 1, 2, p["Dk"], p["Dv"], seed=33)
    want = recurrence64(inp)
    for kind in ("chunk", "recurrent"):
        assert kb.rel_l2(N._varlen_triton(*inp, p["C"], kind), want) < 1e-5, kind
    st = G.GDNState.allocate(3, 2, p["Dk"], p["Dv"], "cpu", chunk=p["C"])
    plan = [("prefill", {0: 19, 1: 2, 2: 0}), ("prefill", {0: 17, 2: 19}), ("decode", [0, 1, 2])]
    for eng in (N._engine,):
        o = run_engine(inp, lens, plan, [1, 2, 0], st,
                       lambda *a, chunk: eng(*a, chunk, "chunk", triton=True), _native_decode_triton, p["C"])
        assert kb.rel_l2(o, want) < 1e-5


def interp_case_cpr_triton_other_kernel_choice_keeps_cases_bitwise_and_accurate(kb):
    # a non-pinned choice (TF32x3 dots, blocked inverse of I + A, narrow per-token tile) gives
    # other bits than the pinned one, but the same bits in every case, and the same function
    choice = G.triton_kernels.CPRKernelChoice(dot="tf32x3", rec_bv=8, rec_warps=1, inv_bs=16)
    C = 32  # two 16-row blocks: the blocked inverse's merge runs
    lens = [47, 3, 20]
    inp = make_inputs(lens, 1, 2, 16, 16, seed=34)
    o = G.gdn_cpr_varlen_triton(*inp, chunk=C, choice=choice)
    assert kb.rel_l2(o, recurrence64(inp)) < 1e-5
    st = G.GDNState.allocate(4, 2, 16, 16, "cpu", chunk=C)
    # sequence 0: its first chunk completes in a decode step (resync), the second inside a prefill
    plan = [("prefill", {0: 31, 1: 1, 2: 19}), ("decode", [0, 1, 2]), ("prefill", {0: 13}), ("decode", [0, 1]),
            ("prefill", {0: 1})]

    def engine(*a, chunk):
        return G.gdn_cpr_engine_triton(*a, chunk=chunk, choice=choice)

    def decode(*a, chunk):
        return G.gdn_cpr_decode_triton(*a, chunk=chunk, choice=choice)
    kb.assert_bitwise(run_engine(inp, lens, plan, [3, 0, 1], st, engine, decode, C), o,
                      "engine/decode vs varlen, non-pinned choice")


def interp_case_cpr_triton_wy_boundary_keeps_cases_bitwise_and_accurate(kb):
    # the WY form of the boundary update (cpr_wy.py): other bits than the rows form, the same
    # bits in every case (a decode resync, a resync inside a prefill, a split prefill), fp32-accurate
    choice = G.triton_kernels.CPRKernelChoice(boundary="wy")
    C = 32  # two 16-row blocks: the blocked inverse's merge dots run
    lens = [47, 3, 20, 40]
    inp = make_inputs(lens, 1, 2, 16, 16, seed=35)
    o = G.gdn_cpr_varlen_triton(*inp, chunk=C, choice=choice)
    assert kb.rel_l2(o, recurrence64(inp)) < 1e-5
    # the rows form on sequence 0 alone, which crosses a boundary: the forms differ there already (a
    # sequence's bits do not depend on its batch: the sequence-alone case above; and were they to,
    # this check would only find more differences)
    rows = G.gdn_cpr_varlen_triton(*(x[:47] for x in inp[:5]), inp[5][:2], chunk=C,
                                   choice=G.triton_kernels.CPRKernelChoice(boundary="rows"))
    assert kb.bit_report(o[:47], rows)["differing"] > 0, \
        "the wy boundary form should round otherwise than the rows form"
    st = G.GDNState.allocate(5, 2, 16, 16, "cpu", chunk=C)
    # sequence 0: its first chunk completes in a decode step; sequence 3: 20 rows, a decode step, then
    # a prefill from the partly filled chunk across its boundary (a resync inside a prefill)
    plan = [("prefill", {0: 31, 1: 1, 2: 19, 3: 20}), ("decode", [0, 1, 2, 3]), ("prefill", {0: 13, 3: 19}),
            ("decode", [0, 1]), ("prefill", {0: 1})]

    def engine(*a, chunk):
        return G.gdn_cpr_engine_triton(*a, chunk=chunk, choice=choice)

    def decode(*a, chunk):
        return G.gdn_cpr_decode_triton(*a, chunk=chunk, choice=choice)
    kb.assert_bitwise(run_engine(inp, lens, plan, [4, 0, 1, 2], st, engine, decode, C), o,
                      "engine/decode vs varlen, wy boundary")


def interp_case_cpr_triton_prefetch_gives_the_same_bits(kb):
    # loading the per-token kernel's next row early moves no arithmetic: a sequence across a
    # boundary (C = 32) and a short one after it. With the pinned boundary form only: the per-token
    # kernel, where the prefetch is, is the same launch with either form (it takes the entering
    # states the form made, not the form); the GPU case takes both
    lens = [47, 3]
    inp = make_inputs(lens, 1, 2, 16, 16, seed=36)
    boundary = G.triton_kernels.PINNED.boundary
    plain = G.triton_kernels.CPRKernelChoice(boundary=boundary)
    pre = G.triton_kernels.CPRKernelChoice(boundary=boundary, rec_prefetch=True)
    kb.assert_bitwise(G.gdn_cpr_varlen_triton(*inp, chunk=32, choice=pre),
                      G.gdn_cpr_varlen_triton(*inp, chunk=32, choice=plain), f"prefetch, {boundary}")


def _native_decode_triton(q, k, v, g, beta, slots, state, chunk):
    # gdn_recurrent_decode dispatches by device; call its CUDA branch's kernel directly on CPU
    B, Hk = k.shape[:2]
    H = v.shape[1]
    lanes = torch.arange(B, dtype=torch.int32)
    o = torch.empty(B, H, v.shape[2])
    s32 = slots.to(torch.int32)
    G.triton_kernels.launch_recurrent(q, k, v, g, beta, o, state.running, state.running, lanes, torch.ones_like(lanes),
                       s32, s32, H, H // Hk)
    return o


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_gdn_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gdn_core", case)


# --------------------------------------------------------------------------- CUDA


QWEN35 = dict(Hk=16, H=32, Dk=128, Dv=128)


@pytest.mark.gpu
@pytest.mark.parametrize("v_dtype", [torch.bfloat16, torch.float32])
def test_cpr_cuda_varlen_equals_engine_split_and_decode_bitwise(kb, v_dtype):
    lens = [300, 64, 1, 129, 0, 77]
    inp = [x.cuda() for x in make_inputs(lens, **QWEN35, seed=40, v_dtype=v_dtype)]
    o = G.gdn_cpr_varlen(*inp)
    assert o.is_cuda and o.dtype == torch.float32
    assert kb.rel_l2(o, recurrence64(inp)) < 1e-5
    for seed in (0, 1):
        st = G.GDNState.allocate(8, QWEN35["H"], 128, 128, "cuda")
        o_eng = run_engine(inp, lens, random_plan(lens, seed, max_decode=70), [7, 0, 1, 2, 3, 4], st,
                           G.gdn_cpr_engine, G.gdn_cpr_decode, G.CHUNK)
        kb.assert_bitwise(o_eng, o, f"cuda engine/decode plan {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("choice", [dict(boundary="wy"), dict(dot="tf32x3", rec_bv=8, rec_warps=1, inv_bs=16),
                                    dict(boundary="rows"),
                                    dict(boundary="wy", rec_prefetch=True, rec_bv=16, rec_warps=1)],
                         ids=["wy", "rows_rec8_inv16", "rows_v2", "wy_prefetch_rec16"])
def test_cpr_cuda_other_kernel_choice_keeps_cases_bitwise_and_accurate(kb, choice):
    # the candidates of scripts/cpr_variant_sweep.py: each must keep trainer == engine split ==
    # decode (its own bits) and the float64 recurrence's values
    c = G.triton_kernels.CPRKernelChoice(**choice)
    lens = [300, 64, 1, 129, 0, 77]
    inp = [x.cuda() for x in make_inputs(lens, **QWEN35, seed=41, v_dtype=torch.bfloat16)]
    o = G.gdn_cpr_varlen_triton(*inp, choice=c)
    assert kb.rel_l2(o, recurrence64(inp)) < 1e-5

    def engine(*a, chunk):
        return G.gdn_cpr_engine_triton(*a, chunk=chunk, choice=c)

    def decode(*a, chunk):
        return G.gdn_cpr_decode_triton(*a, chunk=chunk, choice=c)
    st = G.GDNState.allocate(8, QWEN35["H"], 128, 128, "cuda")
    o_eng = run_engine(inp, lens, random_plan(lens, 2, max_decode=70), [7, 0, 1, 2, 3, 4], st, engine, decode,
                       G.CHUNK)
    kb.assert_bitwise(o_eng, o, f"cuda engine/decode, choice {c}")


@pytest.mark.gpu
@pytest.mark.parametrize("boundary", ["rows", "wy"])
def test_cpr_cuda_prefetch_gives_the_same_bits(kb, boundary):
    # the per-token kernel's next-row prefetch moves loads, not arithmetic
    lens = [300, 64, 1, 129, 77]
    inp = [x.cuda() for x in make_inputs(lens, **QWEN35, seed=43, v_dtype=torch.bfloat16)]
    plain = G.triton_kernels.CPRKernelChoice(boundary=boundary)
    pre = G.triton_kernels.CPRKernelChoice(boundary=boundary, rec_prefetch=True)
    kb.assert_bitwise(G.gdn_cpr_varlen_triton(*inp, choice=pre), G.gdn_cpr_varlen_triton(*inp, choice=plain),
                      f"prefetch, {boundary}")


@pytest.mark.gpu
def test_cpr_cuda_triton_matches_cpu_reference(kb):
    p = SMALL
    inp = make_inputs(LENS, p["Hk"], p["H"], 32, 32, seed=48)
    o = G.gdn_cpr_varlen(*[x.cuda() for x in inp], chunk=p["C"])
    assert kb.rel_l2(o, G.gdn_cpr_varlen_reference(*inp, chunk=p["C"])) < 1e-5


@pytest.mark.gpu
def test_cpr_cuda_sequence_alone_equals_in_batch_bitwise(kb):
    needle = [x.cuda() for x in make_inputs([200], **QWEN35, seed=41, v_dtype=torch.bfloat16)]
    alone = G.gdn_cpr_varlen(*needle)
    gen = torch.Generator().manual_seed(42)
    for trial in range(3):
        n = int(torch.randint(2, 9, (1,), generator=gen))
        lens = torch.randint(0, 700, (n,), generator=gen).tolist()
        at = int(torch.randint(0, n, (1,), generator=gen))
        lens[at] = 200
        batch = [x.cuda() for x in make_inputs(lens, **QWEN35, seed=43 + trial, v_dtype=torch.bfloat16)]
        s = int(batch[5][at])
        for i in range(5):
            batch[i][s:s + 200] = needle[i]
        kb.assert_bitwise(G.gdn_cpr_varlen(*batch)[s:s + 200], alone, f"needle in {lens}")


@pytest.mark.gpu
def test_cpr_cuda_decode_padded_lanes_inert(kb):
    _padded_decode_check(kb, G.gdn_cpr_decode, "cuda", 16)


@pytest.mark.gpu
def test_cpr_cuda_decode_graph_replay_equals_eager(kb):
    B, L = 8, 70
    inp = [x.cuda() for x in make_inputs([L] * B, **QWEN35, seed=44, v_dtype=torch.bfloat16)]
    slots = torch.arange(B, device="cuda")
    rows_at = lambda t: [x[torch.arange(B, device="cuda") * L + t] for x in inp[:5]]  # noqa: E731
    static = [r.clone() for r in rows_at(0)]
    warm = G.GDNState.allocate(B, 32, 128, 128, "cuda")
    G.gdn_cpr_decode(*static, slots, warm)  # compile the kernels before capture
    eager_state = G.GDNState.allocate(B, 32, 128, 128, "cuda")
    graph_state = G.GDNState.allocate(B, 32, 128, 128, "cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gdn_cpr_decode(*static, slots, graph_state)
    graph_state.reset_(slots)  # capture does not run the kernels, but be explicit
    for t in range(L):  # crosses the resync at t = 63
        rows = rows_at(t)
        for st_, r in zip(static, rows):
            st_.copy_(r)
        graph.replay()
        eager = G.gdn_cpr_decode(*rows, slots, eager_state)
        kb.assert_bitwise(out, eager, f"graph vs eager step {t}")
    kb.assert_bitwise(graph_state.boundary, eager_state.boundary, "boundary")
    assert float(eager_state.boundary.abs().sum()) > 0


@pytest.mark.gpu
def test_native_cuda_chunk_and_recurrent_match_recurrence(kb):
    lens = [300, 64, 129]
    inp = [x.cuda() for x in make_inputs(lens, **QWEN35, seed=45)]
    want = recurrence64(inp)
    assert kb.rel_l2(N.gdn_recurrent_varlen(*inp), want) < 1e-5
    assert kb.rel_l2(N.gdn_chunk_varlen(*inp), want) < 1e-2  # TF32 dots
    st = G.GDNState.allocate(3, 32, 128, 128, "cuda")
    o = run_engine(inp, lens, random_plan(lens, 5, max_decode=10), [2, 0, 1], st, N.gdn_chunk_engine,
                   N.gdn_recurrent_decode, G.CHUNK)
    assert kb.rel_l2(o, want) < 1e-2


@pytest.mark.gpu
def test_cpr_cuda_backward_matches_autograd_through_recurrence(kb):
    lens = [200, 77]
    inp = [x.cuda() for x in make_inputs(lens, **QWEN35, seed=46)]
    w = torch.randn(sum(lens), 32, 128, device="cuda")
    xs = [x.clone().requires_grad_() for x in inp[:5]]
    ref = [x.double().requires_grad_() for x in inp[:5]]
    (G.gdn_cpr_varlen(*xs, inp[5]) * w).sum().backward()
    (N.torch_recurrence(*ref, inp[5]) * w.double()).sum().backward()
    # the trainer's backward is the WY kernels' (CPR_BWD_KIND = "wy"): with fp32 values their dots
    # run TF32, the stock kernels' rounding, so the gradients sit about 1.8e-3 from float64
    # (measured on the H200 at c3a9c7c: 1.82e-3 to 1.85e-3 for q, k, v, g, beta); a wrong gradient
    # is off by O(1)
    for name, a, b in zip("q k v g beta".split(), xs, ref):
        assert kb.rel_l2(a.grad, b.grad) < 5e-3, name
