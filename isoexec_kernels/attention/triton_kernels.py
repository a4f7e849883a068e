"""Triton kernel of the batch-invariant attention family (CUDA path; also runs under
``TRITON_INTERPRET=1`` on CPU tensors for fp32/fp16).

ONE kernel, ``_attention_fwd_kernel``, serves all three cases with the same constexprs:

* engine decode: one query per sequence, ``cu_seqlens_q = arange(B + 1)``;
* engine chunked prefill: the chunk's queries, keys from the paged cache;
* trainer varlen forward: the packed K/V tensor is addressed as a "paged cache" whose page of
  sequence b starts at token ``cu_seqlens[b]`` and is longer than any sequence
  (``block_table[b, 0] = cu_seqlens[b]``, ``page_size = 2**30``, page stride = token stride).

A program owns one tile of BLOCK_M rows of one (sequence, KV head). Rows are the flattened
(token, group head) pairs of that sequence's queries, token-major, so the GQA heads that share
a KV head share its K/V tiles. The program walks KV blocks j = 0, 1, ... of BLOCK_N keys at
ABSOLUTE positions of the sequence, applies the online-softmax update (fp32 m, l, acc), and
divides acc / l once at the end. Blocks wholly visible to every row of the tile take an
unmasked path; the rest take a masked path whose arithmetic on visible keys is identical
(masking only selects -inf, and rows for which the whole block is invisible keep their state
through a select, so no "x * 1 + 0" update touches them).

Why a row's bits do not depend on the tile it lands in (decode row vs prefill row vs a row of
another chunking):
1. Same compiled arithmetic. Every case launches this kernel with the same constexprs
   (GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, num_warps, num_stages); runtime integers differ, and
   Triton's integer specialisation (== 1, divisible by 16) changes only integer address code.
   ``enable_fp_fusion=False`` stops LLVM from contracting mul+add into FMA in one code path
   but not another (``qk * scale - m`` would otherwise fuse in the unmasked loop only).
2. Same tile shape for the dots: q.k^T is a [BLOCK_M, HEAD_DIM] x [HEAD_DIM, BLOCK_N] tl.dot
   and p.v a [BLOCK_M, BLOCK_N] x [BLOCK_N, HEAD_DIM] tl.dot in every case, so the same MMA
   instruction sequence (wgmma on Hopper for 16-bit inputs, FMA loops for fp32 with
   input_precision="ieee") computes every output element. We do NOT rely on "tl.dot gives the
   same per-element order whatever BLOCK_M is": BLOCK_M is fixed per head_dim (a decode tile
   is a full BLOCK_M tile with GROUP live rows), because different M can select different
   instructions (mma.sync vs wgmma) and different register layouts. What remains assumed is
   that an MMA computes each output element by the same datapath whatever its row within the
   tile (true of NVIDIA tensor cores and of FMA loops) and that the row reductions (tl.max,
   tl.sum over BLOCK_N) follow the same shuffle tree for every row of a layout (they do: the
   tree is a function of the layout only). The CUDA gates in tests/kernels/test_attention.py
   check this: on an H200 (torch 2.11, triton 3.6) needle-in-batch (up to 33 sequences),
   chunked == one-shot prefill (page sizes 1..256), decode rows == prefill rows and varlen ==
   paged prefill gave 0 differing elements for bf16, fp16 and fp32 at head_dim 16, 64, 128,
   256 with GQA ratios 1, 2, 3, 4, and at contexts of up to 5000 tokens.
3. No split-KV: the blocks are combined in increasing j within one program.

Rounding of p: ``p`` (fp32) is rounded to the input dtype before the p.v dot (as in
FlashAttention); ``l`` sums the fp32 ``p``. exp2 is ``tl.math.exp2`` (``ex2.approx`` on NVIDIA:
deterministic, not bit-equal to the CPU twin). Bits are NOT expected to match the CPU reference;
the schedule (blocks, update order, where rounding to the input dtype happens) is the same.

Tile table (``tile_config``): a function of head_dim only, the same for every case and batch.
At head_dim 128 it is 64 x 64 tiles on one warpgroup (4 warps, 2 stages), picked on an H200 by
``scripts/attention_tile_sweep.py``, which checks every candidate for invariance (decode row ==
prefill row, chunked == one-shot, varlen == paged: 0 differing elements for each) and times it
against SDPA flash: prefill 0.72-0.77x (8 x 2048, 32 x 512, 8 x 512 tokens, 16/8 heads), decode
1.09-1.31x under CUDA graphs (64 and 256 sequences of 2048, 64 of 384). Decode runs a full
BLOCK_M tile with GROUP live rows (the price of not relying on BLOCK_M-independence), which is
why the smaller tile decodes twice as fast as the earlier 128-row one.

K/V loads (``KV_TMA``): the trainer's varlen forward with 16-bit K/V reads each sequence's
packed K/V through two tensor descriptors bounded to its ctx rows (TMA: one asynchronous copy
per block, rows past the end zero-filled); paged prefill and decode gather rows through the
block table with pointer loads (masked rows read as 0). The loaded blocks hold the same values
either way and the dots are the same instructions, so the bits agree (GPU gates: varlen ==
paged prefill, TMA == pointer loads). On the H200 the descriptors took the varlen prefill from
0.72-0.77x to 1.01-1.18x SDPA flash at the pinned tile (sweep at e42d366; the same sweep found
128-row prefill tiles bit-equal to the pinned 64-row decode tile but no faster).

The backward (``varlen_attention_backward_triton``) is a FlashAttention-2 style pair of kernels
(dK/dV per KV block, dQ per query tile); it is correct at tolerance and not on the invariant
path. fwd+bwd measured 0.55x (head_dim 128) and 0.75x (head_dim 64) of SDPA flash, 0.66x in
``bench train``'s region row at 5a3f900 (the forward alone 1.02-1.29x). Its loop loads go through
tensor descriptors too where ``_bwd_tma`` allows (16-bit, TMA, aligned; the dK/dV kernel's
[tokens, GROUP heads, head_dim] box of Q and dO needs GROUP a power of two): the dQ kernel's
K/V blocks as in the forward, the dK/dV kernel's Q/dO row tiles. The gradient bits do not move
(interpreter and GPU tests: TMA == pointer loads). Not yet timed on the H200; the prediction is
that the dQ kernel gains as the forward did and fwd+bwd moves from 0.66x to about 0.8x.

Residual hazard (documented, not gated): an MMA adds ``0 * v`` for keys inside the loaded block
but invisible to the row; if every visible contribution of an output element is exactly -0.0 and
an invisible v is negative, the sign of that zero can differ between cases.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_util import ensure_allocator, tma_supported

VARLEN_PAGE_SIZE = 1 << 30  # "page" length used to address packed varlen K/V as one page


@triton.jit
def _rows_descriptor(base, rows, row_stride, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """TMA descriptor of ``rows`` rows of HEAD_DIM contiguous values starting at ``base``, read in
    [BLOCK_N, HEAD_DIM] blocks; rows past ``rows`` read as zero."""
    return tl.make_tensor_descriptor(base, shape=[rows, HEAD_DIM], strides=[row_stride, 1],
                                     block_shape=[BLOCK_N, HEAD_DIM])


@triton.jit
def _attend_block(acc, l_i, m_i, q, j, lim, seq, kvh, ctx, K, V, BlockTable, stride_bt,
                  page_size, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                  qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, KV_TMA: tl.constexpr):
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    if KV_TMA:
        # K and V are this sequence's tensor descriptors: rows past ctx are zero-filled, the
        # values the pointer path's masked load gives them (other=0.0)
        k_t = tl.trans(K.load([j * BLOCK_N, 0]))
        v = V.load([j * BLOCK_N, 0])
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        if MASKED:
            in_ctx = offs_n < ctx
            page = tl.load(BlockTable + seq * stride_bt + offs_n // page_size, mask=in_ctx, other=0)
        else:
            page = tl.load(BlockTable + seq * stride_bt + offs_n // page_size)
        page = page.to(tl.int64)
        slot = (offs_n % page_size).to(tl.int64)
        k_row = page * stride_kp + slot * stride_ks + kvh * stride_kh
        v_row = page * stride_vp + slot * stride_vs + kvh * stride_vh
        if MASKED:
            k_t = tl.load(K + k_row[None, :] + offs_d[:, None], mask=in_ctx[None, :], other=0.0)
            v = tl.load(V + v_row[:, None] + offs_d[None, :], mask=in_ctx[:, None], other=0.0)
        else:
            k_t = tl.load(K + k_row[None, :] + offs_d[:, None])
            v = tl.load(V + v_row[:, None] + offs_d[None, :])
    # The mask is applied to the raw dot and the scale after the row max (max(x) * c equals
    # max(x * c) for c > 0: rounding is monotone), so both paths run the very same
    # "s * qk_scale - m" expression and FMA contraction, when enabled, fuses it in both alike.
    s = tl.dot(q, k_t, input_precision="ieee")
    if MASKED:
        s = tl.where(offs_n[None, :] <= lim[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    acc_new = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    if MASKED:
        active = j * BLOCK_N <= lim  # rows with at least one visible key in this block
        acc_new = tl.where(active[:, None], acc_new, acc)
        l_new = tl.where(active, l_new, l_i)
        m_new = tl.where(active, m_new, m_i)
    return acc_new, l_new, m_new


@triton.jit
def _attention_fwd_kernel(
    Q, K, V, Out, Lse, BlockTable, CuSeqlensQ, ContextLens,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_bt,
    page_size, qk_scale, causal,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_TMA: tl.constexpr,
):
    # heavy (late, long-causal) tiles first: pid 0 takes the last tile
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_start
    ctx = tl.load(ContextLens + seq)
    n_rows = q_len * GROUP
    row0 = pid_m * BLOCK_M
    if row0 < n_rows:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        tok = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        # visibility limit (absolute key position) of each row; causal is 0 or 1
        lim = (ctx - 1) - causal * (q_len - 1 - tok)
        first_tok = row0 // GROUP
        last_tok = (tl.minimum(row0 + BLOCK_M, n_rows) - 1) // GROUP
        lim_lo = (ctx - 1) - causal * (q_len - 1 - first_tok)
        lim_hi = (ctx - 1) - causal * (q_len - 1 - last_tok)
        n_full = (lim_lo + 1) // BLOCK_N  # blocks every row of the tile sees entirely
        n_blocks = lim_hi // BLOCK_N + 1

        offs_d = tl.arange(0, HEAD_DIM)
        q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

        if KV_TMA:
            # packed varlen K/V (one "page" per sequence, starting at token BlockTable[seq, 0]):
            # TMA loads through descriptors bounded to this sequence's ctx rows
            # (new names: a variable may not change type inside a runtime branch)
            kv0 = tl.load(BlockTable + seq * stride_bt).to(tl.int64)
            k_src = _rows_descriptor(K + kv0 * stride_ks + kvh * stride_kh, ctx, stride_ks, BLOCK_N, HEAD_DIM)
            v_src = _rows_descriptor(V + kv0 * stride_vs + kvh * stride_vh, ctx, stride_vs, BLOCK_N, HEAD_DIM)
        else:
            k_src = K
            v_src = V
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for j in range(0, n_full):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, j, lim, seq, kvh, ctx, k_src, v_src, BlockTable, stride_bt,
                page_size, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                qk_scale, HEAD_DIM, BLOCK_N, False, KV_TMA)
        for j in range(n_full, n_blocks):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, j, lim, seq, kvh, ctx, k_src, v_src, BlockTable, stride_bt,
                page_size, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                qk_scale, HEAD_DIM, BLOCK_N, True, KV_TMA)

        out = acc / l_i[:, None]
        o_off = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(Out + o_off[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None])
        lse = m_i + tl.math.log2(l_i)
        l_off = (q_start + tok).to(tl.int64) * stride_lt + head
        tl.store(Lse + l_off, lse, mask=row_ok)


def tile_config(head_dim: int) -> dict:
    """Pinned launch constants, a function of head_dim only (never of the batch shape)."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"attention: head_dim must be a power of two in [16, 256], got {head_dim}")
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if head_dim == 128:
        # H200 sweep (scripts/attention_tile_sweep.py, results/h200/bench/attention_sweep.json):
        # 64 x 64 tiles on one warpgroup decode 1.09-1.31x SDPA flash (128-row tiles: 0.61-0.67x,
        # a decode tile has only GROUP live rows) at the same prefill speed (0.72-0.77x)
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)


