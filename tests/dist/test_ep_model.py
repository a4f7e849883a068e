"""The MoE models under expert parallelism keep the bits of one process: ``ExpertParallelMoe`` of
each MoE family's tiny model (``mla_moe_tiny``: GLM style, ``hybrid_moe_tiny``: Qwen3.5-MoE style)
at EP = 1 (no process group, here, and rank 0 in a group of one), 2 and 4 (gloo, spawned: the world of 4 of
worlds.py), fp32 and bf16, each rank running its own whole sequences of one batch, against the
one-process model on the whole batch under the same ``isoexec_ep4`` contract: final hidden
states, logits and token logprobs, compared through integer views (``compare_bits``). Also: the
model's own routing, routing skewed so some ranks receive no rows and a rank holds no tokens,
top-4; a negative control that can differ (top-4, per-owner partial sums all-reduced); and the
refusals (ep unclaimed, ep above the expert count, a family without experts, other MoE kernels),
on every rank before any collective."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import ep_model_workers as ew  # noqa: E402
from isoexec.compose import build_contract  # noqa: E402
from isoexec.contract.digests import numerical_policy_digest  # noqa: E402
from isoexec.dist.partition import expert_shard_range  # noqa: E402
from isoexec.enforce import RuntimeFacts, check_topology  # noqa: E402
from isoexec.errors import BindingRefused, CompositionError, TopologyRefused  # noqa: E402
from isoexec.gates.compare import compare_bits  # noqa: E402
from isoexec.model import ForwardBatch  # noqa: E402
from isoexec.model.ep_moe import ExpertParallelMoe, cut_parameter, ep_problems  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

FIELDS = ("hidden", "logits", "logprobs")
NAMES = [f"{fam}/{v}/{dt}" for fam in ew.FAMILIES for v, dts in ew.VARIANTS.items() for dt in dts]
E = 8   # routed experts of both tiny models


@pytest.fixture(scope="module")
def single():
    """{name: outputs} of the one-process model on the whole batch, under the same contract."""
    return {name: ew.forward(ew.build(name.split("/")[0], name.split("/")[2], name.split("/")[1]), 0,
                             len(ew.SEQUENCES)) for name in NAMES}


@pytest.fixture(scope="module")
def single_train():
    """{name: trainer_fwd logprobs and gradients} of the one-process model on the whole batch, for
    the ``BACKWARD`` cases; and the fp32 gradients of the bf16 cases' models (the reference their
    rounding is measured against)."""
    out = {}
    for fam in ew.FAMILIES:
        for variant, dt in ew.BACKWARD + tuple((v, "fp32") for v, _ in ew.BACKWARD):
            if f"{fam}/{variant}/{dt}" not in out:
                out[f"{fam}/{variant}/{dt}"] = ew.gradients(ew.build(fam, dt, variant), 0, len(ew.SEQUENCES))
    return out


@pytest.fixture(scope="module")
def worlds(ep_model_worlds):
    """{ep: {group: [rank results]}}: EP = 1 here without a process group (group "alone"), and
    every group of the world of 4 (conftest.py)."""
    out = {ep: dict(groups) for ep, groups in ep_model_worlds.items()}
    out[1]["alone"] = [ew.cases(None)]
    return out


def _gathered(ranks, name: str) -> dict:
    """A group's outputs, its ranks' in rank order: the whole batch (ranks hold contiguous runs of
    sequences)."""
    seqs = [r[name]["sequences"] for r in ranks]
    assert seqs[0][0] == 0 and seqs[-1][1] == len(ew.SEQUENCES), seqs
    assert all(a[1] == b[0] for a, b in zip(seqs, seqs[1:])), seqs
    return {f: torch.cat([r[name][f] for r in ranks]) for f in FIELDS}


@pytest.mark.parametrize("name", NAMES)
def test_ep1_ep2_ep4_models_equal_the_one_process_model_bitwise(single, worlds, name):
    want = single[name]
    reports = {}
    for ep, groups in worlds.items():
        for members, ranks in groups.items():
            got = _gathered(ranks, name)
            for f in FIELDS:
                reports[f"EP={ep} group {members} {f}"] = compare_bits(got[f], want[f])
    bad = {k: r.as_dict() for k, r in reports.items() if r.differing}
    assert not bad, f"{name}: differing elements {bad}"
    assert len(reports) == 3 * (1 + 1 + 2 + 1)   # alone, rank 0's group of one, two pairs, the world
    assert want["logprobs"].numel() == sum(ew.SEQUENCES) and want["logprobs"].isfinite().all()


def test_the_whole_batch_on_every_rank_gives_every_rank_the_one_process_bits(single, worlds):
    """The other way to give ranks tokens: every rank holds the whole batch (each owner then gets
    every routed row ep times); every rank's outputs are the one-process model's."""
    for fam in ew.FAMILIES:
        want = single[f"{fam}/model/fp32"]
        for ep, groups in worlds.items():
            for members, ranks in groups.items():
                for res in ranks:
                    got = res[f"{fam}/whole_batch"]
                    bad = {f: compare_bits(got[f], want[f]).as_dict() for f in FIELDS
                           if compare_bits(got[f], want[f]).differing}
                    assert not bad, (fam, ep, members, bad)


def test_each_rank_holds_its_own_experts_and_sequences(worlds):
    """A rank of EP = ep holds experts ``expert_shard_range(8, ep, rank)`` of every MoE layer (the
    ranges tile the experts in rank order) and its run of sequences; at EP = 4 the six sequences
    are dealt 1, 2, 1, 2."""
    for ep, groups in worlds.items():
        for ranks in groups.values():
            for rank, res in enumerate(ranks):
                assert res["glm/model/fp32"]["expert_range"] == expert_shard_range(E, ep, rank)
                assert res["qwen/model/fp32"]["expert_rows"] == [len(range(*expert_shard_range(E, ep, rank)))] * 4
                assert res["glm/model/fp32"]["expert_rows"] == [len(range(*expert_shard_range(E, ep, rank)))] * 2
    assert [r["qwen/model/fp32"]["sequences"] for r in worlds[4][(0, 1, 2, 3)]] == [(0, 1), (1, 3), (3, 4), (4, 6)]


@pytest.mark.parametrize("fam", ew.FAMILIES)
def test_skewed_routing_leaves_ranks_without_rows_and_a_rank_without_tokens(worlds, fam):
    """The ``skewed`` cases do what they claim, in every MoE layer: the tokens of every rank are
    routed to experts 0-2 only, so at EP = 2 rank 1 and at EP = 4 ranks 2 and 3 receive no rows;
    and the last rank of a group holds no sequence (its forward runs on T = 0 and still takes
    part in every layer's exchange)."""
    for dt in ew.VARIANTS["skewed"]:
        name = f"{fam}/skewed/{dt}"
        for ep, groups in worlds.items():
            for members, ranks in groups.items():
                layers = len(ranks[0][name]["experts_used"])
                assert layers == (2 if fam == "glm" else 4), layers
                for i in range(layers):
                    used = set().union(*(r[name]["experts_used"][i] for r in ranks))
                    assert used and used <= {0, 1, 2}, (name, members, i, used)
                    idle = [q for q in range(ep) if not used & set(range(*expert_shard_range(E, ep, q)))]
                    assert idle == {1: [], 2: [1], 4: [2, 3]}[ep], (name, members, i, idle)
                if ep > 1:
                    last = ranks[-1][name]
                    assert last["hidden"].shape[0] == 0 and last["experts_used"] == [[]] * layers


def test_negative_control_all_reduced_owner_partials_differ(single, worlds):
    """The stock combine (each rank sums its own experts' weighted rows, the partials added by
    all_reduce(SUM)) in the top-4 model, the whole batch on every rank: at EP = 2 and 4 the fp32
    hidden states and logits leave the one-process bits, so the comparisons above could fail; at
    EP = 1 there is nothing to group and it equals one process. The few target logprobs are
    reported, not asserted: a log-softmax over logits a few ulps off may round back to the same
    bits (seen on the CI machine: glm at EP = 4, 873 hidden and 9,418 logits differing, 0 of the
    logprobs)."""
    counts = {}
    for fam in ew.FAMILIES:
        want = single[f"{fam}/top4/fp32"]
        for ep, groups in worlds.items():
            for members, ranks in groups.items():
                if members == "alone":
                    continue
                got = ranks[0][f"{fam}/stock_all_reduce"]
                for res in ranks[1:]:   # the same on every rank of the group
                    assert not compare_bits(res[f"{fam}/stock_all_reduce"]["logprobs"], got["logprobs"]).differing
                rep = {f: compare_bits(got[f], want[f]).differing for f in FIELDS}
                counts[f"{fam} EP={ep} {members}"] = rep
                if ep == 1:
                    assert rep == {f: 0 for f in FIELDS}, (fam, members, rep)
                else:
                    assert rep["hidden"] > 0 and rep["logits"] > 0, (fam, members, rep)
    print(f"\nstock all-reduce combine, top-4, fp32: differing of {sum(ew.SEQUENCES)} logprobs / "
          f"{sum(ew.SEQUENCES) * 64} hidden / {sum(ew.SEQUENCES) * 512} logits: {counts}")


def test_unclaimed_ep_and_too_few_experts_are_refused_on_every_rank(worlds):
    """Inside real groups, before any collective (the world went on to the next cases): the
    isoexec contract (ep pinned to 1) at EP = 2 and 4, and three routed experts at EP = 4 (a rank
    would own none; 1 + 2 at EP = 2 is accepted)."""
    for ep, groups in worlds.items():
        for ranks in groups.values():
            for res in ranks:
                for fam in ew.FAMILIES:
                    msg = res[f"refuse/{fam}/unclaimed_ep"]
                    if ep == 1:
                        assert msg == "accepted", msg
                    else:
                        assert msg.startswith("TopologyRefused"), msg
                        assert f"ep={ep} is not in the proven domain [1]" in msg, msg
                msg = res["refuse/qwen/three_experts"]
                if ep < 4:
                    assert msg == "accepted", msg
                else:
                    assert msg.startswith("TopologyRefused") and "ep=4 is more than the 3 routed expert(s)" in msg, msg


def test_refused_in_one_process_with_the_sizes_named():
    """ep sizes the contract does not claim (3, 8), a family without routed experts, a model
    without a contract, other MoE kernels at ep > 1, and the engine cases."""
    model = ew.build("glm", "fp32")
    for ep, words in ((3, ["ep=3 is not in the proven domain [1, 2, 4]"]),
                      (8, ["ep=8 is not in the proven domain [1, 2, 4]"]),
                      (16, ["ep=16 is not in the proven domain", "ep=16 is more than the 8 routed expert(s)"])):
        with pytest.raises(TopologyRefused) as exc:
            check_topology(model.contract, RuntimeFacts("cpu", ep=ep), ep_problems(model, model.contract, ep))
        for w in words:
            assert w in str(exc.value), str(exc.value)
    from isoexec.model import DenseModel
    with pytest.raises(BindingRefused, match="the dense family has no routed experts"):
        ExpertParallelMoe(DenseModel.__new__(DenseModel))
    bare = type(model)(model.cfg)
    with pytest.raises(BindingRefused, match="install a contract on the model first"):
        ExpertParallelMoe(bare)
    native = build_contract("mla_moe", "native", "cpu", "mla_moe_tiny")
    problems = ep_problems(model, native, 2)
    assert len(problems) == 4 and all("at ep > 1 it must be moe_" in p for p in problems), problems
    assert ep_problems(model, native, 1) == []
    epm = ExpertParallelMoe(model)
    with pytest.raises(BindingRefused, match="case 'engine_prefill' is not served"):
        epm.hidden_states(torch.zeros(1, dtype=torch.long), ForwardBatch.packed([1], "engine_prefill", "cpu"))
    epm.install(ew.build("glm", "fp32", composition="isoexec").contract)   # ep = 1: the isoexec claim holds
    assert sorted(epm.plans) == ["trainer_fwd", "trainer_score"]


def test_the_ep_composition_is_the_isoexec_numerics_with_an_ep_claim():
    """``isoexec_ep4`` binds the isoexec entries for both MoE families (only the topology claim
    differs), refuses the families without experts, and one process under it computes the
    isoexec contract's bits."""
    from isoexec.contract.digests import _policy_entry

    for family, model in (("mla_moe", "mla_moe_tiny"), ("hybrid_moe", "hybrid_moe_tiny")):
        ep4, iso = build_contract(family, "isoexec_ep4", "cpu", model), build_contract(family, "isoexec", "cpu", model)
        entries = lambda c: sorted(map(str, (_policy_entry(e) for e in c.composition)))  # noqa: E731
        assert entries(ep4) == entries(iso)
        assert numerical_policy_digest(ep4) != numerical_policy_digest(iso)
        claims = {t.axis: t.domain for t in ep4.claims.topology}
        assert claims["ep"] == (1, 2, 4) and all(claims[a] == (1,) for a in claims if a != "ep")
        assert {t.axis: t.domain for t in iso.claims.topology}["ep"] == (1,)
    for family, model in (("dense", "dense_tiny"), ("hybrid", "hybrid_tiny")):
        with pytest.raises(CompositionError, match=f"does not cover the {family} family"):
            build_contract(family, "isoexec_ep4", "cpu", model)
    for fam in ew.FAMILIES:
        a = ew.forward(ew.build(fam, "fp32"), 0, len(ew.SEQUENCES))
        b = ew.forward(ew.build(fam, "fp32", composition="isoexec"), 0, len(ew.SEQUENCES))
        assert all(not compare_bits(a[f], b[f]).differing for f in FIELDS), fam


def test_shard_weights_cuts_a_full_state_dict_as_the_model_is_cut():
    """``shard_weights`` (a weight update from full one-process weights) gives a rank's experts'
    rows and the rest whole; ``cut_parameter`` deals the experts as ``expert_shard_range``."""
    model = ew.build("qwen", "fp32")
    epm = ExpertParallelMoe(model)
    full = {n: p.detach() for n, p in model.named_parameters()}
    cut = epm.shard_weights(full)
    own = dict(epm.named_parameters())
    assert cut.keys() == own.keys()
    assert all(torch.equal(cut[n], own[n]) for n in own)
    gu = full["layers.0.experts_gate_up"]
    assert [tuple(cut_parameter(model.cfg, 4, r, "layers.0.experts_gate_up", gu).shape)[0] for r in range(4)] == [2] * 4
    assert torch.equal(cut_parameter(model.cfg, 4, 3, "layers.0.experts_down", full["layers.0.experts_down"]),
                       full["layers.0.experts_down"][6:8])
    assert cut_parameter(model.cfg, 4, 3, "layers.0.router_weight", full["layers.0.router_weight"]) is \
        full["layers.0.router_weight"]


TRAIN = [f"{fam}/{v}/{dt}" for fam in ew.FAMILIES for v, dt in ew.BACKWARD]


def _group_gradients(ranks, name: str, reference: dict) -> dict:
    """The group's gradient of the whole batch's loss, per parameter, in fp64: the replicated
    parameters' gradients added over the ranks in rank order (each rank's covers its own tokens, as a
    data-parallel trainer would add them), the expert weights' slices concatenated in rank order
    (each owner's already covers every rank's rows)."""
    out = {}
    for n, ref in reference.items():
        parts = [r[name]["train"]["grads"][n] for r in ranks]
        if n.rsplit(".", 1)[-1] in ("experts_gate_up", "experts_down"):
            assert all(p is not None for p in parts), (name, n)   # zeros where an owner ran no expert
            out[n] = torch.cat(parts).double()
        elif ref is not None:
            out[n] = torch.zeros_like(ref, dtype=torch.float64)
            for p in parts:
                out[n] += 0 if p is None else p.double()
        else:
            assert all(p is None for p in parts), (name, n)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", TRAIN)
def test_trainer_fwd_logprobs_under_ep_equal_one_process_bitwise(single_train, worlds, name):
    """The forward of a training step (autograd recording the exchange) keeps the bits too."""
    want = single_train[name]["logprobs"]
    for ep, groups in worlds.items():
        for members, ranks in groups.items():
            got = torch.cat([r[name]["train"]["logprobs"] for r in ranks])
            rep = compare_bits(got, want)
            assert not rep.differing, (name, ep, members, rep.as_dict())


def test_backward_under_ep_is_deterministic_run_to_run(worlds):
    """Two backward passes of the same step on every rank of every group: the same bits (logprobs
    and every gradient), fp32 and bf16, with ranks that hold no token and owners that get no row."""
    for ep, groups in worlds.items():
        for members, ranks in groups.items():
            for rank, res in enumerate(ranks):
                for name in TRAIN:
                    assert res[name]["train"]["deterministic"], (name, ep, members, rank)


@pytest.mark.parametrize("fam", ew.FAMILIES)
def test_backward_under_ep_equals_one_process_gradients_within_rounding(single_train, worlds, fam):
    """fp32: every parameter's gradient of the whole batch's loss (replicated ones added over the
    ranks, expert slices from their owners) within 1e-4 relative L2 of the one-process gradient
    (the same terms, added in another order: the MoE input's gradient gathers its k expert rows
    in one index, the data-parallel sum adds per-rank partial gradients). bf16: no further from
    the fp32 one-process gradient than the bf16 one-process gradient is (its largest relative
    error over the parameters, times 1.5): bf16 gradients are rounded at every step, so their
    association shows more."""
    worst = {}
    for variant, dt in ew.BACKWARD:
        name = f"{fam}/{variant}/{dt}"
        ref32 = single_train[f"{fam}/{variant}/fp32"]["grads"]
        one = single_train[name]["grads"]
        bound = 1e-4 if dt == "fp32" else 1.5 * max(_rel(one[n], ref32[n]) for n in ref32 if ref32[n] is not None)
        for ep, groups in worlds.items():
            for members, ranks in groups.items():
                got = _group_gradients(ranks, name, one)
                errs = {n: _rel(g, ref32[n]) for n, g in got.items()}
                assert got.keys() == {n for n, g in one.items() if g is not None}
                bad = {n: e for n, e in errs.items() if e > bound}
                assert not bad, (name, ep, members, bound, bad)
                worst[f"{name} EP={ep}"] = max(errs.values())
    print(f"\nlargest relative L2 gradient error vs one process (fp32 reference), {fam}: "
          + ", ".join(f"{k}: {v:.2g}" for k, v in worst.items()))
