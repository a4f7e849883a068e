"""The native composition under tensor parallelism (``native_tp4``: native.yaml's stock kernels, the
row-parallel regions with no ``K_LEAVES``, tp claimed ``variant``): the tensor-parallel models take
the row-parallel sum from the contract, the stock all-reduce here and the fixed leaf order under
``isoexec_tp4``, and run every other region's stock kernel on the rank's shard.

At TP = 2 (the world of 2, gloo, spawned; tp_native_workers.py), against the one-process models
and engines under the same contract, computed here:

- the engine on the shards (dense fp32 and bf16, hybrid, mla_moe and hybrid_moe fp32; chunked
  prefill, preemption, decode lookahead; the MoE layers' rows through the expert exchange and the
  stock MoE regions) serves tokens and logprobs close to the one-process engine's, not necessarily equal;
  both ranks serve the same bits (they step one scheduler in lock step); every row-parallel sum it
  ran was the all-reduce, none the leaf gather, and under ``isoexec_tp4`` the other way round, with
  the one-process engine's bits;
- the trainer cases: token logprobs and the gradients of a rank's shards close to one process;
- the model's o_proj region equals, bit for bit, ``torch_linear`` on the rank's K shard followed by
  ``dist.all_reduce`` written out in the worker (two computations on the same machine);
- native.yaml's MoE regions under a ``variant`` claim are served; ``native`` (tp pinned to 1) at
  TP = 2 is refused in one line on every rank before any collective.

At TP = 1 (this process, no group) the native tensor-parallel model is the one-process model bit for
bit: no collective runs and every kernel sees the whole weight.
"""

from __future__ import annotations

import dataclasses
import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import dist_workers as dw  # noqa: E402
import tp_model_workers as tw  # noqa: E402
import tp_native_workers as nw  # noqa: E402
from isoexec.engine import Engine, EngineConfig  # noqa: E402
from isoexec.enforce import RuntimeFacts, check_topology  # noqa: E402
from isoexec.errors import TopologyRefused  # noqa: E402
from isoexec.model import FAMILY_MODELS, ForwardBatch  # noqa: E402
from isoexec.model.tensor_parallel import tensor_parallel, tp_serving_problems  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

#: how close the TP = 2 logprobs must be to one process's: the stock kernels add the K of each
#: row-parallel layer in another association (each rank's half, then the two halves), a few ulps of
#: the activations; on this CPU the largest difference was 1 ulp of a logprob near 8 in fp32 and
#: 0.0078 in bf16 (whose partials are rounded to bf16 before the all-reduce)
ATOL = {"fp32": 1e-4, "bf16": 0.1}
SERVED = [(family, dt) for family, dts in nw.SERVED.items() for dt in dts]


@pytest.fixture(scope="module")
def single():
    """{(family, dtype): results} of the one-process engine, and of the dense one under isoexec_tp4."""
    out = {}
    for family, dt in SERVED:
        model, contract = nw.model_and_contract(family, tw.DTYPES[dt])
        out[family, dt] = _serve(family, model, contract)
    model, contract = nw.model_and_contract("dense", torch.float32, "isoexec_tp4")
    out["dense", "isoexec_tp4"] = _serve("dense", model, contract)
    return out


def _serve(family: str, model, contract):
    reqs, pool = nw.TRAFFIC[family]
    return Engine(model, contract, EngineConfig(**pool), trainer_contract=contract).generate(*reqs(model.cfg.vocab_size))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("family, dt", SERVED)
def test_the_native_tp_engine_serves_logprobs_close_to_one_process_by_all_reduced_sums(tp_native_worlds, single,
                                                                                        family, dt):
    ranks = [r[f"{family}/{dt}/engine"] for r in tp_native_worlds]
    want = single[family, dt]
    assert all(r["preemptions"] > 0 for r in ranks)   # the workload chunks and preempts
    # every row-parallel sum the serving made was the stock all-reduce, none the leaf gather
    for r in ranks:
        assert r["sums"]["leaves"] == 0 and r["sums"]["all_reduce"] > 0, r["sums"]
    # the two ranks drew the same tokens from the same rows: the all-reduce gives every rank one sum
    for a, b in zip(ranks[0]["results"], ranks[1]["results"], strict=True):
        assert a.ids == b.ids and dw.bit_report(a.logprobs, b.logprobs)["differing"] == 0
    # close to the one-process engine: where a sampled token differs (a near tie moved by the
    # rounding) the rest of that sequence is another one, so tokens and logprobs are compared up to it
    compared = total = 0
    worst = 0.0
    for got, w in zip(ranks[0]["results"], want, strict=True):
        assert got.ids and got.finish_reason in ("stop", "length")
        n = _common_prefix(got.ids, w.ids)
        compared, total = compared + n, total + len(w.ids)
        if n:
            worst = max(worst, float((got.logprobs[:n].double() - w.logprobs[:n].double()).abs().max()))
    assert compared >= total / 2, f"only {compared} of {total} tokens before the sequences part"
    assert worst <= ATOL[dt], f"largest |logprob difference| {worst} over {compared} tokens"


def test_an_isoexec_tp4_contract_takes_the_leaf_sum_and_serves_the_one_process_bits(tp_native_worlds, single):
    for r in tp_native_worlds:
        res = r["dense/fp32/isoexec_tp4_engine"]
        assert res["sums"]["all_reduce"] == 0 and res["sums"]["leaves"] > 0, res["sums"]
        for got, w in zip(res["results"], single["dense", "isoexec_tp4"], strict=True):
            assert got.ids == w.ids and dw.bit_report(got.logprobs, w.logprobs)["differing"] == 0


