"""The dense model under tensor parallelism keeps the bits of one process: ``TensorParallelDense``
at TP = 1 (no group), 2 and 4 (gloo, spawned) against ``DenseModel`` in one process, both under the
``isoexec_tp4`` contract (K_LEAVES = 4 on o_proj and down_proj), fp32 and bf16, trainer_score and
trainer_fwd: hidden states, logits (each rank's vocabulary slice) and token logprobs, compared
through integer views. Negative controls: the same cut with the row-parallel sums all-reduced, and
the one-process model under the 1-leaf isoexec contract. Refusals: a tp the contract does not claim
and a model whose heads and vocabulary tp cannot cut, on every rank before any collective."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import dist_workers as dw  # noqa: E402
import tp_model_workers as tw  # noqa: E402
from isoexec.enforce import RuntimeFacts  # noqa: E402
from isoexec.errors import TopologyRefused  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

SPAWNED = (2, 4)
FIELDS = ("hidden", "logits", "logprobs")


@pytest.fixture(scope="module")
def single():
    """{dtype: {case: outputs}} of the one-process DenseModel under the isoexec_tp4 contract."""
    out = {}
    for dt, dtype in tw.DTYPES.items():
        model, _ = tw.model_and_contract(dtype)
        out[dt] = {case: tw.forward(model, case) for case in tw.CASES}
    return out


@pytest.fixture(scope="module")
def worlds(tp_model_worlds):
    """{tp: [rank results]}: TP = 1 in this process (no group); TP = 2 (both pairs) and 4 from the
    world of 4 (conftest.py)."""
    return {1: [tw.cases(None)], **tp_model_worlds}


@pytest.mark.parametrize("case", tw.CASES)
@pytest.mark.parametrize("dt", list(tw.DTYPES))
def test_tp_dense_model_equals_one_process_bitwise(worlds, single, dt, case):
    want = single[dt][case]
    bad = {}
    for ws, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            got = res[f"{dt}/{case}"]
            v0, v1 = res[f"{dt}/vocab_range"]
            for field in FIELDS:
                ref = want[field][:, v0:v1] if field == "logits" else want[field]
                rep = dw.bit_report(got[field], ref)
                if rep["differing"]:
                    bad[f"TP={ws} rank {rank} {field}"] = rep
    assert not bad, f"{dt} {case}: differing elements {bad}"


def test_every_vocabulary_column_is_computed_once(worlds):
    for ws, ranks in worlds.items():
        for g0 in range(0, len(ranks), ws):  # each group of ws ranks (TP = 2: two pairs)
            bounds = [res["fp32/vocab_range"] for res in ranks[g0:g0 + ws]]
            assert bounds[0][0] == 0 and bounds[-1][1] == 4500
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), bounds


def test_stock_all_reduce_row_parallel_model_differs(worlds, single):
    """Negative control: each rank's K shard of o_proj/down_proj as one fp32 partial, summed by
    all_reduce(SUM): the model's logprobs leave the one-process bits."""
    counts = {}
    want = single["fp32"]["trainer_score"]
    for ws in SPAWNED:
        got = worlds[ws][0]["fp32/stock_all_reduce"]
        counts[f"TP={ws}"] = {f: dw.bit_report(got[f], want[f] if f != "logits" else
                                                want[f][:, slice(*worlds[ws][0]["fp32/vocab_range"])])["differing"]
                              for f in FIELDS}
    print(f"\nstock all_reduce row-parallel model (fp32), elements differing from one process: {counts}")
    assert all(c["hidden"] for c in counts.values()), f"the all-reduced model gave the one-process bits: {counts}"


def test_the_contract_leaf_count_reaches_the_one_process_model(single):
    """Control: the same model under the 1-leaf isoexec contract computes another tree (K_LEAVES
    reaches the kernel), so the equalities above are about the 4-leaf tree."""
    model, _ = tw.model_and_contract(torch.float32, "isoexec")
    got = tw.forward(model, "trainer_score")
    counts = {f: dw.bit_report(got[f], single["fp32"]["trainer_score"][f])["differing"] for f in FIELDS}
    print(f"\none process, 1 K leaf vs 4, differing elements: {counts}")
    assert counts["hidden"] > 0, counts


def test_unclaimed_tp_and_uncuttable_model_are_refused_on_every_rank(worlds):
    assert worlds[1][0]["refuse/unclaimed_tp"] == "accepted"  # one process: the isoexec contract's tp=1
    for ws in SPAWNED:
        for rank, res in enumerate(worlds[ws]):
            msg = res["refuse/unclaimed_tp"]
            assert msg.startswith("TopologyRefused"), msg
            assert f"tp={ws} is not in the proven domain [1]" in msg and "pins no K_LEAVES" in msg, msg
            msg = res["refuse/dense_tiny"]
            assert msg.startswith("TopologyRefused") and "vocabulary leaves" in msg, msg
            if ws == 4:
                assert "tp=4 does not divide the 4 query heads and 2 kv heads" in msg, msg


def test_refused_in_one_process_for_sizes_the_contract_does_not_claim():
    model, contract = tw.model_and_contract(torch.float32)
    for tp, words in ((3, ["tp=3 is not in the proven domain [1, 2, 4]", "K_LEAVES=4, which tp does not divide",
                           "tp=3 does not divide the 8 query heads and 4 kv heads"]),
                      (8, ["tp=8 is not in the proven domain [1, 2, 4]", "tp=8 does not divide"])):
        with pytest.raises(TopologyRefused) as exc:
            model.install(contract, RuntimeFacts("cpu", tp=tp))
        for w in words:
            assert w in str(exc.value), str(exc.value)


@pytest.mark.parametrize("family, model", [("dense", "dense_tp_tiny"), ("hybrid", "hybrid_tp_tiny"),
                                           ("mla_moe", "mla_moe_tp_tiny"), ("dense", "dense_qwen3_0p6b")])
def test_on_a_gpu_arch_logprob_fixed_is_served_and_the_vocabulary_must_hold_a_chunk_per_rank(family, model):
    """logprob_fixed has a vocabulary-parallel form on both arches (its Triton schedule on sm90), so
    the contract for sm90 is served at tp > 1; the Triton schedule needs a whole chunk of 4096
    logits a rank, which a vocabulary of 4500 (2 chunks) has at TP = 2 and not at 4."""
    from isoexec.compose import build_contract, load_model_config
    from isoexec.model import FAMILY_MODELS

    data = load_model_config(model)
    m = FAMILY_MODELS[family][0](FAMILY_MODELS[family][1].from_hf(data["hf_config"]))
    for arch in ("cpu", "sm90"):
        contract = build_contract(family, tw.COMPOSITION, arch, model)
        assert m.tp_problems(contract, 2) == [], (arch, m.tp_problems(contract, 2))
        problems = m.tp_problems(contract, 4)
        if arch == "sm90" and m.cfg.vocab_size < 3 * 4096 + 1:
            assert problems == [f"tp=4 is more than the 2 vocabulary chunks of 4096 logits (vocab_size="
                                f"{m.cfg.vocab_size}); on sm90 each rank needs a whole chunk of the Triton "
                                "logprob schedule"], problems
        else:
            assert problems == [], (arch, problems)
