"""SwiGLU activation ``silu(gate) * up``, elementwise."""

from ..impl import Impl
from .api import silu_and_mul
from .reference import silu_and_mul_reference
from .triton_kernels import silu_and_mul_triton
from .native import silu_and_mul_native

IMPLS = (
    Impl("silu_mul_fp32", "1", "activation", silu_and_mul, doc="elementwise: SiLU in fp32 then multiply"),
    Impl("torch_silu_mul", "torch", "activation", silu_and_mul_native, native=True),
)

__all__ = [name for name in dir() if not name.startswith("_")]
