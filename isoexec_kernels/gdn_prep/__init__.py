"""Gated DeltaNet input preparation: q/k L2 norm, decay gate g and write strength beta.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).
"""

from .api import gdn_prep
from .reference import gdn_prep_reference, l2norm_reference
from .triton_kernels import gdn_prep_triton
from .native import gdn_prep_native

__all__ = [
    "gdn_prep",
    "gdn_prep_reference",
    "l2norm_reference",
    "gdn_prep_triton",
    "gdn_prep_native",
]
