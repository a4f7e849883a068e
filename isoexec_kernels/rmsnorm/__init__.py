"""RMSNorm (Qwen3 and Qwen3.5 styles), batch invariant, forward and backward.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Constant, Impl
from .api import rms_norm
from .reference import DW_ROW_LEAF, rms_norm_reference, rms_norm_backward_reference
from .triton_kernels import rms_norm_triton, rms_norm_backward_triton
from .native import rms_norm_native

__all__ = [
    "IMPLS",
    "rms_norm",
    "DW_ROW_LEAF",
    "rms_norm_reference",
    "rms_norm_backward_reference",
    "rms_norm_triton",
    "rms_norm_backward_triton",
    "rms_norm_native",
]

IMPLS = (
    Impl("rmsnorm_fixed", "1", "norm", rms_norm, constants={"ACC_DTYPE": Constant("fp32")},
         hazards=("signed_zero", "subnormal", "noncontiguous"),
         doc="fp32 statistics, one fixed reduction order over the hidden dim"),
    Impl("torch_rmsnorm", "torch", "norm", rms_norm_native, native=True),
)
