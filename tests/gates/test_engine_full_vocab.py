"""The full-vocabulary engine gate: at every sampled position the engine's whole fp32 log-softmax
row equals the trainer's, bit for bit, for the IsoExec composition; a one-ULP change to one
element of one recorded row, and the stock (native) composition, are both caught."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from isoexec.assembly import installed_model  # noqa: E402
from isoexec.compose import build_contract  # noqa: E402
from isoexec.gates import engine_gates as eg  # noqa: E402
from isoexec.gates.runner import INCONCLUSIVE_CONTROLS, _model_body, gate_names  # noqa: E402

SIZES = eg.sizes("engine_full_vocab", "cpu")


def _model(family: str, composition: str = "isoexec", dtype=torch.float32):
    c = build_contract(family, composition, "cpu")
    return installed_model(family, composition, "cpu", None, dtype=dtype, device="cpu", seed=0, contract=c).model, c


@pytest.mark.parametrize("family,dtype", [("dense", torch.float32), ("dense", torch.bfloat16),
                                          ("hybrid_moe", torch.float32)])
def test_full_rows_bitwise_equal_isoexec(family, dtype):
    m, c = _model(family, dtype=dtype)
    reports, info = eg.engine_full_vocab(m, c, torch.Generator().manual_seed(1), **SIZES)
    rows, at_token = reports
    V = m.cfg.vocab_size
    assert info["tokens"] > 0 and info["vocab"] == V
    # every element of every sampled position's row was compared, and none differs
    assert rows.compared == info["tokens"] * V and rows.differing == 0, rows
    assert at_token.compared == info["tokens"] and at_token.differing == 0, at_token


def test_one_ulp_in_one_row_element_is_caught():
    """Same traffic as the gate; one element (not the sampled token) of one engine row moved by one
    ULP through its int32 view: exactly that element differs, the token entries still agree."""
    m, c = _model("dense")
    engine, results = eg._generate(m, c, torch.Generator().manual_seed(1), record_full_logprobs=True, **SIZES)
    rec = engine.runner.full_rows
    k = len(rec) // 2
    rid, pos, row = rec[k]
    res = next(r for r in results if r.request_id == rid)
    token = res.ids[pos - len(res.prompt)]               # the token sampled from this row
    j = (token + 1) % row.shape[0]
    moved = row.clone()
    moved.view(torch.int32)[j] += 1
    rec[k] = (rid, pos, moved)
    rows, at_token = eg.verify_engine_full_rows(m, results, rec)
    assert rows.differing == 1 and rows.max_ulp == 1, rows
    assert at_token.differing == 0


def test_native_composition_rows_differ():
    """The stock composition: engine rows and trainer rows come from batch-variant kernels, so the
    same gate finds differing elements (measured on CPU fp32: 1,736 of 13,312)."""
    m, c = _model("dense", "native")
    (rows, at_token), _ = eg.engine_full_vocab(m, c, torch.Generator().manual_seed(1), **SIZES)
    assert rows.differing > 0, rows
    # the recorded rows are still the distributions the engine's logprobs came from
    assert at_token.differing == 0, at_token


def test_hook_off_by_default_and_gate_registered():
    m, c = _model("dense")
    assert eg._engine(m, c).runner.full_rows is None          # nothing computed unless asked
    assert "engine_full_vocab" in eg.ENGINE_GATES and "engine_full_vocab" not in eg.GPU_ONLY_GATES
    assert "engine_full_vocab" in gate_names()


def test_native_control_invariant_by_chance_is_inconclusive():
    assert "engine_full_vocab" in INCONCLUSIVE_CONTROLS
    c = build_contract("dense", "native", "cpu")
    same = [eg.compare_bits(torch.ones(4), torch.ones(4))]
    body = _model_body(c, "native", "negative_control", same, {}, torch.bfloat16, 0, "cpu", "variant",
                       "engine_full_vocab")
    assert body["verdict"] == "inconclusive"
