"""The stock attention twins (kernels/attention_native.py) compute attention correctly: the trainer's
FlashAttention-2 varlen path on a GPU against float64, gradients included, and its agreement with
the padded-SDPA path it replaces there."""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import attention_native as nat


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


@pytest.mark.gpu
def test_native_varlen_flash_matches_float64_and_the_padded_path_with_gradients(kb):
    g = torch.Generator().manual_seed(3)
    lens, hq, hkv, d = [1, 63, 200, 333], 16, 8, 128
    T, scale = sum(lens), d ** -0.5
    q, k, v = (torch.randn(T, h, d, generator=g).bfloat16().cuda() for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    assert nat._flash_varlen_usable(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = nat.attention_native_varlen(*leaves, cu, max(lens), scale)
    want = _f64_varlen(q, k, v, lens, scale)
    assert kb.rel_l2(out, want) < kb.TOL[torch.bfloat16]
    padded = nat.attention_native_varlen(q.float(), k.float(), v.float(), cu, max(lens), scale)  # fp32: padded SDPA
    assert kb.rel_l2(padded, want) < 1e-4
    dy = torch.randn(T, hq, d, generator=g).bfloat16().cuda()
    out.backward(dy)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    _f64_varlen(*ref, lens, scale).backward(dy.double())
    for got, r in zip(leaves, ref):
        assert kb.rel_l2(got.grad, r.grad) < 2 * kb.TOL[torch.bfloat16]
