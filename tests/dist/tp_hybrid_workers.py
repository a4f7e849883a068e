"""What each rank of the tensor-parallel hybrid model tests runs (test_tp_hybrid_model.py).

``world_cases(job, rank)`` runs in the world of 4 gloo processes that the dense model's tests use
(worlds.py, part ``tp_hybrid``): every rank runs at TP = 2 in its pair's group ([0, 1] or [2, 3])
and at TP = 4 in the whole world. Each time it builds the same random ``hybrid_tp_tiny`` model
(Gated DeltaNet, gated attention, Gated DeltaNet) from a seed, installs the ``isoexec_tp4``
contract (K_LEAVES = 4 on o_proj, down_proj and the Gated DeltaNet out_proj; tp claimed 1/2/4),
cuts it with ``TensorParallelHybrid`` and keeps:

- per dtype and trainer case, the hidden states, its vocabulary slice of the logits and the token
  logprobs of packed sequences, one longer than the Gated DeltaNet chunk (64), so the core's
  boundary-state chain runs too;
- per dtype, what an ``Engine`` on its shards serves (four of the dense engine test's requests and
  two long ones that cross the chunk boundary in prefill and in decode), and in fp32 again after a
  weight update from full weights;
- the negative control (fp32): the same cut with the row-parallel sums all-reduced;
- refusals inside the group: a tp the contract does not claim, and a model whose heads tp does
  not divide.

The test compares them with the single-process ``HybridModel`` (and its engine) under the same
contract, computed in the test process. Contracts and model configs come built in the job.
"""

from __future__ import annotations

import dataclasses
import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tp_engine_workers as ew  # noqa: E402
import tp_model_workers as tw  # noqa: E402
from isoexec.contract import decode, encode  # noqa: E402
from isoexec.engine import SamplingParams  # noqa: E402
from isoexec.model import tp_dense, tp_hybrid  # noqa: E402

MODEL, COMPOSITION = "hybrid_tp_tiny", "isoexec_tp4"
# one sequence longer than the Gated DeltaNet chunk of 64 tokens (a complete chunk, then a partial one)
LENGTHS = (70, 2, 9)
BUILDS = ((COMPOSITION, MODEL), ("isoexec", MODEL))


def heads_variant(cfg):
    """``hybrid_tp_tiny`` with 2 kv heads and 2 Gated DeltaNet key heads (4 value heads of 128, so
    out_proj keeps K = 512): TP = 2 cuts it, TP = 4 divides neither."""
    return dataclasses.replace(cfg, num_kv_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_value_head_dim=128)


def model_and_contract(dtype, composition=COMPOSITION, cfg=None):
    return tw.model_and_contract(dtype, composition, MODEL, cfg)


def make_job() -> dict:
    """The contracts (encoded) and model configs of ``BUILDS``, built once in the test process."""
    return {"built": {key: (encode(c), cfg) for key in BUILDS for c, cfg in [tw._contract_and_config(*key)]}}


N_SHORT = 4   # of the dense engine test's requests (greedy, top-p, top-k, greedy): the engine's GDN
# reference core is the slow part of these tests


def requests(vocab_size: int):
    """The first ``N_SHORT`` of the dense engine test's requests, with two long ones after the
    first two: a 70-token prompt (prefilled in chunks across the Gated DeltaNet chunk boundary) and
    a 58-token prompt whose decode crosses it. With the engine's 6 pages of 16 tokens the long ones
    make the scheduler preempt a running sequence."""
    prompts, params = (x[:N_SHORT] for x in ew.requests(vocab_size))
    g = torch.Generator().manual_seed(tw.SEED + 9)
    for i, (n, temperature) in enumerate(((70, 1.0), (58, 0.0))):
        prompts.insert(2 + i, torch.randint(0, vocab_size, (n,), generator=g).tolist())
        params.insert(2 + i, SamplingParams(temperature=temperature, seed=2000 + n, max_tokens=10))
    return prompts, params


# the dense engine test's pool (6 pages of 16 tokens, 4 sequences, chunks of 16) with 64 tokens per
# step: every step with a prefill chunk runs the reference GDN core's 64-token chunk loop, so fewer
# such steps keep the test fast; the 70-token prompt is still prefilled in two chunks, one crossing
# the GDN chunk boundary
ENGINE = dict(ew.ENGINE, max_num_batched_tokens=64)
# the engine's weight update is served in fp32 (bf16: the first run only, for time)
UPDATE = {"fp32": True, "bf16": False}


def serve(model, contract, dtype) -> dict:
    dt = {d: k for k, d in tw.DTYPES.items()}[dtype]
    return ew.serve(model, contract, dtype, UPDATE[dt], model_name=MODEL, reqs=requests, engine_config=ENGINE)


def _all_reduced(fn):
    """Run ``fn()`` with the row-parallel linear replaced by the stock one, in tp_dense, where every
    tensor-parallel model's row-parallel regions (the attention and Gated DeltaNet layers' and the
    MLP's) call it (``TensorParallelDense._row_parallel``)."""
    real = tp_dense.row_parallel_linear
    tp_dense.row_parallel_linear = tw._stock_row_parallel
    try:
        return fn()
    finally:
        tp_dense.row_parallel_linear = real


def cases(group=None) -> dict:
    """Everything one rank computes on the tensor-parallel ``group`` (None: one process, or the
    default group)."""
    res = {}
    for dt, dtype in tw.DTYPES.items():
        model, contract = model_and_contract(dtype)
        tpm = tp_hybrid.TensorParallelHybrid(model, group)
        res[f"{dt}/vocab_range"] = tpm.vocab_range
        for case in tw.CASES:
            res[f"{dt}/{case}"] = tw.forward(tpm, case, LENGTHS)
        res[f"{dt}/engine"] = serve(tpm, contract, dtype)
        if dist.is_initialized() and dtype == torch.float32:
            res[f"{dt}/stock_all_reduce"] = _all_reduced(lambda: tw.forward(tpm, "trainer_score", LENGTHS))
    # refusals inside a real group, before any collective: every rank raises, none waits
    f32 = tw.DTYPES["fp32"]
    res["refuse/unclaimed_tp"] = tw._refusal(lambda: tp_hybrid.TensorParallelHybrid(
        model_and_contract(f32, "isoexec")[0], group))
    built_cfg = tw._contract_and_config(COMPOSITION, MODEL)[1]
    res["refuse/heads"] = tw._refusal(lambda: tp_hybrid.TensorParallelHybrid(
        model_and_contract(f32, cfg=heads_variant(built_cfg))[0], group))
    return res


def world_cases(job: dict, rank: int) -> dict:
    """One rank of the world of 4: {2: its pair's cases, 4: the world's}."""
    tw._built.update({key: (decode(c), cfg) for key, (c, cfg) in job["built"].items()})
    pairs = [dist.new_group(p) for p in tw.PAIRS]  # every rank creates every group
    return {2: cases(pairs[rank // 2]), 4: cases(None)}
