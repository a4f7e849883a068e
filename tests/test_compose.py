"""Building contracts from compositions: every refusal names what is wrong."""

import textwrap

import pytest

from isoexec.compose import build_contract
from isoexec.errors import CompositionError, ConfigError, ContractInvalid

BASE = """
name: t
claims:
  tolerances:
    - {cases: [trainer_score, engine_decode], bounds: {mean_abs: "0", max_abs: "0"}}
entries:
  - {region: [embed], impl: embed_gather, discharge: gate}
  - {region: [attn_norm], impl: rmsnorm_fixed, discharge: gate}
  - {region: [mlp_norm], impl: rmsnorm_fixed, discharge: gate}
  - {region: [final_norm], impl: rmsnorm_fixed, discharge: gate}
  - {region: [q_norm], impl: rmsnorm_fixed, discharge: gate}
  - {region: [k_norm], impl: rmsnorm_fixed, discharge: gate}
  - {region: [q_proj, k_proj, v_proj], impl: gemm_fixed_k, discharge: gate}
  - {region: [o_proj], impl: gemm_fixed_k, discharge: gate}
  - {region: [gate_proj, up_proj], impl: gemm_fixed_k, discharge: gate}
  - {region: [down_proj], impl: gemm_fixed_k, discharge: gate}
  - {region: [lm_head], impl: gemm_fixed_k, discharge: gate}
  - {region: [rope], impl: rope_fp32, discharge: gate}
  - {region: [attn_core], impl: attention_fixed_walk, discharge: gate}
  - {region: [act], impl: silu_mul_fp32, discharge: gate}
  - {region: [logprob], impl: logprob_fixed, discharge: gate}
"""


def _write(tmp_path, text):
    p = tmp_path / "comp.yaml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def _build(tmp_path, text, arch="cpu"):
    return build_contract("dense", _write(tmp_path, text), arch)


def test_base_composition_builds(tmp_path):
    c = _build(tmp_path, BASE)
    assert len(c.composition) == 15 and c.claims.claims_zero_tolerance


@pytest.mark.parametrize("old, new, err, words", [
    ("region: [act]", "region: [activation]", CompositionError, "unknown region/logical op 'activation'"),
    ("impl: silu_mul_fp32", "impl: silu_fast", CompositionError, "unknown impl 'silu_fast'"),
    ("impl: gemm_fixed_k, discharge: gate}\n  - {region: [o_proj]",
     "impl: gemm_fixed_k, constants: {TILE: 3}, discharge: gate}\n  - {region: [o_proj]", CompositionError,
     "declares no constant 'TILE'"),
    ("{region: [o_proj], impl: gemm_fixed_k,", "{region: [o_proj], impl: gemm_fixed_k, constants: {BLOCK_K: 48},",
     CompositionError, "BLOCK_K=48 is not allowed"),
    ("{region: [o_proj], impl: gemm_fixed_k,", "{region: [o_proj], impl: gemm_fixed_k, constants: {BLOCK_K: 1.5},",
     ConfigError, "1.5"),
    ("  - {region: [rope], impl: rope_fp32, discharge: gate}\n", "", CompositionError,
     "model op 'rope' has no region in case"),
    ("{region: [rope], impl: rope_fp32, discharge: gate}", "{region: [rope], impl: rope_fp32, discharge: gate, "
     "cases: [trainer_fwd]}", CompositionError, "model op 'rope' has no region in case 'engine_decode'"),
    ("{region: [act], impl: silu_mul_fp32, discharge: gate}", "{region: [act], impl: silu_mul_fp32}",
     ContractInvalid, "'act' (impl silu_mul_fp32) has no discharge, but the contract claims tolerance 0"),
    ("{region: [act], impl: silu_mul_fp32,", "{region: [act], impl: gemm_fixed_k,", CompositionError,
     "implements 'linear' ops, but region op 'act' is a 'activation' op"),
    ("{region: [o_proj], impl: gemm_fixed_k,", "{region: [o_proj], impl: gemm_fixed_k, cases: [trainer_judge],",
     CompositionError, "unknown case 'trainer_judge'"),
    ("{region: [embed], impl: embed_gather,", "{region: [embed, gdn_conv], impl: embed_gather,", CompositionError,
     "'gdn_conv' that the dense family does not have"),
    ("name: t", "name: t\nbogus: 1", ConfigError, "Additional properties are not allowed"),
])
def test_build_refusals_name_the_problem(tmp_path, old, new, err, words):
    assert old in BASE
    with pytest.raises(err) as ei:
        _build(tmp_path, BASE.replace(old, new, 1))
    assert words in str(ei.value)


def test_op_covered_twice_is_refused(tmp_path):
    with pytest.raises(CompositionError, match="'o_proj' is in 2 regions"):
        _build(tmp_path, BASE + "  - {region: [o_proj], impl: torch_linear}\n")


def test_without_zero_tolerance_undischarged_entries_are_fine(tmp_path):
    text = BASE.split("claims:")[0] + "entries:" + BASE.split("entries:")[1].replace(", discharge: gate", "")
    c = _build(tmp_path, text)
    assert all(e.discharge is None for e in c.composition)


