"""K_LEAVES, the K leaf count of a linear region, as a contract constant, and the tp claims that
need it (docs/scale_out.md): absent from every contract that does not pin it, pinned on o_proj and
down_proj by the isoexec_tp4 composition, passed to the kernel as ``leaves=``, required (and
divisible by every claimed size) on the row-parallel regions by any tp claim above 1."""

from __future__ import annotations

import functools

import pytest

from isoexec import registry
from isoexec.compose import build_contract, load_model_config
from isoexec.contract import K_LEAVES, ROW_PARALLEL_OPS, diff
from isoexec.enforce import ExecutionPlan, RuntimeFacts
from isoexec.errors import CompositionError, ContractInvalid, TopologyRefused
from isoexec.model import build_model
from isoexec.paths import resolve_config

TP4 = resolve_config("compositions", "isoexec_tp4").read_text()


def _variant(tmp_path, old: str, new: str, count: int = -1):
    assert old in TP4, old
    p = tmp_path / "variant.yaml"
    p.write_text(TP4.replace(old, new, count))
    return str(p)


@pytest.mark.parametrize("family", list(registry.FAMILIES))
def test_unpinned_compositions_carry_no_k_leaves(family):
    """An optional constant stays out of a contract that does not pin it: the existing
    compositions' contracts (and so their bytes and identities) are what they were."""
    for comp in ("isoexec", "native"):
        c = build_contract(family, comp, "cpu")
        assert not [e.region_name for e in c.composition if K_LEAVES in e.constants]


@pytest.mark.parametrize("family, model", [("dense", "dense_tp_tiny"), ("hybrid", "hybrid_tp_tiny")])
def test_the_tp_composition_pins_four_leaves_on_the_row_parallel_regions_only(family, model):
    """One composition serves both tensor-parallel families: each family's contract pins its own
    row-parallel regions (dense: o_proj, down_proj; hybrid: also the Gated DeltaNet out_proj)."""
    ops = set(registry.family(family).ops)
    for arch in ("cpu", "sm90"):
        c = build_contract(family, "isoexec_tp4", arch, model)
        pinned = {e.region_name: e.constants[K_LEAVES] for e in c.composition if K_LEAVES in e.constants}
        assert pinned == {o: 4 for o in ROW_PARALLEL_OPS if o in ops}
        assert ("gdn_out_proj" in pinned) == (family == "hybrid")
        (tp,) = [t for t in c.claims.topology if t.axis == "tp"]
        assert sorted(tp.domain) == [1, 2, 4] and tp.kind == "invariant"
    plain = build_contract(family, "isoexec", "cpu", model)
    ds = {(d.where, d.field) for d in diff(plain, c)}
    for o in pinned:
        assert (f"region {o}, case trainer_score", f"constants.{K_LEAVES}") in ds
    assert plain.identities.numerical_policy != c.identities.numerical_policy


def test_k_leaves_reaches_the_kernel_as_leaves():
    c = build_contract("dense", "isoexec_tp4", "cpu", "dense_tp_tiny")
    plan = ExecutionPlan.build(c, "trainer_score")
    fn = plan["o_proj"].fn
    assert isinstance(fn, functools.partial) and fn.keywords == {"leaves": 4}
    assert plan["o_proj"].record.constants[K_LEAVES] == 4
    assert not isinstance(plan["q_proj"].fn, functools.partial)


@pytest.mark.parametrize("old, new, words", [
    ("{BLOCK_K: 64, K_LEAVES: 4}, discharge: gate}\n  - {region: [gate_proj",
     "{BLOCK_K: 64}, discharge: gate}\n  - {region: [gate_proj", ["tp=2, 4", "'o_proj'", "pins no K_LEAVES"]),
    ("domain: [1, 2, 4]", "domain: [1, 3]", ["tp=3", "'o_proj'", "'down_proj'", "K_LEAVES=4"]),
    ("K_LEAVES: 4}, discharge: gate}\n  - {region: [lm_head]", "K_LEAVES: 2}, discharge: gate}\n  - {region: [lm_head]",
     ["tp=4", "'down_proj'", "K_LEAVES=2"]),
])
def test_a_tp_claim_needs_a_divisible_k_leaves_on_every_row_parallel_region(tmp_path, old, new, words):
    with pytest.raises(ContractInvalid) as exc:
        build_contract("dense", _variant(tmp_path, old, new), "cpu", "dense_tp_tiny")
    for w in words:
        assert w in str(exc.value), str(exc.value)


def test_a_k_leaves_value_outside_the_allowed_ones_is_refused(tmp_path):
    with pytest.raises(CompositionError, match="K_LEAVES=3 is not allowed"):
        build_contract("dense", _variant(tmp_path, "K_LEAVES: 4}", "K_LEAVES: 3}"), "cpu", "dense_tp_tiny")


def test_install_refuses_more_leaves_than_a_region_has_k_blocks():
    """dense_tiny's o_proj has K = 64 (one block) and down_proj K = 128 (two): 4 leaves do not fit."""
    c = build_contract("dense", "isoexec_tp4", "cpu", "dense_tiny")
    m = build_model("dense", load_model_config("dense_tiny")["hf_config"])
    with pytest.raises(TopologyRefused) as exc:
        m.install(c)
    assert "K_LEAVES=4, more than the 1 K block(s) of o_proj (K=64)" in str(exc.value)
    assert "more than the 2 K block(s) of down_proj (K=128)" in str(exc.value)


def test_runtime_tp_outside_the_claim_names_every_problem():
    c = build_contract("dense", "isoexec", "cpu", "dense_tp_tiny")
    m = build_model("dense", load_model_config("dense_tp_tiny")["hf_config"])
    m.install(c)  # tp = 1: claimed
    with pytest.raises(TopologyRefused) as exc:
        m.install(c, RuntimeFacts("cpu", tp=2))
    msg = str(exc.value)
    assert "tp=2 is not in the proven domain [1]" in msg and "'o_proj' (impl gemm_fixed_k) pins no K_LEAVES" in msg