def test_the_native_row_parallel_region_is_torch_linear_on_the_shard_then_all_reduce(tp_native_worlds):
    for r in tp_native_worlds:
        got = r["dense/fp32/o_proj"]
        assert dw.bit_report(got["model"], got["written_out"])["differing"] == 0


def test_native_tp_trainer_logprobs_and_gradients_are_close_to_one_process(tp_native_worlds):
    model, _ = nw.model_and_contract("dense", torch.float32)
    ids, targets = tw.inputs(model.cfg.vocab_size, nw.LENGTHS)
    with torch.no_grad():
        score = model.token_logprobs(model.hidden_states(ids, ForwardBatch.packed(nw.LENGTHS, "trainer_score", "cpu")),
                                     targets, "trainer_score")
    for p in model.parameters():
        p.requires_grad_(True)
    model.token_logprobs(model.hidden_states(ids, ForwardBatch.packed(nw.LENGTHS, "trainer_fwd", "cpu")),
                         targets, "trainer_fwd").sum().backward()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    cols = model.cfg.q_size // nw.WORLD
    for rank, r in enumerate(tp_native_worlds):
        t = r["dense/fp32/trainer"]
        # the stock vocabulary-parallel logprob (all-reduced max, sum-exp, target logit), no rank
        # gathering whole logits rows: once for trainer_score, once for trainer_fwd
        assert t["calls"] == {"vocab_all_reduce": 2, "whole_rows": 0}, t["calls"]
        assert float((t["score"] - score).abs().max()) <= ATOL["fp32"]
        assert rel(t["grad_o"], model.layers[0].o_weight.grad[:, rank * cols:(rank + 1) * cols]) <= 1e-4
        v0, v1 = t["vocab_range"]
        # the tied embedding's rows of the rank's slice: their lookup and their whole lm_head gradient
        assert rel(t["grad_embed_own_rows"], model.embed.grad[v0:v1]) <= 1e-4


def test_contracts_the_tensor_parallel_layers_cannot_run_are_refused_on_every_rank_in_one_line(tp_native_worlds):
    assert [r["served/stock_moe"] for r in tp_native_worlds] == ["accepted"] * nw.WORLD
    for key, expect in (("refuse/native_pinned", ("tp=2 is not in the proven domain [1]",)),):
        msgs = [r[key] for r in tp_native_worlds]
        assert msgs == [msgs[0]] * nw.WORLD and "\n" not in msgs[0], msgs
        assert msgs[0].startswith("TopologyRefused: "), msgs[0]
        for text in expect:
            assert text in msgs[0], msgs[0]


@pytest.mark.parametrize("family", sorted(nw.MODELS))
def test_at_tp1_the_native_tensor_parallel_model_is_the_one_process_model(family):
    model, _ = nw.model_and_contract(family, torch.float32)
    tpm = tensor_parallel(model)
    lengths = (40, 2, 9)
    ids, targets = tw.inputs(model.cfg.vocab_size, lengths)
    batch = ForwardBatch.packed(lengths, "trainer_score", "cpu")
    with torch.no_grad():
        want = model.token_logprobs(model.hidden_states(ids, batch), targets, "trainer_score")
        got = tpm.token_logprobs(tpm.hidden_states(ids, batch), targets, "trainer_score")
    assert dw.bit_report(got, want)["differing"] == 0


@pytest.mark.parametrize("family", sorted(nw.MODELS))
def test_the_tensor_parallel_models_serve_native_tp4_at_every_claimed_size(family):
    model, contract = nw.model_and_contract(family, torch.float32)
    for tp in (1, 2, 4):
        assert tp_serving_problems(model, contract, tp) == []
        check_topology(contract, RuntimeFacts("cpu", tp=tp), tp_serving_problems(model, contract, tp))


def test_the_shape_checks_stay_under_a_variant_tp_claim():
    """dense_tiny (2 kv heads, one vocabulary leaf) cannot be cut at TP = 4 whatever sums its contract
    says; the stock kernels are not among the problems."""
    model, contract = tw.model_and_contract(torch.float32, nw.COMPOSITION, "dense_tiny")
    problems = tp_serving_problems(model, contract, 4)
    assert any("does not divide the 4 query heads and 2 kv heads" in p for p in problems), problems
    assert any("more than the 1 vocabulary leaves" in p for p in problems), problems
    assert not any("torch_" in p for p in problems), problems


def test_native_moe_kernels_under_a_variant_claim_are_served_and_an_unknown_kernel_is_refused():
    """native's MoE kernels under a variant tp claim: the tensor-parallel MoE layer runs them on the
    rows it deals out (the world test serves them at TP = 2). A region on a kernel that is neither
    the invariant one the layers reproduce nor its stock twin is refused in one line."""
    contract = nw.variant_native_moe_contract()
    moe = FAMILY_MODELS["mla_moe"][0](tw._contract_and_config("isoexec_tp4", nw.MOE_MODEL)[1])
    moe.init_random(0)
    moe.install(contract)
    tensor_parallel(moe)   # no group: tp = 1
    assert tp_serving_problems(moe, contract, 2) == []
    # the isoexec MLA attention's stock twin is torch_mla_sdpa; torch_sdpa (another family's) is neither
    entries = tuple(dataclasses.replace(e, impl=dataclasses.replace(e.impl, id="torch_sdpa"))
                    if "attn_core" in e.region else e for e in contract.composition)
    odd = dataclasses.replace(contract, composition=entries)
    problems = tp_serving_problems(moe, odd, 2)
    assert problems == ["region of attn_core runs torch_sdpa (cpu); under a variant tp claim at tp > 1 the "
                        "tensor-parallel layers run mla_expanded_walk or the stock torch_mla_sdpa"], problems
    with pytest.raises(TopologyRefused) as exc:
        check_topology(odd, RuntimeFacts("cpu", tp=2), problems)
    assert "\n" not in str(exc.value)
