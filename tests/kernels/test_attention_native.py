"""The stock attention twins (isoexec_kernels/attention/native.py) compute attention correctly: the trainer's
FlashAttention-2 varlen path on a GPU against float64, gradients included, and its agreement with
the padded-SDPA path it replaces there."""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels.attention import native as nat


def _f64_varlen(q, k, v, lens, scale):
    out, at = [], 0
    g = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (t[at:at + n].double().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        s = qs @ ks.transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out.append((s.softmax(-1) @ vs).transpose(0, 1))
        at += n
    return torch.cat(out)


# (query/key head dim, value head dim): equal as in GQA models; MLA's value head is narrower than its
# query/key head (rope + no-rope parts), which flash takes only after zero-padding
HEAD_DIMS = [(128, 128), (192, 128), (64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", HEAD_DIMS)
def test_native_varlen_flash_matches_float64_and_the_padded_path_with_gradients(kb, d, dv):
    g = torch.Generator().manual_seed(3)
    lens, hq, hkv = [1, 63, 200, 333], 16, 8
    T, scale = sum(lens), d ** -0.5
    q, k, v = (torch.randn(T, h, w, generator=g).bfloat16().cuda() for h, w in ((hq, d), (hkv, d), (hkv, dv)))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    assert nat._flash_varlen_usable(q, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = nat.attention_native_varlen(*leaves, cu, max(lens), scale)
    want = _f64_varlen(q, k, v, lens, scale)
    assert kb.rel_l2(out, want) < kb.TOL[torch.bfloat16]
    padded = nat.attention_native_varlen(q.float(), k.float(), v.float(), cu, max(lens), scale)  # fp32: padded SDPA
    assert kb.rel_l2(padded, want) < 1e-4
    assert out.shape == (T, hq, dv)
    dy = torch.randn(T, hq, dv, generator=g).bfloat16().cuda()
    out.backward(dy)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    _f64_varlen(*ref, lens, scale).backward(dy.double())
    for got, r in zip(leaves, ref):
        assert kb.rel_l2(got.grad, r.grad) < 2 * kb.TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", HEAD_DIMS)
def test_native_paged_flash_prefill_and_decode_match_the_padded_sdpa_path(kb, d, dv):
    """The engine's stock paged path (page gather + FlashAttention-2 varlen with used-key counts)
    computes the same function as the masked padded SDPA it replaced: chunks that start mid-
    sequence (bottom-right causal alignment) and single-token decode rows, at bf16 tolerance."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, page, scale = 16, 8, 16, d ** -0.5
    ctx, q_lens = [5, 70, 300, 17], [5, 13, 1, 17]
    pages_per = 20
    kc = torch.randn(len(ctx) * pages_per, page, hkv, d, generator=g).bfloat16().cuda()
    vc = torch.randn(len(ctx) * pages_per, page, hkv, dv, generator=g).bfloat16().cuda()
    bt = torch.randperm(len(ctx) * pages_per, generator=g).view(len(ctx), pages_per).int().cuda()
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, generator=g).bfloat16().cuda()
    flash = nat.attention_native_paged_prefill(q, kc, vc, bt, cu, lens, scale, max(q_lens))
    padded = nat.attention_native_paged_prefill(q.float(), kc.float(), vc.float(), bt, cu, lens, scale,
                                                max(q_lens))  # fp32: the padded SDPA path
    assert flash.shape == (sum(q_lens), hq, dv)
    assert kb.rel_l2(flash, padded) < kb.TOL[torch.bfloat16]
    qd = torch.randn(len(ctx), hq, d, generator=g).bfloat16().cuda()
    dec = nat.attention_native_paged_decode(qd, kc, vc, bt, lens, scale)
    dec_ref = nat.attention_native_paged_decode(qd.float(), kc.float(), vc.float(), bt, lens, scale)
    assert kb.rel_l2(dec, dec_ref) < kb.TOL[torch.bfloat16]


@pytest.mark.parametrize("d,dv", HEAD_DIMS)
def test_zero_padding_to_one_head_dim_keeps_the_attention_function(d, dv):
    """What the flash paths do for MLA, checked on CPU: attention over the zero-padded q/k/v, cut
    back to the value width, equals attention over the original tensors (float64)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 9, w, generator=g, dtype=torch.float64) for w in (d, d, dv))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5)
    qp, kp, vp, width = nat._same_head_dim(q, k, v)
    assert qp.shape[-1] == kp.shape[-1] == vp.shape[-1] == max(d, dv) and width == dv
    got = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=d ** -0.5)
    torch.testing.assert_close(got[..., :width], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d,dv", HEAD_DIMS)
def test_padded_paged_prefill_of_whole_sequences_equals_varlen_on_cpu(d, dv):
    """The padded-SDPA paged path (CPU, fp32) with a value head unlike the query's: a prefill of
    whole sequences from the page cache is the varlen attention of the same rows."""
    g = torch.Generator().manual_seed(9)
    hq, hkv, page, lens = 4, 2, 4, [3, 9, 1]
    T, scale = sum(lens), d ** -0.5
    q, k, v = (torch.randn(T, h, w, generator=g) for h, w in ((hq, d), (hkv, d), (hkv, dv)))
    pages_per = 3
    kc, vc = torch.zeros(len(lens) * pages_per, page, hkv, d), torch.zeros(len(lens) * pages_per, page, hkv, dv)
    bt = torch.randperm(len(lens) * pages_per, generator=g).view(len(lens), pages_per).int()
    at = 0
    for b, n in enumerate(lens):
        for j in range(n):
            kc[bt[b, j // page], j % page], vc[bt[b, j // page], j % page] = k[at + j], v[at + j]
        at += n
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    paged = nat.attention_native_paged_prefill(q, kc, vc, bt, cu, torch.tensor(lens, dtype=torch.int32), scale,
                                               max(lens))
    assert paged.shape == (T, hq, dv)
    torch.testing.assert_close(paged, nat.attention_native_varlen(q, k, v, cu, max(lens), scale))
