"""Batch-invariant attention: one rounding schedule for the trainer and the engine.

Three cases, one kernel family, the same per-element rounding schedule, so that the last row of
a prefill equals the decode row bit for bit and a trainer forward equals the engine's rows:

* ``varlen_attention``          trainer: packed variable-length causal forward (autograd);
* ``paged_prefill_attention``   engine chunked prefill over the paged KV cache;
* ``paged_decode_attention``    engine decode: one query per sequence over the paged cache;
* ``write_kv_pages``            writes new K/V rows into the cache by slot;
* ``compute_slot_mapping``      the slots of a batch's new tokens, from the block table.

CUDA tensors go to the Triton kernel (``triton_kernels.py``), CPU tensors to the torch reference
twin (``reference.py``). The two share the schedule, not the bits (exp2 differs).

Shapes and conventions
----------------------
GQA: ``Hq`` is a multiple of ``Hkv``; query head h uses KV head ``h // (Hq // Hkv)``. head_dim
is a power of two in [16, 256] (64 and 128 are the tuned ones). The softmax scale is given.
Dtypes bf16 / fp16 / fp32; softmax state in fp32; output in the input dtype.

Paged KV cache layout (the engine's contract)::

    k_cache, v_cache : [num_pages, page_size, Hkv, D], contiguous, same dtype as q
    block_table      : [num_seqs, max_pages] int32; page i of sequence b holds its key
                       positions [i * page_size, (i + 1) * page_size); unused entries are ignored
    context_lens     : [num_seqs] int32, keys of the sequence INCLUDING the new tokens
    cu_seqlens_q     : [num_seqs + 1] int32, the new (query) tokens of sequence b are
                       q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]] at absolute positions
                       context_lens[b] - q_len_b ... context_lens[b] - 1
    slot_mapping     : [T] int, slot = page * page_size + offset; negative = skip (padding)

page_size is any positive integer (it only changes addressing, never arithmetic: KV blocks sit
at absolute positions and gather keys across page boundaries); multiples of 16 are fastest on
the GPU, and page_size a multiple of BLOCK_N = 64 makes every block a single page.

Rounding schedule (pinned; see ``attention_constants``)
-------------------------------------------------------
Each query row at absolute position ``pos`` walks the keys of its own sequence in KV blocks of
BLOCK_N = 64 keys at ABSOLUTE positions, block j = keys [64 j, 64 j + 64), for
j = 0 .. pos // 64 in increasing order (non-causal: up to the last key). Per block, in fp32::

    s   = (q . k_n) * (scale * log2 e)       q . k over head_dim in a fixed order
    s_n = -inf for n > pos                   (causal mask at absolute positions)
    m'  = max(m, max_n s_n)                  m starts at -inf, l at 0, acc at 0
    a   = exp2(m - m');  p_n = exp2(s_n - m')
    l'  = l * a + sum_n p_n                  fixed-order sum over the 64 keys
    acc'= acc * a + sum_n dtype(p_n) * v_n   p rounded to the input dtype, fp32 accumulation

and finally ``out = dtype(acc / l)``. A block wholly after ``pos`` is never applied to that row.
There is no split-KV: the blocks of a row are combined in increasing j by one program.

Invariance argument: a row's result is a function of (its q, its sequence's K/V up to its
limit, its absolute position) through this schedule alone. It does not depend on the number of
queries sharing its tile, how the prompt was chunked, the page layout, or the rest of the batch,
because (1) block boundaries are absolute positions, not tile-relative; (2) the reductions
inside a block have an order fixed by BLOCK_N and head_dim only; (3) no reduction ever runs
along the row axis. The CPU twin realises (2) with elementwise IEEE ops and slicing trees (see
``reference.py``); the Triton kernel launches ONE compiled kernel with the same tile
constants for all three cases (see ``triton_kernels.py`` for what that rests on).

``lse`` (log-sum-exp, base 2) is kept for the backward only. The backward of ``varlen_attention``
is a FlashAttention-2 style Triton kernel on CUDA and a plain fp32 torch computation on CPU;
both are correct at tolerance and neither is on the invariant path (only the forward must match
across cases: the rollout never differentiates).
"""

