"""Multi-head latent attention (MLA, DeepSeek-V2/V3, GLM-4.7-Flash) in the *expanded* form.

Which form, where: the trainer (varlen), the engine's chunked prefill and its decode all run the
same expanded form, and the engine caches the expanded per-head keys and values. The model
(``isoexec/model/mla_moe.py``) computes, per token t and head h, with each step a region of the
contract (so its kernel and rounding are those of the region's implementation):

  1. a      = lin(attn_norm(x_t), [W_q_a; W_kv_a])   one GEMM when the contract fuses q_a_proj and
                                                       kv_a_proj; a = [q latent | c_kv | k_rope]
  2. q      = lin(rmsnorm(q latent, eps 1e-6), W_q_b)             [H, d_nope + d_rope]
  3. kv     = lin(rmsnorm(c_kv, eps 1e-6), W_kv_b)                [H, d_nope + d_v]
  4. q_rope, k_rope: RoPE (fp32 phases at absolute positions, region ``rope``) of the rope part
     of q (per head) and of the single shared k_rope; with ``rope_interleave`` (transformers'
     default) the rope channels are first de-interleaved (x0, x2, ..., x1, x3, ...), a
     permutation, so that the neox rotate-half rotation gives transformers' interleaved
     rotation's output exactly (its output is de-interleaved too; q and k get the same layout).
  5. expand (``expand_qkv``, copies only, no arithmetic):
        Q_h = [q_nope_h ; q_rope_h]    K_h = [k_nope_h ; k_rope]    V_h = v_h
     with k_nope_h and v_h the two parts of kv's head h and k_rope shared by every head.
  6. attention (region ``attn_core``, impl ``mla_expanded_walk``): Q, K and V are zero-padded
     to the width W = the smallest power of two >= max(16, d_nope + d_rope, d_v) and handed to
     the batch-invariant attention (``isoexec_kernels.attention``: KV blocks of 64 keys at
     absolute positions, fp32 online softmax, one rounding; its docstring is the rounding
     schedule), with scale (d_nope + d_rope) ** -0.5; the output keeps its first d_v columns.
  7. o_proj: lin(out, W_o).

Padding cannot change a real element's bits:
  * V: an output column c is acc_c / l with acc_c = sum over keys of p_n * V[n, c] (a sum over
    keys, not over columns) and l from the scores alone, so column c reads only column c of V;
    the zero columns c >= d_v produce zero outputs that are dropped and touch nothing else.
  * Q and K: the padded channels add products 0 * 0 = +0 to each score's dot product. In the
    CPU reference the dot is a halves tree padded with -0.0 to a power of two anyway; with +0
    pads the same positions hold +0 instead of -0, and x + (+0) == x for every x except
    x = -0 (giving +0). A score can therefore change only from -0 to +0, which the softmax
    cannot see (it uses scores through max and exp2(s - m), and exp2(+-0 - m) are equal). On
    the GPU the padded width is simply the kernel's head width: trainer and engine run the same
    W in every case, which is what invariance needs.
  The engine pads exactly as the trainer does (``write_mla_kv_pages`` pads k and v before the
  page write), so trainer and engine see identical padded rows.

What the engine caches: per token and layer, the padded expanded K and V rows,
2 * H * W elements (``KVCache`` pages [num_pages, page_size, H, W]). GLM-4.7-Flash
(H 20, d_nope 192, d_rope 64, d_v 256, W 256): 10,240 elements per token and layer, 17.8x the
576 of the compressed latent (kv_lora_rank 512 + d_rope 64); DeepSeek-V3 (H 128, 128 + 64, 128,
W 256): 65,536 (40,960 without the padding), 114x the latent. The absorbed decode (cache the
latent, fold W_kv_b into q and o) is a later optimisation: it sums in another order, so it may
be used only once a gate shows it gives the expanded form's bits, or the trainer adopts it too.

Public API (same positional arguments as ``isoexec_kernels.attention``; q/k [T, H, d_qk],
v [T, H, d_v], caches [num_pages, page_size, H, W]):
  ``mla_width(d_qk, d_v)``, ``pad_heads(x, width)``, ``expand_qkv(q_nope, q_rope, kv, k_rope, d_nope, d_v)``
  ``mla_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)`` -> [T, H, d_v] (autograd)
  ``mla_paged_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, scale,
  max_seqlen_q=None, v_dim=None)`` and ``mla_paged_decode_attention(q, k_cache, v_cache, block_table,
  context_lens, scale, v_dim=None)`` -> [T, H, v_dim or W]
  ``write_mla_kv_pages(k, v, k_cache, v_cache, slot_mapping)``: pads to the cache width and writes

Backward: autograd through the padding and the attention's own backward (a plain fp32 torch
computation on the CPU, the Triton kernels on CUDA); gradients of the padded channels are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import paged_prefill_attention, varlen_attention, write_kv_pages

FORM = "expanded"
CACHE = "expanded_kv_padded"


def mla_width(d_qk: int, d_v: int) -> int:
    """The attention width W: the smallest power of two >= max(16, d_qk, d_v)."""
    return 1 << (max(16, d_qk, d_v) - 1).bit_length()


def pad_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x[..., D]`` zero-padded (+0.0) to ``width`` channels (x itself when D == width)."""
    d = x.shape[-1]
    if d == width:
        return x
    if d > width:
        raise ValueError(f"mla: head dim {d} exceeds the attention width {width}")
    return F.pad(x, (0, width - d))


