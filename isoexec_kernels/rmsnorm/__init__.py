"""RMSNorm (Qwen3 and Qwen3.5 styles), batch invariant, forward and backward."""

from ..impl import Constant, Impl
from .api import rms_norm
from .reference import DW_ROW_LEAF, rms_norm_reference, rms_norm_backward_reference
from .triton_kernels import rms_norm_triton, rms_norm_backward_triton
from .native import rms_norm_native

IMPLS = (
    Impl("rmsnorm_fixed", "1", "norm", rms_norm, constants={"ACC_DTYPE": Constant("fp32")},
         hazards=("signed_zero", "subnormal", "noncontiguous"),
         doc="fp32 statistics, one fixed reduction order over the hidden dim"),
    Impl("torch_rmsnorm", "torch", "norm", rms_norm_native, native=True),
)

__all__ = [name for name in dir() if not name.startswith("_")]
