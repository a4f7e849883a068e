"""Batch-invariant causal attention over packed (trainer) and paged (engine) KV.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

``triton_kernels.py`` imports triton itself, so ``api.py`` imports it only on the CUDA path (triton
is optional on a CPU machine).
"""

from .api import (
    BLOCK_N,
    attention_constants,
    compute_slot_mapping,
    paged_decode_attention,
    paged_prefill_attention,
    varlen_attention,
    write_kv_pages,
)
from .reference import naive_attention_float64, paged_attention_reference, varlen_attention_reference
from .native import attention_native_paged_decode, attention_native_paged_prefill, attention_native_varlen

__all__ = [
    "BLOCK_N",
    "attention_constants",
    "compute_slot_mapping",
    "paged_decode_attention",
    "paged_prefill_attention",
    "varlen_attention",
    "write_kv_pages",
    "naive_attention_float64",
    "paged_attention_reference",
    "varlen_attention_reference",
    "attention_native_paged_decode",
    "attention_native_paged_prefill",
    "attention_native_varlen",
]
