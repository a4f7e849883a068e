"""SwiGLU activation ``silu(gate) * up``, elementwise.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).
"""

from .api import silu_and_mul
from .reference import silu_and_mul_reference
from .triton_kernels import silu_and_mul_triton
from .native import silu_and_mul_native

__all__ = [
    "silu_and_mul",
    "silu_and_mul_reference",
    "silu_and_mul_triton",
    "silu_and_mul_native",
]
