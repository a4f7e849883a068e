"""The hybrid model (Gated DeltaNet + gated attention) under tensor parallelism keeps the bits of one
process: ``TensorParallelHybrid`` at TP = 1 (no group), 2 and 4 (gloo, spawned) against
``HybridModel`` in one process, both under the ``isoexec_tp4`` contract (K_LEAVES = 4 on o_proj,
down_proj and the Gated DeltaNet out_proj), fp32 and bf16: trainer_score and trainer_fwd hidden
states, logits (each rank's vocabulary slice) and token logprobs, and an engine on the shards
(chunked prefill, preemption, decode lookahead; in fp32 a weight update) whose tokens and logprobs
are the one-process engine's and the one-process trainer's. Every comparison through integer views
(``compare_bits``), 0 differing elements. Controls: the one-process model under the 1-leaf
contract, and the same cut with the row-parallel sums all-reduced, both differ. Refusals: a tp the
contract does not claim, heads tp does not divide, K leaves off the heads' boundaries, a Gated
DeltaNet core other than the one read per head; on every rank, before any collective."""

from __future__ import annotations

import dataclasses
import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import tp_hybrid_workers as hw  # noqa: E402
import tp_model_workers as tw  # noqa: E402
from isoexec.compose import build_contract  # noqa: E402
from isoexec.enforce import RuntimeFacts  # noqa: E402
from isoexec.errors import BindingRefused, TopologyRefused  # noqa: E402
from isoexec.gates.compare import compare_bits  # noqa: E402
from isoexec.gates.engine_gates import verify_engine_logprobs  # noqa: E402
from isoexec.model import tp_dense, tp_hybrid  # noqa: E402
from isoexec.paths import resolve_config  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

SPAWNED = (2, 4)
FIELDS = ("hidden", "logits", "logprobs")
RUNS = ("first", "second")


@pytest.fixture(scope="module")
def single():
    """{dtype: {case: outputs, "engine": served results}} of the one-process HybridModel under the
    isoexec_tp4 contract."""
    out = {}
    for dt, dtype in tw.DTYPES.items():
        model, contract = hw.model_and_contract(dtype)
        out[dt] = {case: tw.forward(model, case, hw.LENGTHS) for case in tw.CASES}
        out[dt]["engine"] = hw.serve(model, contract, dtype)
    return out


@pytest.fixture(scope="module")
def worlds(tp_hybrid_worlds):
    """{tp: [rank results]}: TP = 1 in this process (no group); TP = 2 (both pairs) and 4 from the
    world of 4 (conftest.py)."""
    return {1: [hw.cases(None)], **tp_hybrid_worlds}


def _differing(got: torch.Tensor, want: torch.Tensor) -> int:
    return compare_bits(got, want).differing


@pytest.mark.parametrize("case", tw.CASES)
@pytest.mark.parametrize("dt", list(tw.DTYPES))
def test_hybrid_tp_hidden_states_logits_and_logprobs_equal_one_process_bitwise(worlds, single, dt, case):
    want = single[dt][case]
    bad, compared = {}, 0
    for tp, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            got = res[f"{dt}/{case}"]
            v0, v1 = res[f"{dt}/vocab_range"]
            for field in FIELDS:
                ref = want[field][:, v0:v1] if field == "logits" else want[field]
                rep = compare_bits(got[field], ref)
                compared += rep.compared
                if rep.differing:
                    bad[f"TP={tp} rank {rank} {field}"] = rep
    assert not bad, f"{dt} {case}: differing elements {bad}"
    assert compared > 0


def test_every_vocabulary_column_is_computed_once(worlds):
    for tp, ranks in worlds.items():
        for g0 in range(0, len(ranks), tp):  # each group of tp ranks (TP = 2: two pairs)
            bounds = [res["fp32/vocab_range"] for res in ranks[g0:g0 + tp]]
            assert bounds[0][0] == 0 and bounds[-1][1] == 4500
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), bounds


def test_hybrid_one_process_four_leaf_contract_differs_from_one_leaf(single):
    """Control: the same model under the 1-leaf isoexec contract computes another tree (K_LEAVES
    reaches o_proj, out_proj and down_proj), so the equalities above are about the 4-leaf tree."""
    model, _ = hw.model_and_contract(torch.float32, "isoexec")
    got = tw.forward(model, "trainer_score", hw.LENGTHS)
    counts = {f: _differing(got[f], single["fp32"]["trainer_score"][f]) for f in FIELDS}
    print(f"\nhybrid, one process, 1 K leaf vs 4, differing elements: {counts}")
    assert counts["hidden"] > 0, counts


def test_hybrid_stock_all_reduce_row_parallel_differs(worlds, single):
    """Negative control: each rank's K shard of o_proj, out_proj and down_proj as one fp32 partial
    summed by all_reduce(SUM): the model leaves the one-process bits."""
    want = single["fp32"]["trainer_score"]
    counts = {}
    for tp in SPAWNED:
        res = worlds[tp][0]
        v0, v1 = res["fp32/vocab_range"]
        got = res["fp32/stock_all_reduce"]
        counts[f"TP={tp}"] = {f: _differing(got[f], want[f][:, v0:v1] if f == "logits" else want[f]) for f in FIELDS}
    print(f"\nhybrid, stock all_reduce row-parallel (fp32), elements differing from one process: {counts}")
    assert all(c["hidden"] for c in counts.values()), counts


