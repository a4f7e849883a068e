"""Tensor parallelism whose bits do not depend on the parallel size (issue #15, first piece).

Tensor parallelism adds two reductions that a single process does not have: a row-parallel linear
(o_proj, down_proj) sums partial products over K held by different ranks, and a vocabulary-parallel
logprob sums exp(logits) over vocabulary slices held by different ranks. A collective that adds
(``all_reduce``) picks its order from the group size and the algorithm, so TP = 2 and TP = 4 would
give different bits, and neither the bits of one process. Here both reductions keep the
single-process schedule instead: the work is cut along the schedule's own fixed pieces (K leaves,
vocabulary leaves), each rank computes its pieces exactly as one process would, the pieces are
gathered (``all_gather``: a copy, no arithmetic) and every rank adds them in the one fixed order
of the schedule. TP = 1, 2 and 4 give the same bits as the single-process kernel
(``tests/dist/``, gloo on CPU; docs/scale_out.md).

  ``row_parallel_linear``     K sharded by whole K leaves, leaf partials gathered and summed in leaf order
  ``column_parallel_linear``  N sharded, no reduction; optionally gathered along N
  ``replicated_input``        the input of column-parallel work run by the caller (its backward sum)
  ``vocab_parallel_token_logprobs``  V sharded by whole chunks (Triton schedule) or leaves (reference)
                              of the logprob kernel, their pieces gathered and joined in order;
                              ``all_reduce_vocab_parallel_token_logprobs`` the stock all-reduce form
  ``row_shard_range``, ``column_shard_range``, ``vocab_shard_range``, ``vocab_shard_unit``  which
                              slice a rank holds
  ``expert_parallel_moe``     one MoE layer with its routed experts spread over an ep group: rows
                              sent to their expert's owner and back by all_to_all (copies), the
                              single-process router, experts and combine regions, and its backward
                              (expert_parallel.py); ``ExpertParallelGroup`` names the group for the
                              MoE model classes (``isoexec.model.ep_moe.ExpertParallelMoe``)
  ``expert_shard_range``      which experts an ep rank owns (whole contiguous ranges)

The data-parallel trainer (FSDP2) is the subpackage ``isoexec.dist.fsdp``; it sits above
``isoexec.train`` and is not imported here. ``mesh.dp_mesh`` builds its device mesh and
``partition.sequence_share`` deals out its sequences. The dense and hybrid models under tensor
parallelism are ``isoexec.model.tp_dense``, ``tp_hybrid`` and ``tp_moe`` (they need the model and
the contract, which sit above this package).

What is built and what is not: docs/scale_out.md, "What is built and what is not".
"""

from .column_parallel import column_parallel_linear, replicated_input
from .expert_parallel import ExpertParallelGroup, expert_parallel_moe
from .partition import column_shard_range, expert_shard_range, row_shard_range, vocab_shard_range, vocab_shard_unit
from .row_parallel import all_reduce_row_parallel_linear, row_parallel_linear
from .vocab_parallel_logprob import all_reduce_vocab_parallel_token_logprobs, vocab_parallel_token_logprobs

__all__ = ["ExpertParallelGroup", "all_reduce_row_parallel_linear", "all_reduce_vocab_parallel_token_logprobs", "column_parallel_linear", "column_shard_range", "expert_parallel_moe", "expert_shard_range",
           "replicated_input", "row_parallel_linear", "row_shard_range",
           "vocab_parallel_token_logprobs", "vocab_shard_range", "vocab_shard_unit"]