def paged_attention_triton(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens,
                           scale: float, max_seqlen_q: int, causal: bool = True):
    """Launch the kernel on a paged cache. q [T, Hq, D]; k/v_cache [P, S, Hkv, D] (head_dim
    contiguous); block_table [B, max_pages]; cu_seqlens_q [B+1]; context_lens [B]; max_seqlen_q
    bounds the grid. Returns (out [T, Hq, D] q.dtype, lse2 [T, Hq] fp32, log base 2)."""
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attention: k/v cache must be contiguous in head_dim")
    block_table = block_table.to(torch.int32)
    return _launch(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, scale,
                   max_seqlen_q, causal, k_cache.shape[1])


def varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen: int, scale: float,
                            causal: bool = True):
    """Packed varlen forward through the same kernel: K/V [T, Hkv, D] seen as a cache whose
    single page per sequence starts at cu_seqlens[b] (see module docstring)."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    t, hkv, d = k.shape
    # [T, 1, Hkv, D] views: page p = token p, slot n = token offset n from the page start
    k_pages = k.as_strided((t, 1, hkv, d), (k.stride(0), k.stride(0), k.stride(1), 1))
    v_pages = v.as_strided((t, 1, hkv, d), (v.stride(0), v.stride(0), v.stride(1), 1))
    block_table = cu_seqlens[:-1].to(torch.int32).reshape(-1, 1).contiguous()
    context_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    return _launch(q, k_pages, v_pages, block_table, cu_seqlens, context_lens, scale, max_seqlen,
                   causal, VARLEN_PAGE_SIZE, kv_tma=varlen_kv_tma(k, v))


def varlen_kv_tma(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the packed varlen K/V are read by TMA (tensor descriptors) rather than pointer
    loads: 16-bit K/V on a GPU with TMA, 16-byte aligned bases and row strides. Either way a
    block holds the same values (zero past the sequence's end), so the choice moves no bit
    (checked on the GPU: varlen == paged prefill and TMA == pointer loads,
    tests/kernels/test_attention.py). fp32 K/V keep pointer loads: their TMA staging buffers
    do not fit in shared memory at head_dim 256 (262 KB compiled for sm90), and fp32 attention
    serves tests, not models."""
    return _tma_rows_ok(k, v)