from __future__ import annotations

import torch

from . import reference as _ref
from .native import (  # noqa: F401  (re-exported stock twins)
    attention_native_paged_decode,
    attention_native_paged_prefill,
    attention_native_varlen,
)

BLOCK_N = _ref.BLOCK_N
IMPL_ID = "isoexec_attention"
IMPL_VERSION = 1

__all__ = [
    "varlen_attention", "paged_prefill_attention", "paged_decode_attention", "write_kv_pages",
    "compute_slot_mapping", "attention_constants", "attention_native_varlen",
    "attention_native_paged_prefill", "attention_native_paged_decode",
]


def attention_constants(head_dim: int, device_type: str = "cuda") -> dict:
    """The constants that can move bits, for the execution contract (ints and strings only)."""
    consts = {"block_n": BLOCK_N, "acc_dtype": "fp32", "p_dtype": "input", "split_kv": 1,
              "exp": "exp2", "normalise": "acc/l", "kv_order": "absolute_blocks_increasing",
              "head_dim": head_dim}
    if device_type == "cuda":
        from .triton_kernels import tile_config

        cfg = tile_config(head_dim)
        consts.update(backend="triton", block_m=cfg["BLOCK_M"], num_warps=cfg["num_warps"],
                      num_stages=cfg["num_stages"], fp_fusion="off", dot_precision="ieee")
    else:
        consts.update(backend="torch_reference", dot_order="pairwise_tree",
                      exp_impl="exp2_fixed_deg7")
    return consts


def _check_common(q, k, v, name: str) -> None:
    _ref._check_shapes(q, k, v)
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: dtype {q.dtype} not supported (bf16, fp16, fp32)")
    d = q.shape[-1]
    if d & (d - 1) or not 16 <= d <= 256:
        raise ValueError(f"{name}: head_dim must be a power of two in [16, 256], got {d}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v on different devices ({q.device}, {k.device}, "
                         f"{v.device})")


def _check_cache(k_cache, v_cache, block_table, name: str) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"{name}: k_cache must be [num_pages, page_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{name}: k_cache and v_cache must be contiguous")
    if block_table.dim() != 2:
        raise ValueError(f"{name}: block_table must be [num_seqs, max_pages], got "
                         f"{tuple(block_table.shape)}")


# ----------------------------------------------------------------------------------- trainer


def _varlen_forward(q, k, v, cu_seqlens, max_seqlen: int, scale: float, causal: bool):
    if q.is_cuda:
        from .triton_kernels import varlen_attention_triton

        return varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, scale, causal)
    return _ref.varlen_attention_reference(q, k, v, cu_seqlens, scale, causal)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, causal):
        out, lse2 = _varlen_forward(q, k, v, cu_seqlens, max_seqlen, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_seqlens)
        ctx.scale, ctx.causal, ctx.max_seqlen = scale, causal, max_seqlen
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, cu_seqlens = ctx.saved_tensors
        if q.is_cuda:
            from .triton_kernels import varlen_attention_backward_triton

            dq, dk, dv = varlen_attention_backward_triton(
                q, k, v, out, lse2, dout, cu_seqlens, ctx.max_seqlen, ctx.scale, ctx.causal)
        else:
            dq, dk, dv = _ref.varlen_attention_backward_reference(
                q, k, v, out, lse2, dout, cu_seqlens, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, causal: bool = True) -> torch.Tensor:
    """Packed variable-length attention over concatenated sequences (trainer case).

    q [T, Hq, D], k/v [T, Hkv, D]; sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]
    (cu_seqlens [B+1] int32, starting at 0); max_seqlen >= the longest sequence (sizes the GPU
    grid). Returns out [T, Hq, D] in q.dtype. Differentiable in q, k, v. With causal=True every
    row's bits equal those of ``paged_prefill_attention`` / ``paged_decode_attention`` for the
    same token (same device type).
    """
    _check_common(q, k, v, "varlen_attention")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"varlen_attention: q has {q.shape[0]} tokens, k has {k.shape[0]}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("varlen_attention: cu_seqlens must be a 1-D tensor [B+1]")
    return _VarlenAttention.apply(q, k, v, cu_seqlens, int(max_seqlen), float(scale),
                                  bool(causal))


