"""Gates for the GDN short convolution (isoexec_kernels/gdn_conv/): correctness against float64
F.conv1d, split/resume invariance of the engine window, decode == prefill, batch invariance,
the stock twin, and the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from isoexec_kernels import gdn_conv

W = 4


def _cu(lens):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return cu


def _f64(x, w, lens, history=None):
    """float64 silu(causal depthwise conv) per sequence (history: [B, D, W-1] inputs before it)."""
    outs, s = [], 0
    for b, n in enumerate(lens):
        seq = x[s:s + n].double().t()[None]
        pre = (torch.zeros(1, x.shape[1], W - 1, dtype=torch.float64) if history is None
               else history[b].double()[None])
        o = F.conv1d(torch.cat([pre, seq], -1), w.double()[:, None, :], groups=x.shape[1])
        outs.append(F.silu(o)[0].t())
        s += n
    return torch.cat(outs)


def _data(T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, D, generator=g) * 2).to(dtype), (torch.randn(D, W, generator=g) * 0.5).to(dtype), g


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_varlen_matches_float64_and_native(kb, dtype, tol):
    lens = [1, 5, 17, 2]
    x, w, _ = _data(sum(lens), 24, dtype, 1)
    want = _f64(x, w, lens)
    out = gdn_conv.causal_conv1d_varlen(x, w, _cu(lens))
    assert out.dtype == dtype and kb.rel_l2(out, want) < tol
    assert kb.rel_l2(gdn_conv.conv1d_native_varlen(x, w, _cu(lens)), want) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_split_anywhere_equals_trainer_bitwise(kb, dtype):
    lens = [13, 1, 30]
    x, w, g = _data(sum(lens), 20, dtype, 2)
    cu = _cu(lens)
    want = gdn_conv.causal_conv1d_varlen(x, w, cu)
    slots = torch.tensor([3, 0, 1])
    for _ in range(4):
        state = torch.zeros(5, 20, W - 1, dtype=dtype)
        done = [0, 0, 0]
        got = [[], [], []]
        while any(d < n for d, n in zip(done, lens)):
            bs = [b for b in range(3) if done[b] < lens[b]]
            take = [int(torch.randint(1, lens[b] - done[b] + 1, (1,), generator=g)) for b in bs]
            xs = torch.cat([x[int(cu[b]) + done[b]:int(cu[b]) + done[b] + n] for b, n in zip(bs, take)])
            out = gdn_conv.causal_conv1d_engine(xs, w, _cu(take), slots[bs], state)
            for b, part in zip(bs, out.split(take)):
                got[b].append(part)
                done[b] += part.shape[0]
        kb.assert_bitwise(torch.cat([torch.cat(p) for p in got]), want, "engine pieces vs trainer")


def test_decode_equals_prefill_bitwise_and_window_holds_last_inputs(kb):
    x, w, _ = _data(12, 16, torch.float32, 3)
    state = torch.zeros(2, 16, W - 1)
    pre = gdn_conv.causal_conv1d_engine(x[:7], w, _cu([7]), torch.tensor([1]), state)
    assert torch.equal(state[1], x[4:7].t()) and not state[0].any()
    dec = [gdn_conv.causal_conv1d_decode(x[t:t + 1], w, torch.tensor([1]), state) for t in range(7, 12)]
    want = gdn_conv.causal_conv1d_varlen(x, w, _cu([12]))
    kb.assert_bitwise(torch.cat([pre] + dec), want, "prefill + decode vs trainer")
    assert torch.equal(state[1], x[9:12].t())


def test_engine_continues_from_window_like_float64(kb):
    lens = [3, 6]
    x, w, g = _data(9, 8, torch.float32, 4)
    hist = torch.randn(2, 8, W - 1, generator=g)
    state = hist.clone()
    out = gdn_conv.causal_conv1d_engine(x, w, _cu(lens), torch.tensor([0, 1]), state)
    assert kb.rel_l2(out, _f64(x, w, lens, hist)) < 1e-6
    st2 = hist.clone()
    nat = gdn_conv.conv1d_native_engine(x, w, _cu(lens), torch.tensor([0, 1]), st2)
    assert kb.rel_l2(nat, out) < 1e-6 and torch.equal(st2, state)
    # a 3-token piece keeps 3 = W-1 inputs; a shorter one keeps part of the old window
    st3 = hist.clone()
    gdn_conv.causal_conv1d_engine(x[:1], w, _cu([1]), torch.tensor([0]), st3)
    assert torch.equal(st3[0], torch.cat([hist[0, :, 1:], x[:1].t()], -1))


def test_row_in_batch_equals_row_alone_bitwise(kb):
    x, w, g = _data(9, 33, torch.bfloat16, 5)
    alone = gdn_conv.causal_conv1d_varlen(x, w, _cu([9]))
    for m in (1, 3, 17):
        others = [int(torch.randint(1, 40, (1,), generator=g)) for _ in range(m)]
        pos = int(torch.randint(0, m + 1, (1,), generator=g))
        lens = others[:pos] + [9] + others[pos:]
        parts = [torch.randn(n, 33, generator=g).to(torch.bfloat16) for n in lens]
        parts[pos] = x
        out = gdn_conv.causal_conv1d_varlen(torch.cat(parts), w, _cu(lens))
        s = sum(lens[:pos])
        kb.assert_bitwise(out[s:s + 9], alone, f"needle at {pos} of {m + 1}")


def test_backward_matches_float64():
    lens = [6, 11]
    x, w, _ = _data(17, 12, torch.float32, 6)
    dy = torch.randn(17, 12, generator=torch.Generator().manual_seed(7))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    gdn_conv.causal_conv1d_varlen(xg, wg, _cu(lens)).backward(dy)
    x6, w6 = x.double().requires_grad_(), w.double().requires_grad_()
    _f64(x6, w6, lens).backward(dy.double())
    assert ((xg.grad - x6.grad).norm() / x6.grad.norm()) < 1e-6
    assert ((wg.grad - w6.grad).norm() / w6.grad.norm()) < 1e-6


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="weight \\[D, W\\]"):
        gdn_conv.causal_conv1d_varlen(torch.randn(3, 4), torch.randn(5, 4), _cu([3]))
    with pytest.raises(ValueError, match="conv_state must be"):
        gdn_conv.causal_conv1d_engine(torch.randn(3, 4), torch.randn(4, 4), _cu([3]), torch.tensor([0]),
                                      torch.zeros(2, 4, 4))


# --------------------------------------------------------------------------- Triton (interpreter)


def interp_case_conv_triton_matches_reference_and_splits(kb):
    lens = [5, 1, 9]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(15, 40, generator=g)
    w = torch.randn(40, W, generator=g) * 0.5
    ref = gdn_conv.causal_conv1d_reference(x, w, _cu(lens))
    tri = gdn_conv.causal_conv1d_triton(x, w, _cu(lens))
    assert kb.rel_l2(tri, ref) < 1e-6
    state = torch.randn(3, 40, W - 1, generator=g)
    slots = torch.tensor([2, 0, 1])
    a = gdn_conv.causal_conv1d_triton(x, w, _cu(lens), slots, state)
    b = gdn_conv.causal_conv1d_reference(x, w, _cu(lens), slots, state)
    assert kb.rel_l2(a, b) < 1e-6
    # split invariance of the Triton path on its own
    whole = gdn_conv.causal_conv1d_triton(x[:9], w, _cu([9]))
    st = torch.zeros(1, 40, W - 1)
    p1 = gdn_conv.causal_conv1d_triton(x[:4], w, _cu([4]), torch.tensor([0]), st)
    gdn_conv.update_conv_state(x[:4], _cu([4]), torch.tensor([0]), st)
    p2 = gdn_conv.causal_conv1d_triton(x[4:9], w, _cu([5]), torch.tensor([0]), st)
    kb.assert_bitwise(torch.cat([p1, p2]), whole, "triton split")


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_gdn_conv_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gdn_conv", case)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_conv_cuda_split_decode_and_batch_invariance_bitwise(kb):
    lens = [100, 1, 257]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(sum(lens), 8192, generator=g).bfloat16().cuda()
    w = (torch.randn(8192, W, generator=g) * 0.5).bfloat16().cuda()
    cu = _cu(lens).cuda()
    want = gdn_conv.causal_conv1d_varlen(x, w, cu)
    assert kb.rel_l2(want, _f64(x.cpu(), w.cpu(), lens)) < 1e-2
    state = torch.zeros(4, 8192, W - 1, dtype=torch.bfloat16, device="cuda")
    s = int(cu[2])
    a = gdn_conv.causal_conv1d_engine(x[s:s + 70], w, _cu([70]).cuda(), torch.tensor([3]).cuda(), state)
    b = gdn_conv.causal_conv1d_engine(x[s + 70:s + 200], w, _cu([130]).cuda(), torch.tensor([3]).cuda(), state)
    d = [gdn_conv.causal_conv1d_decode(x[t:t + 1], w, torch.tensor([3]).cuda(), state) for t in range(s + 200, s + 257)]
    kb.assert_bitwise(torch.cat([a, b] + d), want[s:], "cuda prefill split + decode vs trainer")
    alone = gdn_conv.causal_conv1d_varlen(x[s:], w, _cu([257]).cuda())
    kb.assert_bitwise(alone, want[s:], "cuda alone vs in batch")
