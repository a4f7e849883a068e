"""The MoE models under tensor parallelism keep the bits of one process: ``TensorParallelMoe`` at
TP = 1 (no group), 2 and 4 (gloo, spawned) against the one-process ``MlaMoeModel`` (MLA, a dense-MLP
layer, a MoE layer) and ``HybridMoeModel`` (Gated DeltaNet and gated attention, each with a MoE
layer), both under the ``isoexec_tp4`` contract (K_LEAVES = 4 on the row-parallel o_proj, down_proj
and Gated DeltaNet out_proj), fp32 and bf16: trainer_score and trainer_fwd hidden states, logits
(each rank's vocabulary slice) and token logprobs, and a batch of fewer tokens than ranks. Every
comparison through integer views (``compare_bits``), 0 differing elements. Controls: the one-process
model under the 1-leaf contract, and the same cut with the row-parallel sums all-reduced, both
differ. Refusals: a tp the contract does not claim, heads tp does not divide, more ranks than
experts (on every rank, before any collective), o_proj leaves off MLA's head boundaries, kernels
not read per head or per row, another family. (The engine on these models: test_tp_moe_engine.py.)"""

from __future__ import annotations

import dataclasses
import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import tp_model_workers as tw  # noqa: E402
import tp_moe_workers as mw  # noqa: E402
from isoexec.compose import build_contract  # noqa: E402
from isoexec.enforce import RuntimeFacts  # noqa: E402
from isoexec.errors import BindingRefused, TopologyRefused  # noqa: E402
from isoexec.gates.compare import compare_bits  # noqa: E402
from isoexec.model import tp_moe  # noqa: E402
from isoexec.paths import resolve_config  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

SPAWNED = (2, 4)
FIELDS = ("hidden", "logits", "logprobs")
FAMILIES = list(mw.MODELS)


@pytest.fixture(scope="module")
def single():
    """{family: {dtype: {case: outputs}}} of the one-process models under isoexec_tp4 ("few": the
    3-token batch, fp32)."""
    out = {}
    for fam in FAMILIES:
        out[fam] = {}
        for dt, dtype in tw.DTYPES.items():
            model, _ = mw.model_and_contract(fam, dtype)
            out[fam][dt] = {case: tw.forward(model, case, mw.LENGTHS) for case in tw.CASES}
            if dt == "fp32":
                out[fam][dt]["few"] = tw.forward(model, "trainer_score", mw.FEW)
    return out


@pytest.fixture(scope="module")
def worlds(tp_moe_worlds):
    """{tp: [rank results]}: TP = 1 in this process (no group); TP = 2 (both pairs) and 4 from the
    world of 4 (conftest.py)."""
    return {1: [mw.cases(None)], **tp_moe_worlds}


def _bad(worlds, want, fam, dt, key) -> tuple[dict, int]:
    bad, compared = {}, 0
    for tp, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            got = res[f"{fam}/{dt}/{key}"]
            v0, v1 = res[f"{fam}/{dt}/vocab_range"]
            for field in FIELDS:
                rep = compare_bits(got[field], want[field][:, v0:v1] if field == "logits" else want[field])
                compared += rep.compared
                if rep.differing:
                    bad[f"TP={tp} rank {rank} {field}"] = rep
    return bad, compared


@pytest.mark.parametrize("case", tw.CASES)
@pytest.mark.parametrize("dt", list(tw.DTYPES))
@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_tp_hidden_states_logits_and_logprobs_equal_one_process_bitwise(worlds, single, fam, dt, case):
    bad, compared = _bad(worlds, single[fam][dt][case], fam, dt, case)
    assert not bad, f"{fam} {dt} {case}: differing elements {bad}"
    assert compared > 0


@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_tp_batch_of_fewer_tokens_than_ranks_equals_one_process_bitwise(worlds, single, fam):
    """3 tokens at TP = 4: rank 0 routes no row of its own, yet takes part in every exchange."""
    bad, compared = _bad(worlds, single[fam]["fp32"]["few"], fam, "fp32", "few")
    assert not bad, f"{fam}: differing elements {bad}"
    assert compared > 0


@pytest.mark.parametrize("fam", FAMILIES)
def test_every_vocabulary_column_and_every_expert_is_held_once(worlds, fam):
    for tp, ranks in worlds.items():
        for g0 in range(0, len(ranks), tp):  # each group of tp ranks (TP = 2: two pairs)
            for key, whole in (("vocab_range", 4500), ("expert_range", 8)):
                bounds = [res[f"{fam}/fp32/{key}"] for res in ranks[g0:g0 + tp]]
                assert bounds[0][0] == 0 and bounds[-1][1] == whole, (key, bounds)
                assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:])), (key, bounds)