# ------------------------------------------------------------------------------------ engine


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float,
                            max_seqlen_q: int | None = None) -> torch.Tensor:
    """Chunked prefill over the paged cache (engine case); no autograd.

    q [T, Hq, D]: the new tokens of each sequence, rows cu_seqlens_q[b]:cu_seqlens_q[b+1],
    whose K/V are ALREADY written into the cache (``write_kv_pages``); they sit at absolute
    positions context_lens[b] - q_len_b .. context_lens[b] - 1 and attend causally to every
    earlier key of the sequence and to the chunk. A sequence with q_len 1 is a decode row, so
    mixed prefill + decode batches are one call. max_seqlen_q (longest chunk) sizes the GPU
    grid; if None it is read from cu_seqlens_q (a device sync on CUDA).
    """
    _check_common(q, k_cache, v_cache, "paged_prefill_attention")
    _check_cache(k_cache, v_cache, block_table, "paged_prefill_attention")
    if q.is_cuda:
        from .triton_kernels import paged_attention_triton

        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if \
                cu_seqlens_q.numel() > 1 else 0
        out, _ = paged_attention_triton(q, k_cache, v_cache, block_table, cu_seqlens_q,
                                        context_lens, float(scale), max_seqlen_q)
        return out
    out, _ = _ref.paged_attention_reference(q, k_cache, v_cache, block_table, cu_seqlens_q,
                                            context_lens, float(scale))
    return out


_DECODE_CU: dict[torch.device, torch.Tensor] = {}


def _decode_cu_seqlens(batch: int, device: torch.device) -> torch.Tensor:
    """``arange(batch + 1)`` as int32 on ``device``: a slice of one kept tensor, so a decode
    step does not launch an arange per layer. During CUDA-graph capture a missing or short
    tensor is made inside the graph instead (a tensor kept from a capture would belong to the
    graph's private memory pool)."""
    kept = _DECODE_CU.get(device)
    if kept is None or kept.numel() < batch + 1:
        # room for 256 sequences at once, so the kept tensor is rarely regrown
        fresh = torch.arange(max(batch + 1, 257), dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return fresh[:batch + 1]
        _DECODE_CU[device] = kept = fresh
    return kept[:batch + 1]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Decode (engine case): q [B, Hq, D], one query per sequence at absolute position
    context_lens[b] - 1 (its K/V already written). Same kernel and schedule as prefill."""
    cu = _decode_cu_seqlens(q.shape[0], q.device)
    return paged_prefill_attention(q, k_cache, v_cache, block_table, cu, context_lens, scale,
                                   max_seqlen_q=1)


def write_kv_pages(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Copy k[t], v[t] ([T, Hkv, D]) into ``k_cache.view(-1, Hkv, D)[slot_mapping[t]]`` (and v),
    bit-exact; tokens with a negative slot are skipped. The caches must be contiguous and of
    k's dtype."""
    _check_cache(k_cache, v_cache, torch.empty(0, 0), "write_kv_pages")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"write_kv_pages: k/v dtype {k.dtype} differs from cache "
                         f"{k_cache.dtype}; cast explicitly before writing")
    if k.shape[1:] != k_cache.shape[2:] or v.shape != k.shape:
        raise ValueError(f"write_kv_pages: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit "
                         f"cache rows {tuple(k_cache.shape[2:])}")
    if k.is_cuda:
        from .triton_kernels import write_kv_pages_triton

        write_kv_pages_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        _ref.write_kv_pages_reference(k, v, k_cache, v_cache, slot_mapping)


def compute_slot_mapping(block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots (int64, [T]) of the new tokens described by cu_seqlens_q / context_lens:
    token i of sequence b sits at position p = context_lens[b] - q_len_b + i, in slot
    block_table[b, p // page_size] * page_size + p % page_size."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q_lens.device), q_lens)
    offset_in_chunk = torch.arange(seq.numel(), device=q_lens.device) - cu_seqlens_q[seq].long()
    pos = context_lens.long()[seq] - q_lens[seq] + offset_in_chunk
    pages = block_table.long()[seq, pos // page_size]
    return pages * page_size + pos % page_size
