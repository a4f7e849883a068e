"""Gated DeltaNet input preparation: q/k L2 norm, decay gate g and write strength beta."""

from ..impl import Impl
from .api import gdn_prep
from .reference import gdn_prep_reference, l2norm_reference
from .triton_kernels import gdn_prep_triton
from .native import gdn_prep_native

IMPLS = (
    Impl("gdn_prep_fp32", "1", "gdn_prep", gdn_prep,
         doc="fp32 q/k L2 norm with a fixed-order row sum, q scaled by Dk**-0.5; g and beta in fp32"),
    Impl("torch_gdn_prep", "torch", "gdn_prep", gdn_prep_native, native=True),
)

__all__ = [name for name in dir() if not name.startswith("_")]
