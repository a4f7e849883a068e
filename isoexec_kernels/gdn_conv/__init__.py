"""Gated DeltaNet short convolution: depthwise causal conv1d over packed tokens, then SiLU.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).
"""

from .api import causal_conv1d_decode, causal_conv1d_engine, causal_conv1d_varlen, update_conv_state
from .reference import causal_conv1d_reference, conv_windows_reference
from .triton_kernels import causal_conv1d_triton
from .native import conv1d_native_decode, conv1d_native_engine, conv1d_native_varlen

__all__ = [
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
