"""Gated DeltaNet short convolution: depthwise causal conv1d over packed tokens, then SiLU.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Impl, per_case
from .api import causal_conv1d_decode, causal_conv1d_engine, causal_conv1d_varlen, update_conv_state
from .reference import causal_conv1d_reference, conv_windows_reference
from .triton_kernels import causal_conv1d_triton
from .native import conv1d_native_decode, conv1d_native_engine, conv1d_native_varlen

__all__ = [
    "IMPLS",
    "causal_conv1d_decode",
    "causal_conv1d_engine",
    "causal_conv1d_varlen",
    "update_conv_state",
    "causal_conv1d_reference",
    "conv_windows_reference",
    "causal_conv1d_triton",
    "conv1d_native_decode",
    "conv1d_native_engine",
    "conv1d_native_varlen",
]

IMPLS = (
    Impl("conv_fixed_taps", "1", "gdn_conv", per_case(causal_conv1d_varlen, causal_conv1d_engine, causal_conv1d_decode),
         doc="depthwise causal conv: fp32 taps summed in increasing tap order, then SiLU; the engine "
             "continues each sequence from its slot's conv window"),
    Impl("torch_conv1d", "torch", "gdn_conv",
         per_case(conv1d_native_varlen, conv1d_native_engine, conv1d_native_decode), native=True,
         doc="F.conv1d per sequence + F.silu"),
)
