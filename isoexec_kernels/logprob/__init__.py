"""Token logprobs and log-softmax with a fixed vocabulary reduction order.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).
"""

from .api import log_softmax, token_logprobs
from .reference import REF_LEAF_V, log_softmax_reference, token_logprobs_reference
from .triton_kernels import BLOCK_V, log_softmax_triton, token_logprobs_triton
from .native import log_softmax_native, token_logprobs_native

__all__ = [
    "log_softmax",
    "token_logprobs",
    "REF_LEAF_V",
    "log_softmax_reference",
    "token_logprobs_reference",
    "BLOCK_V",
    "log_softmax_triton",
    "token_logprobs_triton",
    "log_softmax_native",
    "token_logprobs_native",
]
