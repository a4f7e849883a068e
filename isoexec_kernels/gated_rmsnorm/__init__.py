"""Gated output RMSNorm of Gated DeltaNet: ``rmsnorm(x) * weight * silu(gate)``.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).
"""

from .api import gated_rms_norm
from .reference import gated_rms_norm_reference
from .triton_kernels import gated_rms_norm_triton
from .native import gated_rms_norm_native

__all__ = [
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "gated_rms_norm_triton",
    "gated_rms_norm_native",
]
