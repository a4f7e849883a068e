"""Gated DeltaNet core by CPR (chunkwise-parallel recurrent): one rounding schedule for the
trainer, engine prefill (split anywhere) and engine decode.

Public API
  ``CHUNK``                                  chunk size C (64), pinned in the contract
  ``GDNState``                               per-layer recurrent state of S engine slots
  ``gdn_cpr_varlen(q, k, v, g, beta, cu_seqlens, *, chunk)``               trainer (autograd)
  ``gdn_cpr_engine(q, k, v, g, beta, cu_seqlens_q, slots, state, *, chunk)`` engine prefill
  ``gdn_cpr_decode(q, k, v, g, beta, slots, state, *, chunk)``             engine decode
  ``*_reference`` / ``*_triton`` twins of the three; CUDA tensors go to Triton, others to the
  reference (``want_triton``).

The function (one value head h, key head ``h // (H // Hk)``, fp32 state S [Dk, Dv] starting at
zero; q and k are L2-normalised by the caller and q is already scaled by Dk^-0.5)::

    S = S * exp(g_t);  kv = S^T k_t;  delta = (v_t - kv) * beta_t;  S = S + k_t delta^T;
    o_t = S^T q_t

Shapes: q, k [T, Hk, Dk] fp32; v [T, H, Dv] bf16/fp32; g (log decay <= 0), beta [T, H] fp32;
o [T, H, Dv] fp32. (float64 inputs run the reference in float64: used by gradcheck only.)

CPR schedule (the same for every case)
--------------------------------------
Positions are absolute within a sequence. Chunk c holds positions [cC, cC + C).

* Boundary states: B_0 = 0 and B_{c+1} = chunk_update(B_c, the C tokens of chunk c), only for
  complete chunks. ``chunk_update`` (WY/UT form, fp32, fixed order; ``state.BOUNDARY = "wy"``,
  version 3)::

      G_t   = running sum of g inside each 16-row block, plus the blocks before it
      A_ij  = (beta_i * (k_i . k_j)) * exp(G_i - G_j)        j < i, else 0
      T     = (I + A)^-1  by 16 x 16 blocks: each diagonal block by forward substitution
              (row i = e_i - sum_j A_ij row j), the blocks below by
              T_ab = -T_aa (A_ab T_bb + A_a,b+1 T_b+1,b + ... + A_a,a-1 T_a-1,b)
      W     = T @ (k * (beta * exp(G)))     U = T @ (v * beta)
      Vnew  = (U - W @ B_c) * exp(G_{C-1} - G)
      B_c+1 = B_c * exp(G_{C-1}) + k^T @ Vnew

  (Version 2 used the "rows" form: G by one running sum, T row by row over the whole chunk, the
  decay on k instead of Vnew; ``state.BOUNDARY = "rows"`` keeps it callable, other bits.)

* Token outputs: token t of chunk c runs the per-token step above from B_c through the tokens
  of chunk c up to t; o_t is read from the state after the step. The state after the last
  token of a complete chunk is dropped (the next chunk starts from B_{c+1}).

* Cases. trainer / prefill: pass 1 = the B_c chain (sequential over chunks, parallel over
  sequences and heads), pass 2 = every chunk's in-chunk recurrence in parallel. Engine prefill
  of a piece continues from the slot's state: the tokens of the open chunk buffered in the state
  are prepended to the piece (their outputs are dropped), so the piece is processed as a
  sequence that starts on a boundary, from B_c. Decode: one step from ``running``; the token is
  appended to the buffer; when the chunk completes, ``boundary = chunk_update(boundary, buffer)``
  and ``running = boundary``.
  Since chunk_update always sees the same C tokens from the same boundary, and the per-token
  step always starts from the same boundary (the buffered prefix reproduces ``running`` exactly),
  every case gives the same bits, provided the two functions are the same code with the same
  reduction order in every case. They are: one reference function each, one Triton kernel each.

Reference twin (impl ``ref_gdn_cpr``): built from IEEE basic ops only: exp by
:func:`isoexec_kernels._ref.exp64` rounded once; every dot product (over Dk, or over the C
tokens of a chunk) by the halves tree of :func:`isoexec_kernels._ref.tree_sum0`; the forward
substitution's sum over j runs over all rows of its block (zero terms for j >= i) by the same tree. Batch
rows never mix, so results do not depend on batch composition, padding or case.

Triton twin (impl ``triton_gdn_cpr``): the boundary update by the three WY kernels of
``native_wy.py`` at fp32 operands (``cpr_wy.py``: ``_wy_inverse_kernel`` per complete chunk and head,
``_wy_wu_kernel`` per chunk, head and column block, ``_wy_state_kernel`` the B_c chain per (sequence
or lane, head, Dv tile of 32)), and the per-token step by ``_gdn_recurrent_kernel`` (one program per
(segment, head, Dv tile); ``tl.sum`` over Dk; the next row's loads issued during the current step).
Every fp32 ``tl.dot`` of the boundary kernels uses ``input_precision="tf32x3"`` (three TF32
tensor-core products per dot, about fp32 accuracy, the same instruction sequence in every case) and
the inverse's 16 x 16 merges fp32 FMA; exp is ``tl.exp``; tiles and warps are fixed constants that
depend on (Dk, Dv) only, never on T, the batch or the case. Decode launches the same three kernels
for all lanes; a lane whose chunk is not complete has 0 rows and its programs return at once, so
decode has no host sync and no data-dependent Python control flow (CUDA-graph capturable). Only the
loop trip counts and base addresses differ between the cases, never the arithmetic.

The arithmetic choices that move bits (dot precision, the boundary form, the per-token Dv tile and
warps) are one value, ``triton_kernels.CPRKernelChoice``; ``PINNED`` is this impl's version 3 (the
WY boundary form, tf32x3, 32-wide Dv tile on 4 warps, prefetch; on the H200 at ``c3a9c7c``: trainer
forward 8.0 -> 6.0 ms and decode 0.61 -> 0.51 ms against version 2, the cases bitwise). Version 2 (the rows form: the
``_gdn_prep_kernel`` and ``_gdn_state_kernel`` here, 4.5 ms of a 5 x 2048 prefill on the H200) and
version 1 (fp32 FMA dots) keep the same cases bitwise, slower; ``scripts/cpr_variant_sweep.py``
(docs/cpr.md "Speed") times and checks the candidates on a GPU.

Memory: the boundary kernels write T, W and U for every complete chunk ([chunks, H, C, C|Dk|Dv]
fp32) and pass 1 one start state per chunk ([chunks, H, Dk, Dv] fp32). Decode allocates that
scratch for all B lanes every step (about 0.7 GB at B=256, H=32, D=128; freed after the step,
reused inside a CUDA graph pool).

Backward (trainer): the gradient of the chunk form of the same function
(``chunk_form.torch_chunk_form``), recomputed in the backward by ``chunk_form_backward``: on CUDA
the native chunk path's WY backward kernels (``native_wy_backward.py``, by ``CPR_BWD_KIND``; bf16
operands with fp32 accumulation for bf16 values, fixed reduction orders, no atomics: deterministic
run to run), elsewhere autograd through the torch chunk form; correct at tolerance, not on the
invariant path (the rollout never differentiates).
"""

