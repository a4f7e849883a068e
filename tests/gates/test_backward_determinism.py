"""The backward-determinism gate: the same trainer step twice gives the same gradient bits for every
parameter; a non-deterministic gradient or a vacuous (all-zero) one makes it fail."""

import torch

from isoexec.compose import build_contract, load_model_config
from isoexec.gates.compare import merge
from isoexec.gates.model_gates import backward_determinism
from isoexec.gates.runner import _model_body
from isoexec.model import build_model

CFG = load_model_config("dense_tiny")["hf_config"]


def _model():
    m = build_model("dense", CFG, dtype=torch.float32, device="cpu").init_random(0)
    contract = build_contract("dense", "isoexec", "cpu")
    m.install(contract)
    return m, contract


def _verdict(m, contract, reports, info):
    return _model_body(contract, "isoexec", "backward_determinism", reports, info, torch.float32, 0, "cpu",
                       "invariant")["verdict"]


def test_backward_determinism_gate_passes_and_compares_every_parameter():
    m, contract = _model()
    reports, info = backward_determinism(m, torch.Generator().manual_seed(0), batch_sizes=(1, 5), max_len=24)
    counts = merge(reports)
    n_params = len(list(m.parameters()))
    assert counts["comparisons"] == 2 * n_params and info["params"] == n_params
    assert counts["compared"] == 2 * sum(p.numel() for p in m.parameters())
    assert counts["differing"] == 0 and info["sanity_failures"] == []
    assert _verdict(m, contract, reports, info) == "pass"


def test_backward_determinism_gate_fails_on_a_gradient_that_changes_run_to_run():
    m, contract = _model()
    calls = {"n": 0}

    def drift(grad):  # a gradient hook that perturbs every other backward (a non-deterministic kernel)
        calls["n"] += 1
        return grad + (calls["n"] % 2) * 1e-3 * grad.abs().max()

    m.layers[0].o_weight.register_hook(drift)
    reports, info = backward_determinism(m, torch.Generator().manual_seed(0), batch_sizes=(3,), max_len=24)
    assert merge(reports)["differing"] > 0
    assert _verdict(m, contract, reports, info) == "fail"


def test_backward_determinism_gate_fails_when_a_gradient_is_all_zeros():
    m, contract = _model()
    m.layers[1].down_weight.register_hook(lambda g: torch.zeros_like(g))
    reports, info = backward_determinism(m, torch.Generator().manual_seed(0), batch_sizes=(3,), max_len=24)
    assert merge(reports)["differing"] == 0
    assert any("down_weight" in f and "all zeros" in f for f in info["sanity_failures"])
    assert _verdict(m, contract, reports, info) == "fail"
