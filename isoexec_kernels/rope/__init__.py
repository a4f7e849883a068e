"""Rotary position embedding (neox / rotate-half style), batch invariant.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

The fp32 cos/sin table (``rope_cos_sin``, ``rope_cache``) is built on the CPU by ``reference.py``
for every device.

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Impl
from .api import apply_rope
from .reference import apply_rope_reference, rope_cache, rope_cos_sin
from .triton_kernels import apply_rope_triton
from .native import apply_rope_native

__all__ = [
    "IMPLS",
    "apply_rope",
    "apply_rope_reference",
    "rope_cache",
    "rope_cos_sin",
    "apply_rope_triton",
    "apply_rope_native",
]

IMPLS = (
    Impl("rope_fp32", "1", "rope", apply_rope, doc="fp32 phases from absolute positions, neox rotate-half"),
    Impl("torch_rope", "torch", "rope", apply_rope_native, native=True),
)