# ------------------------------------------------------------------------------------------ engine
def _engine_differences(want, got) -> list[str]:
    bad = []
    for x, y in zip(want, got, strict=True):
        if (x.ids, x.finish_reason) != (y.ids, y.finish_reason):
            bad.append(f"request {x.request_id}: tokens {y.ids} ({y.finish_reason}), one process {x.ids}")
        elif (rep := compare_bits(y.logprobs, x.logprobs)).differing:
            bad.append(f"request {x.request_id}: logprobs {rep}")
    return bad


def test_hybrid_engine_workload_chunks_preempts_looks_ahead_and_crosses_the_gdn_chunk(single):
    for dt in tw.DTYPES:
        res = single[dt]["engine"]
        assert res["preemptions"] > 0 and res["lookahead_steps"] > 0, (dt, res["preemptions"])
        prompts = [len(r.prompt) for r in res["first"]]
        assert max(prompts) > 64  # a prompt prefilled across the Gated DeltaNet chunk boundary
        assert any(n < 64 < n + len(r.ids) for n, r in zip(prompts, res["first"]))  # one decoded across it


@pytest.mark.parametrize("dt", list(tw.DTYPES))
def test_hybrid_tp_engine_gives_the_one_process_engine_tokens_and_logprobs_bitwise(worlds, single, dt):
    bad = {}
    runs = RUNS if hw.UPDATE[dt] else RUNS[:1]
    for tp, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            for run in runs:
                if diff := _engine_differences(single[dt]["engine"][run], res[f"{dt}/engine"][run]):
                    bad[f"TP={tp} rank {rank} {run} run"] = diff[:3]
    assert not bad, bad
    if hw.UPDATE[dt]:  # the weight update changed what is generated (the second run is not the first again)
        want = single[dt]["engine"]
        assert any(a.ids != b.ids for a, b in zip(want["first"], want["second"]))


def _served_bits(results) -> tuple:
    """What a run served, as bytes: equal keys are the same tokens and the same logprob bits."""
    return tuple((tuple(r.prompt), tuple(r.ids), r.logprobs.contiguous().view(torch.int32).numpy().tobytes())
                 for r in results)


@pytest.mark.parametrize("dt", list(tw.DTYPES))
def test_hybrid_tp_engine_logprobs_equal_the_one_process_trainer_bitwise(worlds, single, dt):
    """Generate-then-verify: the one-process trainer recomputes every token each engine served
    (one process and every rank at TP = 1, 2, 4; runs that served the same bits are scored once)."""
    first, _ = hw.model_and_contract(tw.DTYPES[dt])
    second, _ = hw.model_and_contract(tw.DTYPES[dt])
    second.init_random(hw.ew.NEW_WEIGHTS_SEED)
    served = [("one process", single[dt]["engine"])] + [
        (f"TP={tp} rank {rank}", res[f"{dt}/engine"]) for tp, ranks in worlds.items() for rank, res in enumerate(ranks)]
    for run, trainer in (("first", first), ("second", second))[:len(RUNS) if hw.UPDATE[dt] else 1]:
        verified = {}
        for who, res in served:
            key = _served_bits(res[run])
            if key not in verified:
                verified[key] = verify_engine_logprobs(trainer, res[run])
            rep = verified[key]
            assert rep.compared > 0 and rep.differing == 0, (who, run, rep)


# ------------------------------------------------------------------------------------------ refusals
def test_hybrid_unclaimed_tp_and_indivisible_heads_are_refused_on_every_rank(worlds):
    assert worlds[1][0]["refuse/unclaimed_tp"] == "accepted"  # one process: the isoexec contract's tp=1
    assert worlds[1][0]["refuse/heads"] == "accepted"
    for tp in SPAWNED:
        for rank, res in enumerate(worlds[tp]):
            msg = res["refuse/unclaimed_tp"]
            assert msg.startswith("TopologyRefused"), msg
            assert f"tp={tp} is not in the proven domain [1]" in msg and "'gdn_out_proj' (impl gemm_fixed_k) pins no " \
                "K_LEAVES" in msg, msg
            msg = res["refuse/heads"]
            if tp == 2:
                assert msg == "accepted", msg
            else:
                assert msg.startswith("TopologyRefused") and msg.count("\n") == 0, msg
                assert "tp=4 does not divide the 8 query heads and 2 kv heads" in msg, msg
                assert "tp=4 does not divide the 2 Gated DeltaNet key heads and 4 value heads" in msg, msg


