"""SwiGLU activation ``silu(gate) * up``, elementwise.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Impl
from .api import silu_and_mul
from .reference import silu_and_mul_reference
from .triton_kernels import silu_and_mul_triton
from .native import silu_and_mul_native

__all__ = [
    "IMPLS",
    "silu_and_mul",
    "silu_and_mul_reference",
    "silu_and_mul_triton",
    "silu_and_mul_native",
]

IMPLS = (
    Impl("silu_mul_fp32", "1", "activation", silu_and_mul, doc="elementwise: SiLU in fp32 then multiply"),
    Impl("torch_silu_mul", "torch", "activation", silu_and_mul_native, native=True),
)