@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_one_process_four_leaf_contract_differs_from_one_leaf(single, fam):
    """Control: the same model under the 1-leaf isoexec contract computes another tree (K_LEAVES
    reaches its row-parallel layers), so the equalities above are about the 4-leaf tree."""
    model, _ = mw.model_and_contract(fam, torch.float32, "isoexec")
    got = tw.forward(model, "trainer_score", mw.LENGTHS)
    counts = {f: compare_bits(got[f], single[fam]["fp32"]["trainer_score"][f]).differing for f in FIELDS}
    print(f"\n{fam}, one process, 1 K leaf vs 4, differing elements: {counts}")
    assert counts["hidden"] > 0, counts


@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_stock_all_reduce_row_parallel_differs(worlds, single, fam):
    """Negative control: each rank's K shard of the row-parallel layers as one fp32 partial summed
    by all_reduce(SUM): the model leaves the one-process bits."""
    want = single[fam]["fp32"]["trainer_score"]
    counts = {}
    for tp in SPAWNED:
        res = worlds[tp][0]
        v0, v1 = res[f"{fam}/fp32/vocab_range"]
        got = res[f"{fam}/fp32/stock_all_reduce"]
        counts[f"TP={tp}"] = {f: compare_bits(got[f], want[f][:, v0:v1] if f == "logits" else want[f]).differing
                              for f in FIELDS}
    print(f"\n{fam}, stock all_reduce row-parallel (fp32), elements differing from one process: {counts}")
    assert all(c["hidden"] for c in counts.values()), counts


# ------------------------------------------------------------------------------------------ refusals
HEADS_WORDS = {"mla_moe": ["tp=4 does not divide the 6 query heads and 6 kv heads"],
               "hybrid_moe": ["tp=4 does not divide the 8 query heads and 2 kv heads",
                              "tp=4 does not divide the 2 Gated DeltaNet key heads and 4 value heads"]}
UNPINNED = {"mla_moe": ("down_proj", "o_proj"), "hybrid_moe": ("gdn_out_proj", "o_proj")}


@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_unclaimed_tp_heads_and_experts_are_refused_on_every_rank(worlds, fam):
    for what in ("unclaimed_tp", "heads", "experts"):
        assert worlds[1][0][f"{fam}/refuse/{what}"] == "accepted"   # one process: tp=1
    for tp in SPAWNED:
        for rank, res in enumerate(worlds[tp]):
            msg = res[f"{fam}/refuse/unclaimed_tp"]
            assert msg.startswith("TopologyRefused") and f"tp={tp} is not in the proven domain [1]" in msg, msg
            for op in UNPINNED[fam]:
                assert f"row-parallel region {op!r} (impl gemm_fixed_k) pins no K_LEAVES" in msg, msg
            for what, words in (("heads", HEADS_WORDS[fam]),
                                ("experts", ["tp=4 is more than the 2 routed expert(s) of each MoE layer"])):
                msg = res[f"{fam}/refuse/{what}"]
                if tp == 2:
                    assert msg == "accepted", (what, msg)
                else:
                    assert msg.startswith("TopologyRefused") and msg.count("\n") == 0, msg
                    assert all(w in msg for w in words), msg


@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_refused_in_one_process_for_sizes_the_contract_does_not_claim(fam):
    model, contract = mw.model_and_contract(fam, torch.float32)
    for tp, words in ((3, ["tp=3 is not in the proven domain [1, 2, 4]",
                           "row-parallel region 'o_proj' pins K_LEAVES=4, which tp does not divide",
                           "tp=3 does not divide the 8 query heads"]),
                      (8, ["tp=8 is not in the proven domain [1, 2, 4]"])):
        with pytest.raises(TopologyRefused) as exc:
            model.install(contract, RuntimeFacts("cpu", tp=tp))
        for w in words:
            assert w in str(exc.value), str(exc.value)


def test_mla_refuses_o_proj_leaves_off_the_head_boundaries():
    """8 heads with values of 48: o_proj's K = 384 is 6 blocks in leaves of 1, 2, 1, 2 blocks. At
    TP = 2 a rank's 4 heads (192 columns) are two leaves; at TP = 4 its 2 heads (96) are not."""
    model, contract = mw.model_and_contract("mla_moe", torch.float32)
    narrow, _ = mw.model_and_contract("mla_moe", torch.float32, cfg=dataclasses.replace(model.cfg, v_head_dim=48))
    narrow.install(contract, RuntimeFacts("cpu", tp=2))
    with pytest.raises(TopologyRefused) as exc:
        narrow.install(contract, RuntimeFacts("cpu", tp=4))
    assert "o_proj's K leaves (K_LEAVES=4 over K=384) give the ranks input columns [(0, 64), (64, 192), " \
        "(192, 256), (256, 384)], not their heads' [(0, 96), (96, 192), (192, 288), (288, 384)]" in str(exc.value)


