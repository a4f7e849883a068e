"""What each rank of the Triton-schedule vocabulary-parallel logprob tests runs
(test_vocab_parallel_triton.py).

``world_cases(rank)`` runs in a world of 4 gloo processes started with ``TRITON_INTERPRET=1``
(worlds.py: Triton must be imported in interpreter mode, so this world is spawned on its own, and
the single-process kernel it is compared with runs in it too). Every rank runs at TP = 1 (a group
of itself), at TP = 2 (its pair) and at TP = 4 (the world): the Triton schedule of
``vocab_parallel_token_logprobs`` on its vocabulary slice, forward and backward, the stock
all-reduce logprob (``all_reduce_vocab_parallel_token_logprobs``) as the negative control, and the
whole rows through ``token_logprobs_triton`` and the one-row kernel's backward for the test to
compare with.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from isoexec.dist import (all_reduce_vocab_parallel_token_logprobs, vocab_parallel_token_logprobs,  # noqa: E402
                          vocab_shard_range)
from isoexec_kernels.logprob.triton_kernels import _token_logprobs_backward_triton, _triton_launch  # noqa: E402

WORLD = 4
PAIRS = ([0, 1], [2, 3])
# (name, V, dtype): 13000 is 4 chunks of 4096 (the last 712 wide; at TP = 4 one a rank, at TP = 2
# two), 12289 has a last chunk of one logit, 16384 is 4 whole chunks; at TP = 1 each is one slice
CASES = [("v13000_fp32", 13000, torch.float32), ("v13000_bf16", 13000, torch.bfloat16),
         ("v12289_bf16", 12289, torch.bfloat16), ("v16384_fp32", 16384, torch.float32)]
ROWS = 7


def inputs(i: int):
    """Logits with the hazards of the Triton schedule: the first and last token as targets, a
    target at the row max, masked (-inf) entries, a whole first chunk masked (the running max is
    -inf over a chunk: shift 0), a row whose max is +0 with a -0 target, and a row whose max lies
    in the last chunk (every earlier chunk is rescaled)."""
    _, V, dtype = CASES[i]
    g = torch.Generator().manual_seed(900 + i)
    z = torch.randn((ROWS, V), generator=g) * 4.0
    t = torch.randint(0, V, (ROWS,), generator=g)
    t[0], t[1] = 0, V - 1
    t[2] = int(z[2].argmax())
    z[3, ::7] = float("-inf")
    t[3] = 1
    z[4, :4096] = float("-inf")
    t[4] = 4096
    z[5] = -z[5].abs() - 1.0
    z[5, 5], z[5, V - 2] = -0.0, 0.0
    t[5] = 5
    z[6, V - 1] = 30.0
    dy = torch.randn((ROWS,), generator=g)
    return z.to(dtype), t, dy


def cases(group) -> dict:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    res = {}
    for i, (name, V, _) in enumerate(CASES):
        z, t, dy = inputs(i)
        v0, v1 = vocab_shard_range(V, tp, rank)
        zs = z[:, v0:v1].clone().requires_grad_()
        lp = vocab_parallel_token_logprobs(zs, t, vocab_size=V, group=group, schedule="triton")
        lp.backward(dy)
        # the whole rows in one process: the one-row kernel, forward and backward
        want, _, stats = _triton_launch(z, t, True, False, want_stats=True)
        grad = _token_logprobs_backward_triton(z, t, stats, dy)
        res[name] = {"out": lp.detach(), "grad": zs.grad, "range": (v0, v1), "want": want,
                     "want_grad": grad[:, v0:v1].contiguous(),
                     "all_reduce": all_reduce_vocab_parallel_token_logprobs(zs.detach(), t, vocab_size=V, group=group)}
    # the Triton schedule needs a whole chunk a rank: 5000 logits are 2 chunks (fewer than 4 ranks)
    a, b = vocab_shard_range(5000, tp, rank)
    try:
        vocab_parallel_token_logprobs(torch.zeros(2, b - a), torch.zeros(2, dtype=torch.long), vocab_size=5000,
                                      group=group, schedule="triton")
        res["refuse/v5000"] = "accepted"
    except ValueError as exc:
        res["refuse/v5000"] = f"ValueError: {exc}"
    return res


def world_cases(rank: int) -> dict:
    """One rank of the world of 4: {1: its own group's cases, 2: its pair's, 4: the world's}."""
    singles = [dist.new_group([r]) for r in range(WORLD)]   # every rank creates every group
    pairs = [dist.new_group(p) for p in PAIRS]
    return {1: cases(singles[rank]), 2: cases(pairs[rank // 2]), 4: cases(None)}
