"""Gated output RMSNorm of Gated DeltaNet: ``rmsnorm(x) * weight * silu(gate)``."""

from ..impl import Constant, Impl
from .api import gated_rms_norm
from .reference import gated_rms_norm_reference
from .triton_kernels import gated_rms_norm_triton
from .native import gated_rms_norm_native

IMPLS = (
    Impl("gated_rmsnorm_fixed", "1", "gated_norm", gated_rms_norm, constants={"ACC_DTYPE": Constant("fp32")},
         doc="fp32 statistics in one fixed order over the head dim, then weight and SiLU(gate)"),
    Impl("torch_gated_rmsnorm", "torch", "gated_norm", gated_rms_norm_native, native=True),
)

__all__ = [name for name in dir() if not name.startswith("_")]