def test_moe_refuses_attention_and_experts_kernels_not_read_per_head_or_row(tmp_path):
    text = resolve_config("compositions", "isoexec_tp4").read_text()
    swaps = (("{region: [attn_core], impl: mla_expanded_walk, families: [mla_moe], constants: {BLOCK_N: 64},",
              "{region: [attn_core], impl: torch_mla_sdpa, families: [mla_moe],"),
             ("{region: [experts], impl: moe_experts_loop,", "{region: [experts], impl: torch_moe_experts,"))
    for old, new in swaps:
        assert old in text
        text = text.replace(old, new)
    p = tmp_path / "tp4_native_mla_and_experts.yaml"
    p.write_text(text)
    contract = build_contract("mla_moe", str(p), "cpu", mw.MODELS["mla_moe"])
    model, _ = mw.model_and_contract("mla_moe", torch.float32)
    model.install(contract)   # one process: any kernel
    with pytest.raises(TopologyRefused) as exc:
        model.install(contract, RuntimeFacts("cpu", tp=2))
    msg = str(exc.value)
    assert "region of attn_core runs torch_mla_sdpa (cpu); at tp > 1 it must be mla_expanded_walk" in msg, msg
    assert "region of experts runs torch_moe_experts (cpu); at tp > 1 it must be moe_experts_loop" in msg, msg


@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_tp_model_refuses_other_families(fam):
    model, _ = mw.model_and_contract(fam, torch.float32)
    other = {"mla_moe": tp_moe.TensorParallelHybridMoe, "hybrid_moe": tp_moe.TensorParallelMlaMoe}[fam]
    with pytest.raises(BindingRefused, match=f"the model is of the {fam} family"):
        other(model, None)
    dense, _ = tw.model_and_contract(torch.float32)
    with pytest.raises(BindingRefused, match="the dense family has no routed experts"):
        tp_moe.TensorParallelMoe(dense, None)


@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_shard_weights_at_tp1_are_the_full_weights(fam):
    model, _ = mw.model_and_contract(fam, torch.float32)
    tpm = tp_moe.TensorParallelMoe(model, None)
    full = dict(model.named_parameters())
    cut = tpm.shard_weights({**full, "not_a_weight": torch.zeros(1)})
    own = dict(tpm.named_parameters())
    assert set(own) == set(full) and set(cut) == set(own) | {"not_a_weight"}
    for name, t in own.items():
        assert torch.equal(cut[name], t), name


CUTS = {"mla_moe": tp_moe.cut_parameter_mla_moe, "hybrid_moe": tp_moe.cut_parameter_hybrid_moe}
COLUMN_CUT = ("o_weight", "out_weight", "down_weight")   # cut along K (dim 1)
REPLICATED = ("router_weight", "correction_bias", "shared_gate_up", "shared_down", "shared_gate", "qkv_a_weight")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_ranks_shards_cover_every_head_and_expert_once(fam, tp):
    """The ranks' shards of each cut weight add up to the whole (heads, channels, 64-column units and
    experts dealt out once); the norms, router and shared expert are whole on every rank."""
    model, _ = mw.model_and_contract(fam, torch.float32)
    for name, p in model.named_parameters():
        shards = [CUTS[fam](model.cfg, tp, r, name, p.detach()) for r in range(tp)]
        leaf = name.rsplit(".", 1)[-1]
        if name in ("embed", "final_norm") or leaf.endswith("norm") or leaf in REPLICATED:
            assert all(s.shape == p.shape for s in shards), name
            continue
        dim = 1 if leaf in COLUMN_CUT else 0
        whole = torch.cat(shards, dim=dim)
        assert whole.shape == p.shape, name
        rows = lambda t: sorted(map(tuple, t.movedim(dim, 0).reshape(t.shape[dim], -1).tolist()))  # noqa: E731
        assert rows(whole) == rows(p.detach()), name


@pytest.mark.parametrize("fam, row_parallel", [("mla_moe", {"o_proj", "down_proj"}),
                                               ("hybrid_moe", {"o_proj", "gdn_out_proj"})])
def test_the_tp_composition_pins_four_leaves_on_the_moe_families_row_parallel_regions(fam, row_parallel):
    from isoexec.contract import K_LEAVES

    for arch in ("cpu", "sm90"):
        c = build_contract(fam, "isoexec_tp4", arch, mw.MODELS[fam])
        pinned = {e.region_name: e.constants[K_LEAVES] for e in c.composition if K_LEAVES in e.constants}
        assert pinned == {o: 4 for o in row_parallel}, pinned
        (tp,) = [t for t in c.claims.topology if t.axis == "tp"]
        assert sorted(tp.domain) == [1, 2, 4] and tp.kind == "invariant"
