"""Output gate of gated attention: ``x * sigmoid(gate)``, elementwise."""

from ..impl import Impl
from .api import sigmoid_gate
from .reference import sigmoid_gate_reference
from .triton_kernels import sigmoid_gate_triton
from .native import sigmoid_gate_native

IMPLS = (
    Impl("sigmoid_gate_fp32", "1", "gate", sigmoid_gate, doc="elementwise: x * sigmoid(gate) in fp32"),
    Impl("torch_sigmoid_gate", "torch", "gate", sigmoid_gate_native, native=True),
)

__all__ = [name for name in dir() if not name.startswith("_")]
