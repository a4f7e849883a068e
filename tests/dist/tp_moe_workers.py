"""What each rank of the tensor-parallel MoE model tests runs (test_tp_moe_model.py).

``world_cases(job, rank)`` runs in the world of 4 gloo processes that the dense model's tests use
(worlds.py, part ``tp_moe``): every rank runs at TP = 2 in its pair's group ([0, 1] or [2, 3]) and
at TP = 4 in the whole world. For each MoE family it builds the same random tiny model
(``mla_moe_tp_tiny``: MLA, a dense-MLP layer then a MoE layer; ``hybrid_moe_tp_tiny``: Gated
DeltaNet then gated attention, each with a MoE layer) from a seed, installs the ``isoexec_tp4``
contract (K_LEAVES = 4 on o_proj, down_proj and the Gated DeltaNet out_proj; tp claimed 1/2/4),
cuts it with ``TensorParallelMoe`` and keeps:

- per dtype and trainer case, the hidden states, its vocabulary slice of the logits and the token
  logprobs of packed sequences; in fp32 also a batch of 3 tokens, fewer than TP = 4 ranks, so a
  rank routes no row of its own in the MoE layers;
- the negative control (fp32): the same cut with the row-parallel sums all-reduced;
- refusals inside the group: a tp the contract does not claim, heads tp does not divide, more ranks
  than routed experts.

The test compares them with the single-process model under the same contract, computed in the test
process. Contracts and model configs come built in the job.
"""

from __future__ import annotations

import dataclasses
import sys

sys.modules.setdefault("fla", None)

import torch.distributed as dist  # noqa: E402

import tp_model_workers as tw  # noqa: E402
from isoexec.contract import decode, encode  # noqa: E402
from isoexec.model import tp_dense, tp_moe  # noqa: E402

COMPOSITION = "isoexec_tp4"
MODELS = {"mla_moe": "mla_moe_tp_tiny", "hybrid_moe": "hybrid_moe_tp_tiny"}
LENGTHS = (9, 2, 5)
FEW = (2, 1)   # 3 tokens: at TP = 4, rank 0 routes none of its own
BUILDS = tuple((c, m) for m in MODELS.values() for c in (COMPOSITION, "isoexec"))


def heads_variant(cfg):
    """The family's tiny TP model with 6 query heads (MLA: o_proj K = 384, leaves of 1, 2, 1, 2
    blocks; a rank's 3 heads at TP = 2 are two leaves) or 2 kv heads and 2 Gated DeltaNet key heads
    (value heads of 128): TP = 2 cuts it, TP = 4 divides no heads."""
    if hasattr(cfg, "n_routed_experts"):
        return dataclasses.replace(cfg, num_heads=6)
    return dataclasses.replace(cfg, num_kv_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_value_head_dim=128)


def experts_variant(cfg):
    """Two routed experts (both chosen): TP = 2 deals one per rank, TP = 4 cannot."""
    if hasattr(cfg, "n_routed_experts"):
        return dataclasses.replace(cfg, n_routed_experts=2, n_group=1, topk_group=1)
    return dataclasses.replace(cfg, num_experts=2)


def model_and_contract(family: str, dtype, composition=COMPOSITION, cfg=None):
    return tw.model_and_contract(dtype, composition, MODELS[family], cfg)


def make_job() -> dict:
    """The contracts (encoded) and model configs of ``BUILDS``, built once in the test process."""
    return {"built": {key: (encode(c), cfg) for key in BUILDS for c, cfg in [tw._contract_and_config(*key)]}}


def _all_reduced(fn):
    """Run ``fn()`` with every row-parallel linear (MLA's o_proj, the hybrid mixers', the dense MLP's)
    replaced by the stock all-reduce one, in tp_dense, where every tensor-parallel model's
    row-parallel regions call it (``TensorParallelDense._row_parallel``)."""
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
    f32 = tw.DTYPES["fp32"]
    for fam in MODELS:
        for dt, dtype in tw.DTYPES.items():
            model, _ = model_and_contract(fam, dtype)
            tpm = tp_moe.TensorParallelMoe(model, group)
            res[f"{fam}/{dt}/vocab_range"] = tpm.vocab_range
            res[f"{fam}/{dt}/expert_range"] = tpm.expert_range
            for case in tw.CASES:
                res[f"{fam}/{dt}/{case}"] = tw.forward(tpm, case, LENGTHS)
            if dtype == f32:
                res[f"{fam}/{dt}/few"] = tw.forward(tpm, "trainer_score", FEW)
                if dist.is_initialized():
                    res[f"{fam}/{dt}/stock_all_reduce"] = _all_reduced(
                        lambda: tw.forward(tpm, "trainer_score", LENGTHS))
        # refusals inside a real group, before any collective: every rank raises, none waits
        built_cfg = tw._contract_and_config(COMPOSITION, MODELS[fam])[1]
        res[f"{fam}/refuse/unclaimed_tp"] = tw._refusal(lambda: tp_moe.TensorParallelMoe(
            model_and_contract(fam, f32, "isoexec")[0], group))
        res[f"{fam}/refuse/heads"] = tw._refusal(lambda: tp_moe.TensorParallelMoe(
            model_and_contract(fam, f32, cfg=heads_variant(built_cfg))[0], group))
        res[f"{fam}/refuse/experts"] = tw._refusal(lambda: tp_moe.TensorParallelMoe(
            model_and_contract(fam, f32, cfg=experts_variant(built_cfg))[0], group))
    return res


def world_cases(job: dict, rank: int) -> dict:
    """One rank of the world of 4: {2: its pair's cases, 4: the world's}."""
    tw._built.update({key: (decode(c), cfg) for key, (c, cfg) in job["built"].items()})
    pairs = [dist.new_group(p) for p in tw.PAIRS]  # every rank creates every group
    return {2: cases(pairs[rank // 2]), 4: cases(None)}
