"""Output gate of gated attention: ``x * sigmoid(gate)``, elementwise.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Impl
from .api import sigmoid_gate
from .reference import sigmoid_gate_reference
from .triton_kernels import sigmoid_gate_triton
from .native import sigmoid_gate_native

__all__ = [
    "IMPLS",
    "sigmoid_gate",
    "sigmoid_gate_reference",
    "sigmoid_gate_triton",
    "sigmoid_gate_native",
]

IMPLS = (
    Impl("sigmoid_gate_fp32", "1", "gate", sigmoid_gate, doc="elementwise: x * sigmoid(gate) in fp32"),
    Impl("torch_sigmoid_gate", "torch", "gate", sigmoid_gate_native, native=True),
)