def _tma_rows_ok(*ts: torch.Tensor) -> bool:
    """16-bit [tokens, heads, head_dim] tensors that TMA can read on this device: 16-byte
    aligned bases and token/head strides."""
    if ts[0].dtype not in (torch.bfloat16, torch.float16) or not tma_supported(ts[0].device):
        return False
    return all(t.data_ptr() % 16 == 0 and all((t.stride(i) * t.element_size()) % 16 == 0 for i in (0, 1))
               for t in ts)


def _launch(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, scale, max_seqlen_q,
            causal, page_size, kv_tma=False, _cfg=None, _fp_fusion=False):
    # _cfg / _fp_fusion exist for tile benchmarks only; the invariant path never passes them
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    cfg = _cfg or tile_config(d)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    num_seqs = block_table.shape[0]
    if t == 0 or num_seqs == 0:
        return out, lse
    grid = (triton.cdiv(max_seqlen_q * group, cfg["BLOCK_M"]), hkv, num_seqs)
    if kv_tma:
        ensure_allocator(q.device)  # device-side descriptors need Triton's scratch allocator
    _attention_fwd_kernel[grid](
        q, k_cache, v_cache, out, lse, block_table,
        cu_seqlens_q.to(torch.int32), context_lens.to(torch.int32),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), block_table.stride(0),
        page_size, scale * 1.4426950408889634, 1 if causal else 0,
        GROUP=group, HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], KV_TMA=kv_tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=_fp_fusion,
    )
    return out, lse


