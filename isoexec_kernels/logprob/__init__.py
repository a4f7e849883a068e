"""Token logprobs and log-softmax with a fixed vocabulary reduction order."""

from ..impl import Constant, Impl
from .api import log_softmax, token_logprobs
from .reference import REF_LEAF_V, log_softmax_reference, token_logprobs_reference
from . import shards, triton_shards
from .triton_kernels import BLOCK_V, log_softmax_triton, token_logprobs_triton
from .native import log_softmax_native, token_logprobs_native

IMPLS = (
    Impl("logprob_fixed", "1", "logprob", token_logprobs,
         constants={"BLOCK_V": Constant(4096, (1024, 2048, 4096), fixed=BLOCK_V)},
         hazards=("v_not_tile_multiple", "ties"),
         doc="fp32 online max/sum-exp over fixed vocabulary blocks in order"),
    Impl("torch_log_softmax", "torch", "logprob", token_logprobs_native, native=True),
)

# The whole fp32 log-softmax row of each logprob impl, by the same rounding schedule as its token
# function (api.py docstring: logprob_t and log_softmax_j are both (z - m) - lse_rel of one row
# statistic), so row[t] of a row equals the token logprob of t bit for bit. Looked up by impl id
# (``DenseModel.log_softmax_from_logits``) rather than declared as a case callable, because the
# contract binds one callable per (region, case) and the full row is an optional extra output of
# that same region, not a different numerical policy; ``engine_full_vocab`` checks row[t] == token.
FULL_ROWS = {"logprob_fixed": log_softmax, "torch_log_softmax": log_softmax_native}

__all__ = [name for name in dir() if not name.startswith("_")]
