"""The flex_attention paged decode (isoexec_kernels/attention/flex_paged.py) computes the native
paged decode: eagerly on CPU against the page-gather path and a float64 loop; its BlockMask (block
lists + page mask, what the compiled kernel reads) against the exact dense mask on scattered
pages; its compiled path (one compile per power-of-two batch, none per step) on CPU; and on a GPU,
compiled and replayed from a CUDA graph."""

from __future__ import annotations

import shutil

import pytest
import torch

from isoexec_kernels.attention import flex_paged as fp
from isoexec_kernels.attention import native as nat

PAGE = 16
# context lengths: one key, one page exactly, one past a page boundary, mid-page, two pages
# exactly, the whole block-table width (W pages)
W = 5
CTX = [1, PAGE, PAGE + 1, 37, 2 * PAGE, W * PAGE]


def _paged(g, ctx, hq, hkv, d, dv=None, dtype=torch.float32, device="cpu", pages=None):
    """A cache of 3x more pages than the batch holds (or ``pages``), tables drawn from a random permutation
    (scattered, never in order), and every table entry past a sequence's context set to some other
    sequence's page, so that a mask which ignores context_lens reads real (wrong) keys."""
    b = len(ctx)
    p = pages or 3 * b * W
    kc = torch.randn(p, PAGE, hkv, d, generator=g, dtype=dtype)
    vc = torch.randn(p, PAGE, hkv, dv or d, generator=g, dtype=dtype)
    bt = torch.randperm(p, generator=g)[:b * W].view(b, W).int()
    for i, n in enumerate(ctx):
        used = -(-n // PAGE)
        bt[i, used:] = bt[(i + 1) % b, :W - used]
    q = torch.randn(b, hq, d, generator=g, dtype=dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    return [t.to(device) for t in (q, kc, vc, bt, lens)]


def _f64_decode(q, kc, vc, bt, lens, scale):
    out = []
    g = q.shape[1] // kc.shape[2]
    for b, n in enumerate(lens.tolist()):
        k = kc[bt[b].long()].flatten(0, 1)[:n].double().repeat_interleave(g, 1)   # [n, Hq, D]
        v = vc[bt[b].long()].flatten(0, 1)[:n].double().repeat_interleave(g, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


def _dense_mask_by_loop(bt, lens, num_pages):
    mask = torch.zeros(bt.shape[0], num_pages * PAGE, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        for j in range(n):
            mask[b, int(bt[b, j // PAGE]) * PAGE + j % PAGE] = True
    return mask


def _what_the_kernel_reads(bm, num_pages):
    """[B, N] bool from a BlockMask as flex's compiled kernel uses it: the listed full blocks whole,
    the listed partial blocks where mask_mod holds, nothing else."""
    b = bm.kv_num_blocks.shape[0]
    out = torch.zeros(b, num_pages * PAGE, dtype=torch.bool)
    zero = torch.zeros((), dtype=torch.long)
    for i in range(b):
        if bm.full_kv_num_blocks is not None:
            for p in bm.full_kv_indices[i, 0, 0, :int(bm.full_kv_num_blocks[i, 0, 0])].tolist():
                out[i, p * PAGE:(p + 1) * PAGE] = True
        for p in bm.kv_indices[i, 0, 0, :int(bm.kv_num_blocks[i, 0, 0])].tolist():
            for n in range(p * PAGE, (p + 1) * PAGE):
                out[i, n] = bool(bm.mask_mod(torch.tensor(i), zero, zero, torch.tensor(n)))
    return out


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 2), (2, 2)])
def test_eager_flex_paged_decode_equals_the_native_paged_decode(hq, hkv):
    g = torch.Generator().manual_seed(11)
    d = 16
    q, kc, vc, bt, lens = _paged(g, CTX, hq, hkv, d)
    scale = d ** -0.5
    got = fp.attention_flex_paged_decode(q, kc, vc, bt, lens, scale)
    assert got.shape == (len(CTX), hq, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, nat.attention_native_paged_decode(q, kc, vc, bt, lens, scale),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.double(), _f64_decode(q, kc, vc, bt, lens, scale), rtol=1e-5, atol=1e-6)


def test_eager_flex_paged_decode_with_a_value_head_unlike_the_query_head():
    g = torch.Generator().manual_seed(12)
    q, kc, vc, bt, lens = _paged(g, CTX, 4, 2, 32, dv=16)
    got = fp.attention_flex_paged_decode(q, kc, vc, bt, lens, 32 ** -0.5)
    assert got.shape == (len(CTX), 4, 16)
    torch.testing.assert_close(got.double(), _f64_decode(q, kc, vc, bt, lens, 32 ** -0.5), rtol=1e-5, atol=1e-6)


def test_the_dense_mask_is_each_sequence_s_context_on_its_scattered_pages():
    g = torch.Generator().manual_seed(13)
    _, kc, _, bt, lens = _paged(g, CTX, 2, 1, 16)
    dense = fp.flex_paged_dense_mask(bt, lens, PAGE, kc.shape[0])
    assert torch.equal(dense, _dense_mask_by_loop(bt, lens, kc.shape[0]))
    assert dense.sum(1).tolist() == CTX


def test_the_block_lists_with_the_page_mask_are_the_dense_mask():
    """What the compiled kernel reads (block lists + page mask) is exactly each sequence's context,
    though the page mask alone is not (it admits every unlisted page: why eager flex, which ignores
    the lists, takes the dense mask)."""
    g = torch.Generator().manual_seed(14)
    _, kc, _, bt, lens = _paged(g, CTX, 2, 1, 16)
    p = kc.shape[0]
    bm = fp.flex_paged_block_mask(bt, lens, PAGE, p)
    assert bm.shape[-2:] == (1, p * PAGE)
    want = _dense_mask_by_loop(bt, lens, p)
    assert torch.equal(_what_the_kernel_reads(bm, p), want)
    assert bm.full_kv_num_blocks is None
    assert bm.kv_num_blocks.flatten().tolist() == [-(-n // PAGE) for n in CTX]
    page_mask_alone = torch.tensor([[bool(bm.mask_mod(torch.tensor(b), 0, 0, torch.tensor(n))) for n in range(p * PAGE)]
                                    for b in range(len(CTX))])
    assert (page_mask_alone & ~want).any()


def test_padded_lanes_read_one_key_of_page_zero():
    bt = torch.tensor([[7, 3], [0, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 1], dtype=torch.int32)
    got = _what_the_kernel_reads(fp.flex_paged_block_mask(bt, lens, PAGE, 8), 8)
    assert got[1].nonzero().flatten().tolist() == [0]
    assert got[0].nonzero().flatten().tolist() == list(range(3 * PAGE, 3 * PAGE + 4)) + list(range(7 * PAGE, 8 * PAGE))


def test_the_compiled_path_compiles_once_per_power_of_two_batch_and_never_per_step():
    """Dynamo's part of the CUDA path, traced on CPU (a counting backend; values are not checked:
    only the inductor kernel honours the block lists): new block tables and context lengths reuse
    the compiled graph, batches 5..8 share the padded batch 8, batch 3 compiles batch 4."""
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):   # records the batch of the graph's query [B, Hq, 1, D]
        graphs.append(next(t.shape[0] for t in example_inputs
                           if isinstance(t, torch.Tensor) and t.dim() == 4 and tuple(t.shape[1:]) == (4, 1, 16)))
        return gm.forward

    g = torch.Generator().manual_seed(15)
    q, kc, vc, bt, lens = _paged(g, CTX[:5], 4, 2, 16)
    for n in (5, 5, 8, 6, 7):
        perm = torch.randperm(kc.shape[0], generator=g)[:n * W].view(n, W).int()
        ctx = torch.randint(1, W * PAGE + 1, (n,), generator=g, dtype=torch.int32)
        qn = torch.randn(n, 4, 16, generator=g)
        out = fp.flex_paged_decode_compiled(qn, kc, vc, perm, ctx, 0.25, backend=counting)
        assert out.shape == (n, 4, 16)
    assert graphs == [8]
    fp.flex_paged_decode_compiled(q[:3], kc, vc, bt[:3], lens[:3], 0.25, backend=counting)
    assert graphs == [8, 4]
    assert [fp.padded_batch(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor's CPU kernels need a C++ compiler")
def test_inductor_compiled_flex_on_cpu_reads_only_the_listed_pages():
    """The block-list path end to end through a real flex kernel (inductor's CPU template, about a
    minute to compile here): equals the native paged decode; a second step with other tables and
    lengths, a batch in the same power-of-two bucket, compiles nothing."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(16)
    q, kc, vc, bt, lens = _paged(g, CTX, 4, 2, 16)
    scale = 0.25
    got = fp.flex_paged_decode_compiled(q, kc, vc, bt, lens, scale)
    torch.testing.assert_close(got, nat.attention_native_paged_decode(q, kc, vc, bt, lens, scale), rtol=1e-5,
                               atol=1e-6)
    q2, _, _, bt2, lens2 = _paged(g, [3, 80, 50, 16, 17, 64, 9], 4, 2, 16, pages=kc.shape[0])
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = fp.flex_paged_decode_compiled(q2, kc, vc, bt2, lens2, scale)
    torch.testing.assert_close(got, nat.attention_native_paged_decode(q2, kc, vc, bt2, lens2, scale), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.gpu
def test_compiled_flex_paged_decode_on_cuda_equals_the_gather_path_and_replays_from_a_graph(kb):
    g = torch.Generator().manual_seed(17)
    hq, hkv, d = 16, 8, 128
    ctx = CTX + [W * PAGE - 1, 2]            # 8 sequences: the padded batch is the batch
    q, kc, vc, bt, lens = _paged(g, ctx, hq, hkv, d, dtype=torch.bfloat16, device="cuda")
    scale = d ** -0.5

    def want(q, bt, lens):
        return nat.attention_native_paged_decode(q.float(), kc.float(), vc.float(), bt, lens, scale)

    got = fp.flex_paged_decode_compiled(q, kc, vc, bt, lens, scale)
    assert got.dtype == torch.bfloat16 and kb.rel_l2(got, want(q, bt, lens)) < kb.TOL[torch.bfloat16]
    # a batch of 5 runs padded to 8
    got5 = fp.flex_paged_decode_compiled(q[:5], kc, vc, bt[:5], lens[:5], scale)
    assert kb.rel_l2(got5, want(q[:5], bt[:5], lens[:5])) < kb.TOL[torch.bfloat16]
    # captured once, replayed after the step's tables and lengths changed in place: no host sync in
    # the capture, no recompile
    sq, sbt, slens = q.clone(), bt.clone(), lens.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch._dynamo.config.patch(error_on_recompile=True):
        with torch.cuda.graph(graph):
            out = fp.flex_paged_decode_compiled(sq, kc, vc, sbt, slens, scale)
    q2, _, _, bt2, lens2 = _paged(g, [80, 1, 33, 16, 17, 64, 9, 48], hq, hkv, d, dtype=torch.bfloat16, device="cuda",
                                  pages=kc.shape[0])
    sq.copy_(q2)
    sbt.copy_(bt2)
    slens.copy_(lens2)
    graph.replay()
    torch.cuda.synchronize()
    kb.assert_bitwise(out, fp.flex_paged_decode_compiled(q2, kc, vc, bt2, lens2, scale),
                      "graph replay vs eager call of the compiled flex decode")
    assert kb.rel_l2(out, want(q2, bt2, lens2)) < kb.TOL[torch.bfloat16]
