"""Gated DeltaNet short convolution: depthwise causal conv1d over packed tokens, then SiLU."""

from ..impl import Impl, per_case
from .api import causal_conv1d_decode, causal_conv1d_engine, causal_conv1d_varlen, update_conv_state
from .reference import causal_conv1d_reference, conv_windows_reference
from .triton_kernels import causal_conv1d_triton
from .native import conv1d_native_decode, conv1d_native_engine, conv1d_native_varlen

IMPLS = (
    Impl("conv_fixed_taps", "1", "gdn_conv", per_case(causal_conv1d_varlen, causal_conv1d_engine, causal_conv1d_decode),
         doc="depthwise causal conv: fp32 taps summed in increasing tap order, then SiLU; the engine "
             "continues each sequence from its slot's conv window"),
    Impl("torch_conv1d", "torch", "gdn_conv",
         per_case(conv1d_native_varlen, conv1d_native_engine, conv1d_native_decode), native=True,
         doc="F.conv1d per sequence + F.silu"),
)

__all__ = [name for name in dir() if not name.startswith("_")]