@triton.jit
def _write_kv_kernel(K, V, KCache, VCache, Slots, stride_kt, stride_vt, stride_kcs, stride_vcs,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(K + t.to(tl.int64) * stride_kt + offs, mask=mask)
        tl.store(KCache + slot * stride_kcs + offs, k, mask=mask)
        v = tl.load(V + t.to(tl.int64) * stride_vt + offs, mask=mask)
        tl.store(VCache + slot * stride_vcs + offs, v, mask=mask)


def write_kv_pages_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Copy k[t], v[t] ([Hkv, D] rows) into cache slot slot_mapping[t]; slots < 0 are skipped."""
    t, hkv, d = k.shape
    if t == 0:
        return
    k2 = k.reshape(t, hkv * d)
    v2 = v.reshape(t, hkv * d)
    if k2.stride(-1) != 1:
        k2 = k2.contiguous()
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    row = hkv * d
    _write_kv_kernel[(t,)](
        # the slots as given (int32 or int64): a cast would be one more kernel per layer and step
        k2, v2, k_cache, v_cache, slot_mapping.contiguous(),
        k2.stride(0), v2.stride(0), k_cache.stride(1), v_cache.stride(1),
        ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4,
    )


# ------------------------------------------------------------------------------- backward
#
# FlashAttention-2 style backward for the packed varlen (trainer) case. Not on the invariant
# path: it only has to be correct (tests compare it with float64 autograd at tolerance).
# Rows are flattened (token, group head) pairs as in the forward, so dK/dV of a KV head sum the
# contributions of all its query heads inside one program (no atomics).


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, CuSeqlens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_lt, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    qk_scale, sm_scale, causal,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QDO_TMA: tl.constexpr,
):
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CuSeqlens + seq)
    length = tl.load(CuSeqlens + seq + 1) - start
    n0 = pid_n * BLOCK_N
    if n0 < length:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        n_ok = offs_n < length
        tok_n = (start + offs_n).to(tl.int64)
        k = tl.load(K + tok_n[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=n_ok[:, None], other=0.0)
        v = tl.load(V + tok_n[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=n_ok[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        n_rows = length * GROUP
        if QDO_TMA:
            # a row tile is BLOCK_M // GROUP tokens x this KV head's GROUP query heads: a 3-D box
            # of the sequence's [tokens, heads, head_dim] (rows past the end zero-filled)
            heads = GROUP * tl.num_programs(1)
            q_desc = tl.make_tensor_descriptor(Q + start.to(tl.int64) * stride_qt,
                                               shape=[length, heads, HEAD_DIM],
                                               strides=[stride_qt, stride_qh, 1],
                                               block_shape=[BLOCK_M // GROUP, GROUP, HEAD_DIM])
            do_desc = tl.make_tensor_descriptor(DO + start.to(tl.int64) * stride_dot,
                                                shape=[length, heads, HEAD_DIM],
                                                strides=[stride_dot, stride_doh, 1],
                                                block_shape=[BLOCK_M // GROUP, GROUP, HEAD_DIM])
        row_lo = ((n0 * GROUP) // BLOCK_M) * BLOCK_M * causal
        for r0 in range(row_lo, n_rows, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_ok = rows < n_rows
            tok = rows // GROUP
            head = kvh * GROUP + rows % GROUP
            tok_m = (start + tok).to(tl.int64)
            if QDO_TMA:
                q = tl.reshape(q_desc.load([r0 // GROUP, kvh * GROUP, 0]), [BLOCK_M, HEAD_DIM])
                do = tl.reshape(do_desc.load([r0 // GROUP, kvh * GROUP, 0]), [BLOCK_M, HEAD_DIM])
            else:
                q = tl.load(Q + tok_m[:, None] * stride_qt + head[:, None] * stride_qh
                            + offs_d[None, :], mask=row_ok[:, None], other=0.0)
                do = tl.load(DO + tok_m[:, None] * stride_dot + head[:, None] * stride_doh
                             + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(Lse + tok_m * stride_lt + head, mask=row_ok, other=0.0)
            delta = tl.load(Delta + tok_m * stride_lt + head, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            visible = row_ok[:, None] & n_ok[None, :]
            visible = visible & ((offs_n[None, :] <= tok[:, None]) | (causal == 0))
            p = tl.where(visible, tl.math.exp2(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee")
        dk = dk * sm_scale
        tl.store(DK + tok_n[:, None] * stride_dkt + kvh * stride_dkh + offs_d[None, :],
                 dk.to(DK.dtype.element_ty), mask=n_ok[:, None])
        tl.store(DV + tok_n[:, None] * stride_dvt + kvh * stride_dvh + offs_d[None, :],
                 dv.to(DV.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, CuSeqlens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_lt, stride_dqt, stride_dqh,
    qk_scale, sm_scale, causal,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_TMA: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CuSeqlens + seq)
    length = tl.load(CuSeqlens + seq + 1) - start
    n_rows = length * GROUP
    row0 = pid_m * BLOCK_M
    if row0 < n_rows:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        tok = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        tok_m = (start + tok).to(tl.int64)
        q = tl.load(Q + tok_m[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + tok_m[:, None] * stride_dot + head[:, None] * stride_doh
                     + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(Lse + tok_m * stride_lt + head, mask=row_ok, other=0.0)
        delta = tl.load(Delta + tok_m * stride_lt + head, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        last_tok = (tl.minimum(row0 + BLOCK_M, n_rows) - 1) // GROUP
        hi = tl.where(causal != 0, last_tok + 1, length)
        if KV_TMA:  # this sequence's K/V rows of this KV head, rows past the end zero-filled
            k_desc = _rows_descriptor(K + start.to(tl.int64) * stride_kt + kvh * stride_kh, length, stride_kt,
                                      BLOCK_N, HEAD_DIM)
            v_desc = _rows_descriptor(V + start.to(tl.int64) * stride_vt + kvh * stride_vh, length, stride_vt,
                                      BLOCK_N, HEAD_DIM)
        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < length
            if KV_TMA:
                k = k_desc.load([n0, 0])
                v = v_desc.load([n0, 0])
            else:
                tok_n = (start + offs_n).to(tl.int64)
                k = tl.load(K + tok_n[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                            mask=n_ok[:, None], other=0.0)
                v = tl.load(V + tok_n[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                            mask=n_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            visible = row_ok[:, None] & n_ok[None, :]
            visible = visible & ((offs_n[None, :] <= tok[:, None]) | (causal == 0))
            p = tl.where(visible, tl.math.exp2(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
        dq = dq * sm_scale
        tl.store(DQ + tok_m[:, None] * stride_dqt + head[:, None] * stride_dqh + offs_d[None, :],
                 dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


def _bwd_config(head_dim: int) -> dict:
    if head_dim <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    if head_dim == 128:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)


def _bwd_tma(q, k, v, dout, group: int, block_m: int) -> tuple[bool, bool]:
    """(Q/dO through tensor descriptors in the dK/dV kernel, K/V through them in the dQ kernel):
    16-bit tensors on a GPU with TMA, 16-byte aligned bases and token/head strides; the dK/dV
    kernel's 3-D box of GROUP heads also needs GROUP a power of two dividing BLOCK_M. The loads
    give the same values either way (rows past a sequence's end read as zero)."""
    pow2 = group & (group - 1) == 0 and block_m % group == 0
    return pow2 and _tma_rows_ok(q, dout), varlen_kv_tma(k, v)


def varlen_attention_backward_triton(q, k, v, out, lse2, dout, cu_seqlens, max_seqlen: int,
                                     scale: float, causal: bool = True, _tma=None):
    """Gradients (dq, dk, dv) of ``varlen_attention_triton``; lse2 is the forward's base-2 LSE."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    q, k, v, dout = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, dout))
    delta = (dout.float() * out.float()).sum(-1).contiguous()
    lse2 = lse2.contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    num_seqs = cu_seqlens.numel() - 1
    if t == 0 or num_seqs == 0:
        return dq, dk, dv
    cfg = _bwd_config(d)
    cu = cu_seqlens.to(torch.int32)
    common = dict(GROUP=group, HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    tma = _bwd_tma(q, k, v, dout, group, cfg["BLOCK_M"]) if _tma is None else _tma
    if any(tma):
        ensure_allocator(q.device)
    qk_scale = scale * 1.4426950408889634
    _attention_bwd_dkdv_kernel[(triton.cdiv(max_seqlen, cfg["BLOCK_N"]), hkv, num_seqs)](
        q, k, v, dout, lse2, delta, dk, dv, cu,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), lse2.stride(0), dk.stride(0), dk.stride(1),
        dv.stride(0), dv.stride(1), qk_scale, scale, 1 if causal else 0, QDO_TMA=tma[0], **common)
    _attention_bwd_dq_kernel[(triton.cdiv(max_seqlen * group, cfg["BLOCK_M"]), hkv, num_seqs)](
        q, k, v, dout, lse2, delta, dq, cu,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), lse2.stride(0), dq.stride(0), dq.stride(1),
        qk_scale, scale, 1 if causal else 0, KV_TMA=tma[1], **common)
    return dq, dk, dv
