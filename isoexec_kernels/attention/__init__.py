"""Batch-invariant causal attention over packed (trainer) and paged (engine) KV.

``triton_kernels.py`` imports triton itself, so ``api.py`` imports it only on the CUDA path (triton
is optional on a CPU machine).
"""

from ..impl import Constant, Impl, per_case
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
from .flex_paged import attention_flex_paged_decode, attention_stock_paged_decode

_PAGED = frozenset({"grad", "cuda_graph", "paged"})
IMPLS = (
    Impl("attention_fixed_walk", "1", "attention",
         per_case(varlen_attention, paged_prefill_attention, paged_decode_attention),
         constants={"BLOCK_N": Constant(64, fixed=BLOCK_N)}, capabilities=_PAGED, hazards=("len_not_tile_multiple",),
         doc="KV blocks of BLOCK_N at absolute positions walked in order with an fp32 online softmax"),
    Impl("torch_sdpa", "torch", "attention",
         per_case(attention_native_varlen, attention_native_paged_prefill, attention_native_paged_decode),
         capabilities=_PAGED, native=True,
         doc="engine decode: page gather + FlashAttention-2 varlen on a GPU (gather_flash)"),
    # the same stock twin with engine decode on torch's flex_attention on a GPU, reading the paged
    # cache in place through a BlockMask built from the block table (flex_paged.py); the native
    # composition pins this one since the H200 measured it 2.0-3.1x faster than the page gather
    # (configs/compositions/native.yaml; `isoexec bench attention` times both)
    Impl("torch_flex_decode", "torch", "attention",
         per_case(attention_native_varlen, attention_native_paged_prefill, attention_stock_paged_decode),
         capabilities=_PAGED, native=True,
         doc="engine decode: compiled flex_attention over the paged cache on CUDA, the page gather elsewhere; "
             "trainer and prefill as torch_sdpa"),
)

__all__ = [name for name in dir() if not name.startswith("_")]
