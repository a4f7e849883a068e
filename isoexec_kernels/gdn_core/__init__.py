"""Gated DeltaNet core by CPR (chunkwise-parallel recurrent): one rounding schedule for the trainer,
engine prefill (split anywhere) and engine decode.

Besides the usual files (``isoexec_kernels/__init__.py``): ``state.py`` (the engine's per-slot state
and the chunk size), ``plan.py`` (argument checks and host-side planning shared by the twins),
``chunk_form.py`` (the gated delta rule in stock torch ops: the stock twin's CPU path and the
backward of every trainer path), ``chunk_backward.py`` (that backward as fused Triton kernels, used
on CUDA, and its torch reference twin), ``native.py`` (the stock twin) and ``native_wy.py`` (its
chunk forward on CUDA in the WY form of stock kernels, and that forward's torch twin);
``cpr_chunk.py`` (with ``cpr_row_decode.py`` and the twin ``cpr_chunk_reference.py``, behind
``cpr4_api.py``) is CPR version 4, impl ``gdn_cpr_chunk``: every output from the chunk form on those
kernels (docs/cpr.md), which the IsoExec compositions bind for the hybrid and hybrid_moe families since
their gates and DAPO runs on the H200 (``e99f7c8``-``b751fd1``, ``22395ec``); version 3 (``gdn_cpr``)
stays registered and accepted.
"""

from ..impl import Constant, Impl, per_case
from .state import CHUNK, GDNState
from .plan import HostPlan
from .api import gdn_cpr_decode, gdn_cpr_engine, gdn_cpr_varlen
from .reference import (
    chunk_update_reference,
    gdn_cpr_decode_reference,
    gdn_cpr_engine_reference,
    gdn_cpr_varlen_reference,
)
from .triton_kernels import BLOCK_DK, BLOCK_DV, gdn_cpr_decode_triton, gdn_cpr_engine_triton, gdn_cpr_varlen_triton
from .chunk_form import torch_chunk_form, torch_recurrence
from .chunk_backward import chunk_backward_reference, chunk_backward_triton
from .native import gdn_chunk_engine, gdn_chunk_varlen, gdn_recurrent_decode, gdn_recurrent_engine, gdn_recurrent_varlen
from .cpr4_api import gdn_cpr4_decode, gdn_cpr4_engine, gdn_cpr4_varlen

IMPLS = (
    Impl("gdn_cpr", "3", "gdn_core", per_case(gdn_cpr_varlen, gdn_cpr_engine, gdn_cpr_decode),
         constants={"CHUNK": Constant(CHUNK, arg="chunk")},
         doc="gated delta rule in chunks of CHUNK tokens at absolute positions; the engine keeps the "
             "partial chunk in its state slot so every split gives the trainer's bits"),
    Impl("gdn_cpr_chunk", "2", "gdn_core", per_case(gdn_cpr4_varlen, gdn_cpr4_engine, gdn_cpr4_decode),
         constants={"CHUNK": Constant(CHUNK, allowed=(16, 32, 64), arg="chunk")},
         doc="CPR version 4: every output from the chunk form of the native WY kernels with bf16 "
             "operands for bf16 values (decode by rows), tf32x3 dots for fp32 values (decode by "
             "prefix); the engine keeps the open chunk's rows (and their rows of Vn and T) in its "
             "state slot, so every split gives the trainer's bits"),
    Impl("gdn_chunk_native", "2", "gdn_core", per_case(gdn_chunk_varlen, gdn_chunk_engine, gdn_recurrent_decode),
         constants={"CHUNK": Constant(CHUNK, arg="chunk")}, native=True,
         doc="stock-style chunked gated delta rule (trainer, prefill) and token recurrence (decode)"),
)

__all__ = [name for name in dir() if not name.startswith("_")]
