"""MLA attention in the expanded form (isoexec_kernels/mla): the zero padding to the attention width
cannot move a real element's bits, the trainer, prefill and decode cases agree bit for bit, and the
result is MLA attention (float64 yardstick)."""

import pytest
import torch

from isoexec_kernels.attention import compute_slot_mapping
from isoexec_kernels.attention.reference import varlen_attention_reference
from isoexec_kernels.mla import (expand_qkv, mla_attention_float64, mla_native_varlen, mla_paged_decode_attention,
                                 mla_paged_prefill_attention, mla_varlen_attention, mla_width, write_mla_kv_pages)


def _bits(t):
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _differing(a, b) -> int:
    return int((_bits(a) != _bits(b)).sum())


def _qkv(lens, h, dqk, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k, v = (torch.randn((n, h, d), generator=g).to(dtype) for d in (dqk, dqk, dv))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu


def test_width_is_the_next_power_of_two_of_the_widest_head():
    assert mla_width(192 + 64, 256) == 256      # GLM-4.7-Flash: no padding
    assert mla_width(128 + 64, 128) == 256      # DeepSeek-V3: q/k 192 and v 128 padded
    assert mla_width(8 + 8, 8) == 16 and mla_width(4, 4) == 16


def test_zero_padding_of_q_k_v_leaves_every_real_element_s_bits():
    """q/k/v of width 24 padded with +0 to 32 give the bits of the unpadded fixed-order schedule
    (the reference pads its dot-product tree with -0 itself; a +0 can only turn a -0 score into +0)."""
    q, k, v, cu = _qkv([37, 70, 5], 3, 24, 24)
    scale = 24 ** -0.5
    padded = mla_varlen_attention(q, k, v, cu, 70, scale)
    unpadded, _ = varlen_attention_reference(q, k, v, cu, scale)
    assert padded.shape == unpadded.shape and _differing(padded, unpadded) == 0


def test_an_output_column_reads_only_its_own_value_column():
    """The padded value columns cannot reach the real ones: v of width 8 padded with zeros and the
    same v padded with random values give the same first 8 output columns, bit for bit."""
    q, k, v, cu = _qkv([50, 9], 2, 16, 8, seed=1)
    junk = torch.cat([v, torch.randn(v.shape[0], 2, 8, generator=torch.Generator().manual_seed(5))], -1)
    a = mla_varlen_attention(q, k, v, cu, 50, 0.25)
    b = mla_varlen_attention(q, k, junk, cu, 50, 0.25)[..., :8]
    assert a.shape[-1] == 8 and _differing(a, b) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainer_rows_equal_paged_prefill_and_decode_rows(dtype):
    """Varlen (trainer) == chunked paged prefill over shuffled W-wide pages == one-token decode."""
    lens, h, dqk, dv, page = [70, 21, 3], 2, 16, 8, 16
    q, k, v, cu = _qkv(lens, h, dqk, dv, dtype, seed=2)
    w, scale = mla_width(dqk, dv), dqk ** -0.5
    trainer = mla_varlen_attention(q, k, v, cu, max(lens), scale)
    pages = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(3)).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(perm[at:at + n])
        at += n
    bt = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    kc = torch.zeros(sum(pages), page, h, w, dtype=dtype)
    vc = torch.zeros_like(kc)
    starts = [int(x) for x in cu[:-1]]
    out = [[] for _ in lens]
    done = [0] * len(lens)
    for chunk in (13, 40, 1000):     # prefill all but the last token in uneven chunks
        ql = [max(0, min(chunk, n - 1 - d)) for n, d in zip(lens, done)]
        cuq = torch.tensor([0] + torch.tensor(ql).cumsum(0).tolist(), dtype=torch.int32)
        ctx = torch.tensor([d + n for d, n in zip(done, ql)], dtype=torch.int32)
        rows = torch.cat([torch.arange(s + d, s + d + n) for s, d, n in zip(starts, done, ql)])
        write_mla_kv_pages(k[rows], v[rows], kc, vc, compute_slot_mapping(bt, cuq, ctx, page))
        o = mla_paged_prefill_attention(q[rows], kc, vc, bt, cuq, ctx, scale, v_dim=dv)
        at = 0
        for b, n in enumerate(ql):
            out[b].append(o[at:at + n])
            at += n
            done[b] += n
    rows = torch.tensor([s + n - 1 for s, n in zip(starts, lens)])
    ctx = torch.tensor(lens, dtype=torch.int32)
    cuq = torch.arange(len(lens) + 1, dtype=torch.int32)
    write_mla_kv_pages(k[rows], v[rows], kc, vc, compute_slot_mapping(bt, cuq, ctx, page))
    dec = mla_paged_decode_attention(q[rows], kc, vc, bt, ctx, scale, v_dim=dv)
    engine = torch.cat([torch.cat(out[b] + [dec[b:b + 1]]) for b in range(len(lens))])
    assert engine.shape == trainer.shape == (sum(lens), h, dv)
    assert _differing(engine, trainer) == 0


def test_expanded_attention_is_mla_attention():
    q, k, v, cu = _qkv([33, 12], 4, 24, 16, seed=4)
    ref = mla_attention_float64(q, k, v, cu, 24 ** -0.5)
    for fn in (mla_varlen_attention, mla_native_varlen):
        out = fn(q, k, v, cu, 33, 24 ** -0.5).double()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-6


def test_expand_puts_the_shared_rope_key_in_every_head_and_takes_v_from_kv_b():
    g = torch.Generator().manual_seed(6)
    T, H, nope, rd, dv = 5, 3, 4, 2, 6
    q_nope, q_rope = torch.randn(T, H, nope, generator=g), torch.randn(T, H, rd, generator=g)
    kv, k_rope = torch.randn(T, H, nope + dv, generator=g), torch.randn(T, 1, rd, generator=g)
    q, k, v = expand_qkv(q_nope, q_rope, kv, k_rope, nope, dv)
    assert torch.equal(q, torch.cat([q_nope, q_rope], -1))
    assert torch.equal(k[..., :nope], kv[..., :nope]) and torch.equal(v, kv[..., nope:])
    assert all(torch.equal(k[:, h, nope:], k_rope[:, 0]) for h in range(H))


def test_gradients_flow_to_q_k_v_and_match_float64():
    q, k, v, cu = _qkv([20, 7], 2, 16, 8, seed=7)
    q, k, v = (t.double().float().requires_grad_() for t in (q, k, v))
    out = mla_varlen_attention(q, k, v, cu, 20, 0.25)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    gq, gk, gv = torch.autograd.grad((out * w).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = mla_attention_float64(q64, k64, v64, cu, 0.25)
    rq, rk, rv = torch.autograd.grad((ref * w.double()).sum(), (q64, k64, v64))
    for got, want in ((gq, rq), (gk, rk), (gv, rv)):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
