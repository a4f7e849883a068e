"""isoexec_kernels/_triton_util.py: the helpers every Triton launcher shares."""

import pytest
import torch

from isoexec_kernels._triton_util import int32_segments


def test_int32_segments_start_on_16_byte_boundaries_whatever_the_lengths():
    # packed back to back, the views' offsets would move with the lengths (Triton specialises a
    # pointer on 16-byte alignment, so each new offset class compiled a new kernel variant)
    for lengths in ((1, 1, 3, 3, 3, 3), (5, 5, 2, 2, 2, 2), (0, 4, 7, 1, 0, 9), (8, 8, 4, 4, 4, 4)):
        segs = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)]
        segs[2] = range(len(segs[2]))          # any iterable of ints
        segs[3] = torch.tensor(segs[3] or [], dtype=torch.int64)
        views = int32_segments(segs, torch.device("cpu"))
        base = views[0].untyped_storage().data_ptr()
        assert len(views) == len(segs)
        for seg, view in zip(segs, views):
            assert view.dtype == torch.int32 and view.tolist() == [int(x) for x in seg]
            assert (view.data_ptr() - base) % 16 == 0, (lengths, view.data_ptr() - base)
            assert view.untyped_storage().data_ptr() == base   # one buffer: one host-to-device copy


def test_pdl_kwargs_only_inside_programmatic_launch_and_never_off_the_gpu():
    from isoexec_kernels import _triton_util as tu

    x = torch.zeros(4)
    assert tu.pdl_kwargs(x) == {}
    with tu.programmatic_launch():
        assert tu._PDL_ON
        assert tu.pdl_kwargs(x) == {}               # a CPU tensor (or the interpreter): ordinary launch
        with tu.programmatic_launch(False):
            assert not tu._PDL_ON
        assert tu._PDL_ON                           # the outer setting is back
    assert not tu._PDL_ON
    try:
        with tu.programmatic_launch():
            raise KeyError("inside")
    except KeyError:
        pass
    assert not tu._PDL_ON                           # restored on an error too


@pytest.mark.gpu
def test_kernels_under_programmatic_launch_give_the_bits_of_ordinary_launches():
    """Every kernel that takes ``GDC`` (GEMM pointer and TMA paths, attention prefill and decode,
    KV write, RMSNorm and its q/k pair, RoPE, SiLU-mul), launched with programmatic dependent
    launch back to back in one stream and inside a CUDA graph, against ordinary launches."""
    from isoexec_kernels._triton_util import pdl_kwargs, programmatic_launch
    from isoexec_kernels.activation import silu_and_mul
    from isoexec_kernels.attention import paged_decode_attention, paged_prefill_attention, write_kv_pages
    from isoexec_kernels.gemm import linear
    from isoexec_kernels.rmsnorm import rms_norm
    from isoexec_kernels.rope import apply_rope, rope_cache

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs a CUDA device of compute capability >= 9")
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    hq, hkv, d, page, b = 16, 8, 128, 16, 6
    lens = [1, 17, 64, 65, 200, 301]
    w_qkv = torch.randn(4096, 1024, device=dev, dtype=bf, generator=g) / 32
    w_o = torch.randn(1024, 2048, device=dev, dtype=bf, generator=g) / 45
    nw = torch.randn(1024, device=dev, dtype=bf, generator=g)
    qn, kn = (torch.randn(d, device=dev, dtype=bf, generator=g) for _ in range(2))
    pages = sum(-(-n // page) for n in lens) + 1
    bt = torch.zeros(b, max(-(-n // page) for n in lens), dtype=torch.int32, device=dev)
    nxt = 1
    for i, n in enumerate(lens):
        for j in range(-(-n // page)):
            bt[i, j] = nxt
            nxt += 1
    ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    t = int(cu[-1])
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])
    seq = torch.repeat_interleave(torch.arange(b, device=dev), torch.tensor(lens, device=dev))
    slots = bt[seq, pos // page].long() * page + pos % page
    cache = rope_cache(1024, d, 1e6, device=dev)
    x = torch.randn(t, 1024, device=dev, dtype=bf, generator=g)

    def step():
        kc = torch.zeros(pages, page, hkv, d, device=dev, dtype=bf)
        vc = torch.zeros_like(kc)
        h = rms_norm(x, nw)
        qkv = linear(h, w_qkv).view(t, hq + 2 * hkv, d)
        qk = rms_norm(qkv[:, :hq + hkv], qn, weight2=kn, heads1=hq)
        qk = apply_rope(qk.view(t, hq + hkv, d), pos, cache)
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, hq + hkv:]
        write_kv_pages(k.contiguous(), v.contiguous(), kc, vc, slots)
        pre = paged_prefill_attention(q.contiguous(), kc, vc, bt, cu, ctx, d ** -0.5, max_seqlen_q=max(lens))
        dec = paged_decode_attention(q[cu[1:].long() - 1].contiguous(), kc, vc, bt, ctx, d ** -0.5)
        o = linear(pre.reshape(t, hq * d), w_o, residual=x)
        big = linear(torch.cat([h] * 16), w_qkv)              # M >= 2048: the TMA path where there is one
        act = silu_and_mul(big[:, :2048], big[:, 2048:])
        return [kc, vc, pre, dec, o, big, act]

    ref = step()
    with programmatic_launch():
        assert pdl_kwargs(x) == {"GDC": True, "launch_pdl": True}
        eager = step()
        step()                                                 # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, a, e, c in zip(("k cache", "v cache", "prefill", "decode", "o_proj", "qkv M=2048", "silu"),
                             ref, eager, captured):
        assert torch.equal(a.view(torch.int16), e.view(torch.int16)), name
        assert torch.equal(a.view(torch.int16), c.view(torch.int16)), name
