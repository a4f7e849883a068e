"""Rotary position embedding (neox / rotate-half style), batch invariant.

The fp32 cos/sin table (``rope_cos_sin``, ``rope_cache``) is built on the CPU by ``reference.py``
for every device.
"""

from ..impl import Impl
from .api import apply_rope
from .reference import apply_rope_reference, rope_cache, rope_cos_sin
from .triton_kernels import apply_rope_triton
from .native import apply_rope_native

IMPLS = (
    Impl("rope_fp32", "1", "rope", apply_rope, doc="fp32 phases from absolute positions, neox rotate-half"),
    Impl("torch_rope", "torch", "rope", apply_rope_native, native=True),
)

__all__ = [name for name in dir() if not name.startswith("_")]
