"""Multi-head latent attention in the expanded form (trainer varlen, engine paged prefill and
decode), on top of the batch-invariant attention.

Files: ``api.py`` (the public functions and the rounding schedule of the whole MLA block, which
form runs where, what the KV cache stores and why the zero padding cannot move a real element's
bits, in the module docstring), ``native.py`` (the stock twin), ``reference.py`` (float64
yardstick). The CPU path is the attention's fixed-order torch twin, the CUDA path its Triton twin.

``IMPLS`` (at the end): the ``attn_core`` implementations of the mla_moe family. Their constants
record the form in the contract: ``FORM`` expanded, ``CACHE`` expanded_kv_padded (an absorbed
latent-cache decode would be another implementation, with its own gates).
"""

from ..attention import BLOCK_N
from ..impl import Constant, Impl, per_case
from .api import (
    CACHE,
    FORM,
    expand_qkv,
    mla_paged_decode_attention,
    mla_paged_prefill_attention,
    mla_varlen_attention,
    mla_width,
    pad_heads,
    write_mla_kv_pages,
)
from .native import mla_native_paged_decode, mla_native_paged_prefill, mla_native_varlen
from .reference import mla_attention_float64

__all__ = [
    "IMPLS",
    "CACHE",
    "FORM",
    "expand_qkv",
    "mla_paged_decode_attention",
    "mla_paged_prefill_attention",
    "mla_varlen_attention",
    "mla_width",
    "pad_heads",
    "write_mla_kv_pages",
    "mla_native_paged_decode",
    "mla_native_paged_prefill",
    "mla_native_varlen",
    "mla_attention_float64",
]

_PAGED = frozenset({"grad", "cuda_graph", "paged"})
_FORM_LABELS = {"FORM": Constant(FORM), "CACHE": Constant(CACHE)}
IMPLS = (
    Impl("mla_expanded_walk", "1", "attention",
         per_case(mla_varlen_attention, mla_paged_prefill_attention, mla_paged_decode_attention),
         constants={"BLOCK_N": Constant(64, fixed=BLOCK_N), **_FORM_LABELS}, capabilities=_PAGED,
         hazards=("len_not_tile_multiple",),
         doc="MLA as expanded per-head q/k/v zero-padded to a power-of-two width, on the fixed-walk attention; "
             "the engine caches the padded expanded K and V"),
    Impl("torch_mla_sdpa", "torch", "attention",
         per_case(mla_native_varlen, mla_native_paged_prefill, mla_native_paged_decode),
         constants=dict(_FORM_LABELS), capabilities=_PAGED, native=True,
         doc="the same expansion and padding on the stock attention (SDPA / FlashAttention-2)"),
)
