"""Gated DeltaNet core by CPR (chunkwise-parallel recurrent): one rounding schedule for the trainer,
engine prefill (split anywhere) and engine decode.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin), ``state.py`` (the engine's per-slot state and the chunk size),
``plan.py`` (argument checks and host-side planning shared by the twins), ``chunk_form.py`` (the
gated delta rule in stock torch ops: the stock twin's CPU path and the backward of every trainer
path).

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Constant, Impl, per_case
from .state import CHUNK, GDNState
from .api import gdn_cpr_decode, gdn_cpr_engine, gdn_cpr_varlen
from .reference import (
    chunk_update_reference,
    gdn_cpr_decode_reference,
    gdn_cpr_engine_reference,
    gdn_cpr_varlen_reference,
)
from .triton_kernels import BLOCK_DK, BLOCK_DV, gdn_cpr_decode_triton, gdn_cpr_engine_triton, gdn_cpr_varlen_triton
from .chunk_form import torch_chunk_form, torch_recurrence
from .native import gdn_chunk_engine, gdn_chunk_varlen, gdn_recurrent_decode, gdn_recurrent_engine, gdn_recurrent_varlen

__all__ = [
    "IMPLS",
    "CHUNK",
    "GDNState",
    "gdn_cpr_decode",
    "gdn_cpr_engine",
    "gdn_cpr_varlen",
    "chunk_update_reference",
    "gdn_cpr_decode_reference",
    "gdn_cpr_engine_reference",
    "gdn_cpr_varlen_reference",
    "BLOCK_DK",
    "BLOCK_DV",
    "gdn_cpr_decode_triton",
    "gdn_cpr_engine_triton",
    "gdn_cpr_varlen_triton",
    "torch_chunk_form",
    "torch_recurrence",
    "gdn_chunk_engine",
    "gdn_chunk_varlen",
    "gdn_recurrent_decode",
    "gdn_recurrent_engine",
    "gdn_recurrent_varlen",
]

IMPLS = (
    Impl("gdn_cpr", "1", "gdn_core", per_case(gdn_cpr_varlen, gdn_cpr_engine, gdn_cpr_decode),
         constants={"CHUNK": Constant(CHUNK, arg="chunk")},
         doc="gated delta rule in chunks of CHUNK tokens at absolute positions; the engine keeps the "
             "partial chunk in its state slot so every split gives the trainer's bits"),
    Impl("gdn_chunk_native", "1", "gdn_core", per_case(gdn_chunk_varlen, gdn_chunk_engine, gdn_recurrent_decode),
         constants={"CHUNK": Constant(CHUNK, arg="chunk")}, native=True,
         doc="stock-style chunked gated delta rule (trainer, prefill) and token recurrence (decode)"),
)
