"""Gated DeltaNet input preparation: q/k L2 norm, decay gate g and write strength beta.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Impl
from .api import gdn_prep
from .reference import gdn_prep_reference, l2norm_reference
from .triton_kernels import gdn_prep_triton
from .native import gdn_prep_native

__all__ = [
    "IMPLS",
    "gdn_prep",
    "gdn_prep_reference",
    "l2norm_reference",
    "gdn_prep_triton",
    "gdn_prep_native",
]

IMPLS = (
    Impl("gdn_prep_fp32", "1", "gdn_prep", gdn_prep,
         doc="fp32 q/k L2 norm with a fixed-order row sum, q scaled by Dk**-0.5; g and beta in fp32"),
    Impl("torch_gdn_prep", "torch", "gdn_prep", gdn_prep_native, native=True),
)
