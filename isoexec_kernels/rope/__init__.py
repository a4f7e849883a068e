"""Rotary position embedding (neox / rotate-half style), batch invariant.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

The fp32 cos/sin table (``rope_cos_sin``, ``rope_cache``) is built on the CPU by ``reference.py``
for every device.
"""

from .api import apply_rope
from .reference import apply_rope_reference, rope_cache, rope_cos_sin
from .triton_kernels import apply_rope_triton
from .native import apply_rope_native

__all__ = [
    "apply_rope",
    "apply_rope_reference",
    "rope_cache",
    "rope_cos_sin",
    "apply_rope_triton",
    "apply_rope_native",
]
