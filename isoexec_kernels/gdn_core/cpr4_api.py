"""CPR version 4 behind one public function per case (impl ``gdn_cpr_chunk``, bound by the IsoExec
compositions, the tensor-parallel ones included, for both GDN families; version 3 is ``gdn_cpr``).

Public API (the signatures of ``api.py``'s version 3)
  ``gdn_cpr4_varlen(q, k, v, g, beta, cu_seqlens, *, chunk)``               trainer (autograd)
  ``gdn_cpr4_engine(q, k, v, g, beta, cu_seqlens_q, slots, state, *, chunk, host)`` engine prefill
  ``gdn_cpr4_decode(q, k, v, g, beta, slots, state, *, chunk)``             engine decode
CUDA tensors go to the Triton twin (``cpr_chunk.py``, decode by rows ``cpr_row_decode.py``), others
to the reference twin (``cpr_chunk_reference.py``). The engine state needs the open chunk's queries
and rows of Vn and T: ``GDNState.allocate(..., with_q=True)``, which the hybrid model does when its contract
binds this impl (``isoexec.model.hybrid.contract_gdn_chunk_form``), keeping the open chunk's values in
the model dtype (``value_dtype``; a state that keeps them in bf16 refuses fp32 values).

Rounding schedule: every output from the chunk form of the native WY kernels (``native_wy.py``)
with the operands pinned by the model's dtype (``cpr_chunk.cpr4_choice``). bf16 values: q, k, v,
T, W, U, the states and Vn rounded to bf16 as dot operands (``CPR4_CHOICE``); fp32 values: the same
dots in tf32x3, fp32-accurate, nothing rounded (``CPR4_CHOICE_FP32``). fp32 accumulation, the state chain
between chunks in fp32 (stored in fp32 at every chunk start, where the engine resumes). The engine
prefill continues the open chunk as [its buffered rows + the new rows] from the slot's fp32 state
entering it; decode computes row t of the chunk form alone from the same state (bf16 values; fp32
values decode by the open chunk's prefix: ``cpr_chunk.ROW_DECODE_DOTS`` says why). Row t of every
matrix of the chunk form depends only on rows 0..t of its chunk, so every case gives every token
the trainer's bits (0 differing on the H200 in random prefill/decode plans, CUDA graph == eager:
``scripts/cpr4_probe.py``).

Accuracy: with bf16 values, bf16 operands (relative L2 about 4e-3 against the float64 recurrence
at Qwen3.5 sizes, the stock kernels' accuracy); with fp32 values, fp32 accuracy (impl version 2;
version 1 took bf16 operands for fp32 values too).

Backward (trainer): as version 3, the gradient of the chunk form recomputed by
``chunk_form_backward`` (on CUDA the native WY backward kernels, deterministic run to run; elsewhere
autograd through the torch chunk form); only forward bits must match between trainer and engine.
"""

from __future__ import annotations

import torch

from .._triton_util import want_triton
from .api import chunk_form_varlen
from .cpr_chunk import cpr4_decode_triton, cpr4_engine_triton, cpr4_varlen_triton
from .cpr_chunk_reference import cpr4_decode_reference, cpr4_engine_reference, cpr4_varlen_reference
from .plan import HostPlan
from .state import CHUNK, GDNState


def _varlen_forward(q, k, v, g, beta, cu_seqlens, chunk):
    if want_triton(v):
        return cpr4_varlen_triton(q, k, v, g, beta, cu_seqlens, chunk=chunk)
    return cpr4_varlen_reference(q, k, v, g, beta, cu_seqlens, chunk=chunk)


def gdn_cpr4_varlen(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer case: sequences ``cu_seqlens[b]:cu_seqlens[b+1]`` each from the zero state;
    returns o [T, H, Dv] fp32. Differentiable w.r.t. q, k, v, g, beta (version 3's backward)."""
    return chunk_form_varlen(_varlen_forward, q, k, v, g, beta, cu_seqlens, chunk, "gdn_cpr4_varlen")


def gdn_cpr4_engine(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK,
                    host: HostPlan | None = None) -> torch.Tensor:
    """Engine prefill: any number of new tokens per sequence (``cu_seqlens_q``), sequence b
    continuing from state slot ``slots[b]``; updates ``state`` in place, returns o [T, H, Dv] fp32,
    bitwise equal to the trainer rows of the same positions. ``host``: the same layout on the host
    (``HostPlan``), which spares the readbacks."""
    with torch.no_grad():
        if want_triton(v):
            return cpr4_engine_triton(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk=chunk, host=host)
        return cpr4_engine_reference(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk=chunk, host=host)


def gdn_cpr4_decode(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode: one token per lane from slot ``slots[b]``; updates ``state``, returns
    o [B, H, Dv] fp32. CUDA-graph capturable on the GPU (no host sync)."""
    with torch.no_grad():
        if want_triton(v):
            return cpr4_decode_triton(q, k, v, g, beta, slots, state, chunk=chunk)
        return cpr4_decode_reference(q, k, v, g, beta, slots, state, chunk=chunk)


__all__ = ["gdn_cpr4_varlen", "gdn_cpr4_engine", "gdn_cpr4_decode"]
