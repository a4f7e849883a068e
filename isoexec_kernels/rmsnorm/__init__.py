"""RMSNorm (Qwen3 and Qwen3.5 styles), batch invariant, forward and backward.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).
"""

from .api import rms_norm
from .reference import DW_ROW_LEAF, rms_norm_reference, rms_norm_backward_reference
from .triton_kernels import rms_norm_triton, rms_norm_backward_triton
from .native import rms_norm_native

__all__ = [
    "rms_norm",
    "DW_ROW_LEAF",
    "rms_norm_reference",
    "rms_norm_backward_reference",
    "rms_norm_triton",
    "rms_norm_backward_triton",
    "rms_norm_native",
]