from __future__ import annotations

import torch

from .._triton_util import want_triton
from .chunk_form import chunk_form_backward
from .plan import _check
from .reference import gdn_cpr_decode_reference, gdn_cpr_engine_reference, gdn_cpr_varlen_reference
from .state import CHUNK, GDNState
from .triton_kernels import gdn_cpr_decode_triton, gdn_cpr_engine_triton, gdn_cpr_varlen_triton


CPR_BWD_KIND = "wy"
"""The CPR trainer's backward kernels (``chunk_form_backward``'s ``kernels``): "wy", the native
chunk path's WY backward (the gradient at the stock kernels' rounding; only forward bits must
agree between trainer and engine, so the backward takes the fastest deterministic form), or
"shared", the tf32x3 backward of ``chunk_backward.py`` (CPR's until #14)."""


def _varlen_forward(q, k, v, g, beta, cu_seqlens, chunk):
    if want_triton(v):
        return gdn_cpr_varlen_triton(q, k, v, g, beta, cu_seqlens, chunk=chunk)
    return gdn_cpr_varlen_reference(q, k, v, g, beta, cu_seqlens, chunk=chunk)


class _ChunkFormVarlenFn(torch.autograd.Function):
    """A CPR trainer forward ``fwd`` (a version's twins behind one function) with the gradient of
    the chunk form (``chunk_form_backward``): every CPR version trains with the same backward."""

    @staticmethod
    def forward(ctx, fwd, q, k, v, g, beta, cu_seqlens, chunk):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        ctx.chunk = chunk
        ctx.req = [x.requires_grad for x in (q, k, v, g, beta)]
        return fwd(q, k, v, g, beta, cu_seqlens, chunk)

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, cu = ctx.saved_tensors
        inputs = [x.detach().requires_grad_(r) for x, r in zip((q, k, v, g, beta), ctx.req)]
        grads = chunk_form_backward(inputs, cu, ctx.chunk, do, kernels=CPR_BWD_KIND)
        return (None, *grads, None, None)


