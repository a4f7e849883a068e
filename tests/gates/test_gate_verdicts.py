"""A real invariant gate passes, the negative control fails on this CPU, vacuous hazards fail."""

import torch

from isoexec.compose import build_contract, load_model_config
from isoexec.contract import ImplRef
from isoexec.enforce import bind
from isoexec.gates.compare import merge
from isoexec.gates.kernel_gates import GateOutcome, entry_with_impl, gate_linear
from isoexec.gates.runner import BATCH_SIZES

CFG = load_model_config("dense_tiny")["hf_config"]


def _lm_head(contract):
    return next(e for e in contract.composition if e.region == ("lm_head",))


def _run(entry, family="batch_invariance", dtype=torch.float32):
    fn = bind(entry, "trainer_score")
    gen = torch.Generator().manual_seed(0)
    return gate_linear(fn, entry.region, CFG, family, dtype, "cpu", gen, BATCH_SIZES["cpu"], ("signed_zero",),
                       dict(entry.constants))


def test_invariant_gemm_gate_passes():
    out = _run(_lm_head(build_contract("dense", "isoexec", "cpu")))
    counts = merge(out.reports)
    assert counts["compared"] > 0 and counts["differing"] == 0
    assert out.rel_err < out.tolerance
    assert out.verdict() == "pass"


def test_negative_control_stock_cpu_matmul_is_batch_variant():
    iso = _lm_head(build_contract("dense", "isoexec", "cpu"))
    native = entry_with_impl(iso, ImplRef("torch_linear", "torch", "cpu"))
    out = _run(native)
    counts = merge(out.reports)
    assert counts["differing"] > 0, "stock CPU matmul was batch-invariant: the gate would prove nothing here"
    assert out.verdict(expect_invariant=True) == "fail"
    assert out.verdict(expect_invariant=False) == "pass"


def test_hazard_gate_shows_its_hazards_occurred():
    out = _run(_lm_head(build_contract("dense", "isoexec", "cpu")), family="hazards")
    ex = out.hazards_exercised
    assert ex["signed_zero"] > 0 and ex["subnormal"] > 0 and ex["k_not_tile_multiple"] and ex["noncontiguous"]
    assert out.verdict() == "pass"


def test_vacuous_hazard_gate_fails():
    out = GateOutcome("hazards", {}, "float32", [], 0.0, 1e-4, {"signed_zero": 0}, ("signed_zero",))
    assert out.verdict() == "fail"


def test_wrong_kernel_fails_correctness_even_if_invariant():
    out = GateOutcome("batch_invariance", {}, "float32", [], float("nan"), 1e-4, {})
    assert out.verdict() == "fail"


def test_model_negative_controls_whole_model_must_fail_generate_verify_may_be_inconclusive():
    """A stock engine found invariant on one small draw is inconclusive; the whole-model case-parity
    control finding the stock composition invariant fails."""
    import torch

    from isoexec.compose import build_contract
    from isoexec.gates.compare import compare_bits
    from isoexec.gates.runner import _model_body

    c = build_contract("dense", "native", "cpu")
    same = [compare_bits(torch.ones(4), torch.ones(4))]
    differs = [compare_bits(torch.ones(4), torch.tensor([1.0, 1.0, 1.0, 2.0]))]

    def verdict(reports, of):
        return _model_body(c, "native", "negative_control", reports, {}, torch.bfloat16, 0, "cpu", "variant",
                           of)["verdict"]

    assert verdict(same, "engine_generate_verify") == "inconclusive"
    assert verdict(same, "model_case_parity") == "fail"
    assert verdict(differs, "engine_generate_verify") == "pass"


def test_the_qkv_gate_of_a_qwen2_model_draws_a_bias_and_checks_the_kernel_adds_it():
    """A qwen2 model's q/k/v region is a linear with a bias: its gate hands the kernel one, and a
    kernel that drops it fails the correctness check however invariant it is."""
    cfg = load_model_config("dense_qwen2_tiny")["hf_config"]
    entry = next(e for e in build_contract("dense", "isoexec", "cpu", "dense_qwen2_tiny").composition
                 if "q_proj" in e.region)
    fn = bind(entry, "trainer_score")
    gen = torch.Generator().manual_seed(0)

    def gate(f):
        return gate_linear(f, entry.region, cfg, "batch_invariance", torch.float32, "cpu", gen, BATCH_SIZES["cpu"],
                           (), dict(entry.constants))

    out = gate(fn)
    assert out.shapes["bias"] is True and out.verdict() == "pass"
    dropped = gate(lambda x, w, b: fn(x, w))
    assert merge(dropped.reports)["differing"] == 0 and dropped.verdict() == "fail"
    plain = _run(next(e for e in build_contract("dense", "isoexec", "cpu").composition if "q_proj" in e.region))
    assert "bias" not in plain.shapes      # a qwen3 model's q/k/v have none
