"""Gated output RMSNorm of Gated DeltaNet: ``rmsnorm(x) * weight * silu(gate)``.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Constant, Impl
from .api import gated_rms_norm
from .reference import gated_rms_norm_reference
from .triton_kernels import gated_rms_norm_triton
from .native import gated_rms_norm_native

__all__ = [
    "IMPLS",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "gated_rms_norm_triton",
    "gated_rms_norm_native",
]

IMPLS = (
    Impl("gated_rmsnorm_fixed", "1", "gated_norm", gated_rms_norm, constants={"ACC_DTYPE": Constant("fp32")},
         doc="fp32 statistics in one fixed order over the head dim, then weight and SiLU(gate)"),
    Impl("torch_gated_rmsnorm", "torch", "gated_norm", gated_rms_norm_native, native=True),
)