def test_unknown_family_and_arch_and_missing_file(tmp_path):
    with pytest.raises(CompositionError, match="unknown model family 'moe'"):
        build_contract("moe", "isoexec", "cpu")
    with pytest.raises(CompositionError, match="unknown arch 'sm80'"):
        build_contract("dense", "isoexec", "sm80")
    with pytest.raises(ConfigError, match="not found"):
        build_contract("dense", str(tmp_path / "nope.yaml"), "cpu")
    with pytest.raises(ConfigError, match="unknown composition 'nope'"):
        build_contract("dense", "nope", "cpu")


def test_invalid_yaml_is_refused_with_location(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        _build(tmp_path, "name: [unclosed\nentries: 3\n")


def test_every_family_has_a_profile_in_the_registry():
    from isoexec import registry

    assert set(registry.FAMILIES) == {"dense", "mla_moe", "hybrid", "hybrid_moe"}
    for fam in registry.FAMILIES.values():
        assert all(op in registry.OPS for op in fam.ops)


def test_committed_compositions_build_for_both_arches():
    for comp in ("isoexec", "native"):
        for arch in ("cpu", "sm90"):
            c = build_contract("dense", comp, arch)
            assert {e.impl.arch for e in c.composition} == {arch}


@pytest.mark.parametrize("family", ["mla_moe", "hybrid_moe"])
def test_moe_families_compose_on_both_arches_with_the_reference_moe(family):
    """The MoE families' contracts build for cpu and sm90 with the invariant experts impl (the
    reference loop on cpu, the grouped GEMM on sm90) and mla_moe's attention records the
    expanded form."""
    for comp in ("isoexec", "native"):
        for arch in ("cpu", "sm90"):
            c = build_contract(family, comp, arch)
            impls = {e.region: e for e in c.composition}
            assert {e.impl.arch for e in c.composition} == {arch}
            want = "moe_experts_loop" if comp == "isoexec" else "torch_moe_experts"
            assert impls[("experts",)].impl.id == want
    attn = {e.region: e for e in build_contract("mla_moe", "isoexec", "sm90").composition}[("attn_core",)]
    assert attn.impl.id == "mla_expanded_walk" and attn.constants["FORM"] == "expanded"


def test_a_qwen2_contract_records_no_qk_norm_and_differs_from_the_qwen3_one():
    """A qwen2 model runs no q/k norm: its contract has no region for them (in every case), so its
    semantic identity (the ops) and its numerical policy (the entries) differ from a qwen3
    contract's, and both validate against the ops they cover (compose.required_ops)."""
    from isoexec.compose import required_ops
    from isoexec.contract import diff, validate

    for comp in ("isoexec", "native"):
        q3 = build_contract("dense", comp, "cpu", "dense_tiny")
        q2 = build_contract("dense", comp, "cpu", "dense_qwen2_tiny")
        ops3 = {o for e in q3.composition for o in e.region}
        ops2 = {o for e in q2.composition for o in e.region}
        assert ops3 - ops2 == {"q_norm", "k_norm"} and ops2 <= ops3
        assert q2.model.architectures == ("Qwen2ForCausalLM",) and q3.model.config_digest != q2.model.config_digest
        assert q3.identities.semantic != q2.identities.semantic
        assert q3.identities.numerical_policy != q2.identities.numerical_policy
        assert validate(q2, required_ops(q2)) == [] and validate(q3, required_ops(q3)) == []
        assert {"q_norm", "k_norm"} <= required_ops(q3) and not {"q_norm", "k_norm"} & required_ops(q2)
        assert any(d.where.startswith("region k_norm") for d in diff(q3, q2))


def test_half_of_an_optional_op_group_is_still_required(dense_isoexec_cpu):
    """Without its k_norm region a qwen3 contract is not a qwen2 one: the rest of the q/k norm group
    is reported missing."""
    from dataclasses import replace

    from isoexec.compose import required_ops
    from isoexec.contract import validate, with_identities

    c = dense_isoexec_cpu
    half = with_identities(replace(c, composition=tuple(e for e in c.composition if e.region != ("k_norm",))))
    assert "k_norm" in required_ops(half)
    assert any("model op 'k_norm'" in str(v) for v in validate(half, required_ops(half)))


def test_a_model_yaml_without_architectures_gets_its_model_type_s_class(tmp_path):
    import yaml

    from isoexec import registry
    from isoexec.compose import load_model_config

    for fam in registry.FAMILIES.values():
        assert len(fam.model_types) == len(fam.architectures), fam.id
    for name, arch in (("dense_qwen2_tiny", "Qwen2ForCausalLM"), ("dense_tiny", "Qwen3ForCausalLM")):
        data = load_model_config(name)
        data.pop("architectures", None)
        p = tmp_path / f"{name}.yaml"
        p.write_text(yaml.safe_dump(data))
        assert build_contract("dense", "native", "cpu", str(p)).model.architectures == (arch,)