def test_hybrid_refused_in_one_process_for_sizes_the_contract_does_not_claim():
    model, contract = hw.model_and_contract(torch.float32)
    for tp, words in ((3, ["tp=3 is not in the proven domain [1, 2, 4]",
                           "row-parallel region 'gdn_out_proj' pins K_LEAVES=4, which tp does not divide",
                           "tp=3 does not divide the 8 query heads and 4 kv heads",
                           "tp=3 does not divide the 4 Gated DeltaNet key heads and 8 value heads"]),
                      (8, ["tp=8 is not in the proven domain [1, 2, 4]", "tp=8 does not divide the 4 Gated DeltaNet"])):
        with pytest.raises(TopologyRefused) as exc:
            model.install(contract, RuntimeFacts("cpu", tp=tp))
        for w in words:
            assert w in str(exc.value), str(exc.value)


def test_hybrid_refuses_out_proj_leaves_off_the_value_head_boundaries():
    """8 value heads of 48: out_proj's K = 384 is 6 blocks in leaves of 1, 2, 1, 2 blocks. At TP = 2
    a rank's 4 heads (192 columns) are two leaves; at TP = 4 its 2 heads (96 columns) are not."""
    model, contract = hw.model_and_contract(torch.float32)
    cfg = dataclasses.replace(model.cfg, linear_value_head_dim=48)
    narrow, _ = hw.model_and_contract(torch.float32, cfg=cfg)
    narrow.install(contract, RuntimeFacts("cpu", tp=2))
    with pytest.raises(TopologyRefused) as exc:
        narrow.install(contract, RuntimeFacts("cpu", tp=4))
    msg = str(exc.value)
    assert "gdn_out_proj's K leaves (K_LEAVES=4 over K=384) give the ranks input columns [(0, 64), (64, 192), " \
        "(192, 256), (256, 384)], not their heads' [(0, 96), (96, 192), (192, 288), (288, 384)]" in msg, msg


def test_hybrid_refuses_a_gdn_core_whose_heads_were_not_read_per_head(tmp_path):
    text = resolve_config("compositions", "isoexec_tp4").read_text()
    old = "{region: [gdn_core], impl: gdn_cpr_chunk,"
    assert old in text
    p = tmp_path / "tp4_chunk_native.yaml"
    p.write_text(text.replace(old, "{region: [gdn_core], impl: gdn_chunk_native,"))
    contract = build_contract("hybrid", str(p), "cpu", hw.MODEL)
    model, _ = hw.model_and_contract(torch.float32)
    model.install(contract)   # one process: any core
    with pytest.raises(TopologyRefused, match="region of gdn_core runs gdn_chunk_native \\(cpu\\); at tp > 1 it "
                                              "must be gdn_cpr_chunk or gdn_cpr, the schedule"):
        model.install(contract, RuntimeFacts("cpu", tp=2))


def test_each_tensor_parallel_class_refuses_the_other_family():
    hybrid, _ = hw.model_and_contract(torch.float32)
    dense, _ = tw.model_and_contract(torch.float32)
    with pytest.raises(BindingRefused, match="tensor-parallel dense model: the model is of the hybrid family"):
        tp_dense.TensorParallelDense(hybrid, None)
    with pytest.raises(BindingRefused, match="tensor-parallel hybrid model: the model is of the dense family"):
        tp_hybrid.TensorParallelHybrid(dense, None)


def test_hybrid_shard_weights_at_tp1_are_the_full_weights_and_pass_unknown_names():
    model, _ = hw.model_and_contract(torch.float32)
    tpm = tp_hybrid.TensorParallelHybrid(model, None)
    full = dict(model.named_parameters())
    cut = tpm.shard_weights({**full, "not_a_weight": torch.zeros(1)})
    own = dict(tpm.named_parameters())
    assert set(own) == set(full)
    assert set(cut) == set(own) | {"not_a_weight"}
    for name, t in own.items():
        assert torch.equal(cut[name], t), name


@pytest.mark.parametrize("tp", [2, 4])
def test_hybrid_ranks_shards_cover_every_head_once(tp):
    """The ranks' shards of each Gated DeltaNet, attention and MLP weight add up to the whole (heads,
    conv channels and 64-column units dealt out once); the norms are whole on every rank."""
    model, _ = hw.model_and_contract(torch.float32)
    for name, p in model.named_parameters():
        shards = [tp_hybrid.cut_parameter(model.cfg, tp, r, name, p.detach()) for r in range(tp)]
        leaf = name.rsplit(".", 1)[-1]
        if name in ("embed", "final_norm") or leaf.endswith("norm"):
            assert all(s.shape == p.shape for s in shards), name
        else:
            dim = 1 if leaf in ("o_weight", "out_weight", "down_weight") else 0
            assert sum(s.shape[dim] for s in shards) == p.shape[dim], name
            # every row (column) of the whole is in exactly one shard
            whole = torch.cat(shards, dim=dim)
            assert sorted(map(tuple, (whole if dim == 0 else whole.t()).reshape(p.shape[dim], -1).tolist())) == \
                sorted(map(tuple, (p if dim == 0 else p.t()).detach().reshape(p.shape[dim], -1).tolist())), name