def chunk_form_varlen(fwd, q, k, v, g, beta, cu_seqlens, chunk: int, name: str) -> torch.Tensor:
    """The trainer case of a CPR version whose forward is ``fwd(q, k, v, g, beta, cu_seqlens,
    chunk)``: arguments checked (``name`` in the messages), differentiable when an input asks for
    a gradient."""
    _check(q, k, v, g, beta, name)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta)):
        return _ChunkFormVarlenFn.apply(fwd, q, k, v, g, beta, cu_seqlens, chunk)
    return fwd(q, k, v, g, beta, cu_seqlens, chunk)


def gdn_cpr_varlen(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer case: sequences ``cu_seqlens[b]:cu_seqlens[b+1]`` each from the zero state;
    returns o [T, H, Dv] fp32. Differentiable w.r.t. q, k, v, g, beta. Schedule: module
    docstring (Triton on CUDA, reference elsewhere)."""
    return chunk_form_varlen(_varlen_forward, q, k, v, g, beta, cu_seqlens, chunk, "gdn_cpr_varlen")


def gdn_cpr_engine(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK,
                   host=None) -> torch.Tensor:
    """Engine prefill: any number of new tokens per sequence (``cu_seqlens_q``), sequence b
    continuing from state slot ``slots[b]``; updates ``state`` in place, returns o [T, H, Dv]
    fp32. Bitwise equal to the trainer rows of the same positions. ``host``: the same layout on
    the host (``plan.HostPlan``), which spares the Triton twin's readbacks (the reference reads
    its state on the host anyway)."""
    with torch.no_grad():
        if want_triton(v):
            return gdn_cpr_engine_triton(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk=chunk, host=host)
        return gdn_cpr_engine_reference(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk=chunk)


def gdn_cpr_decode(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode: one token per lane (q, k [B, Hk, Dk], v [B, H, Dv], g, beta [B, H]) from
    slot ``slots[b]``; updates ``state`` (resync at chunk completion), returns o [B, H, Dv] fp32.
    Padded lanes point at a scratch slot and touch only that slot. CUDA-graph capturable on GPU."""
    with torch.no_grad():
        if want_triton(v):
            return gdn_cpr_decode_triton(q, k, v, g, beta, slots, state, chunk=chunk)
        return gdn_cpr_decode_reference(q, k, v, g, beta, slots, state, chunk=chunk)
