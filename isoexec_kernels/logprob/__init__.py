"""Token logprobs and log-softmax with a fixed vocabulary reduction order.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Constant, Impl
from .api import log_softmax, token_logprobs
from .reference import REF_LEAF_V, log_softmax_reference, token_logprobs_reference
from .triton_kernels import BLOCK_V, log_softmax_triton, token_logprobs_triton
from .native import log_softmax_native, token_logprobs_native

__all__ = [
    "IMPLS",
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

IMPLS = (
    Impl("logprob_fixed", "1", "logprob", token_logprobs,
         constants={"BLOCK_V": Constant(4096, (1024, 2048, 4096), fixed=BLOCK_V)},
         hazards=("v_not_tile_multiple", "ties"),
         doc="fp32 online max/sum-exp over fixed vocabulary blocks in order"),
    Impl("torch_log_softmax", "torch", "logprob", token_logprobs_native, native=True),
)
