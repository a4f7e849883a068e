"""Kernel gates of the Gated DeltaNet regions: they pass for the IsoExec kernels, and the case
gate fails for the native mix (chunk-form trainer/prefill vs recurrent decode)."""

from __future__ import annotations

import torch
import pytest

from isoexec.compose import build_contract, load_model_config
from isoexec.gates.kinds import KINDS
from isoexec.gates.runner import _run_one

CFG = load_model_config("hybrid_tiny")["hf_config"]


def entry(composition: str, region: str):
    c = build_contract("hybrid", composition, "cpu", "hybrid_tiny")
    return next(e for e in c.composition if region in e.region)


def test_every_gdn_region_kind_has_gate_families():
    for kind in ("gdn_core", "gdn_conv", "gdn_prep", "gated_norm", "gate"):
        assert KINDS[kind].families


@pytest.mark.parametrize("region,family", [("gdn_core", "case_parity"), ("gdn_core", "batch_invariance"),
                                           ("gdn_conv", "case_parity"), ("gdn_prep", "batch_invariance"),
                                           ("gdn_out_norm", "batch_invariance"), ("attn_gate", "batch_invariance")])
def test_isoexec_gdn_region_gates_pass_bitwise(tmp_path, region, family):
    r = _run_one(entry("isoexec", region), family, CFG, torch.bfloat16, "cpu", 0, tmp_path)
    assert r.verdict == "pass", r.line()
    assert r.differing == 0 and r.compared > 1000


def test_native_gdn_core_fails_case_parity(tmp_path):
    """The stock mix computes prefill by the chunk form and decode by the recurrence: different bits."""
    r = _run_one(entry("native", "gdn_core"), "case_parity", CFG, torch.float32, "cpu", 0, tmp_path, expect="variant")
    assert r.differing > 0
    assert r.verdict == "pass"      # a negative control passes when the stock kernels do differ