def expand_qkv(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor,
               d_nope: int, d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expanded per-head (q, k, v) from q's two parts [T, H, d_nope] / [T, H, d_rope], kv_b's
    output [T, H, d_nope + d_v] and the shared rotated key [T, 1, d_rope]. Copies only."""
    T, H = kv.shape[0], kv.shape[1]
    if kv.shape[-1] != d_nope + d_v:
        raise ValueError(f"mla: kv rows have {kv.shape[-1]} channels, expected d_nope + d_v = {d_nope + d_v}")
    k_nope, v = kv.split((d_nope, d_v), dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    k = torch.cat([k_nope, k_rope.expand(T, H, k_rope.shape[-1])], dim=-1)
    return q, k, v.contiguous()


def mla_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, scale: float) -> torch.Tensor:
    """Trainer case: packed causal attention of expanded heads; [T, H, d_v] (differentiable)."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"mla: q and k head dims differ ({q.shape[-1]}, {k.shape[-1]})")
    w = mla_width(q.shape[-1], v.shape[-1])
    out = varlen_attention(pad_heads(q, w), pad_heads(k, w), pad_heads(v, w), cu_seqlens, max_seqlen, scale)
    return out[..., :v.shape[-1]]


def mla_paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, max_seqlen_q: int | None = None,
                                v_dim: int | None = None) -> torch.Tensor:
    """Engine chunked prefill over W-wide pages (the chunk's k/v already written by
    :func:`write_mla_kv_pages`); [T, H, v_dim] (all W columns when v_dim is None)."""
    out = paged_prefill_attention(pad_heads(q, k_cache.shape[-1]), k_cache, v_cache, block_table, cu_seqlens_q,
                                  context_lens, scale, max_seqlen_q=max_seqlen_q)
    return out if v_dim is None else out[..., :v_dim]


def mla_paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               v_dim: int | None = None) -> torch.Tensor:
    """Engine decode: one query per sequence, the same kernel and schedule as prefill."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return mla_paged_prefill_attention(q, k_cache, v_cache, block_table, cu, context_lens, scale, max_seqlen_q=1,
                                       v_dim=v_dim)


def write_mla_kv_pages(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Pad k [T, H, d_qk] and v [T, H, d_v] to the cache width and write them by slot (a copy)."""
    w = k_cache.shape[-1]
    write_kv_pages(pad_heads(k, w).contiguous(), pad_heads(v, w).contiguous(), k_cache, v_cache, slot_mapping)
