"""Output gate of gated attention: ``x * sigmoid(gate)``, elementwise.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).
"""

from .api import sigmoid_gate
from .reference import sigmoid_gate_reference
from .triton_kernels import sigmoid_gate_triton
from .native import sigmoid_gate_native

__all__ = [
    "sigmoid_gate",
    "sigmoid_gate_reference",
    "sigmoid_gate_triton",
    "sigmoid_gate_native",
]
