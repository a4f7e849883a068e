"""The topology gates (isoexec/gates/topology_gates.py) through ``isoexec gates run``: the dense,
hybrid and mla_moe models under ``isoexec_tp4`` at tp = 1 in a group this process makes for itself, and
the dense model at tp = 2 under torchrun on two gloo ranks. The tensor-parallel trainer logits and
token logprobs and the engine equal one process bit for bit, and the stock all-reduce control (the gates' contract with its row-parallel sums unpinned,
``all_reduce_control``) differs (fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from isoexec.gates.artifacts import load_artifacts
from isoexec.gates.runner import run_gates

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
ONLY = frozenset({"tp_trainer_logits", "tp_trainer_logprobs", "tp_engine_generate_verify"})


def _by_gate(arts: dict) -> dict:
    return {(a["gate"]["family"], a["gate"]["dtype"]): a for a in arts.values()}


# mla_moe stands for the MoE families here (its MLA o_proj is tp_moe's row-parallel linear, which the
# control must reach too); both MoE engines are checked in tests/dist/test_tp_moe_engine.py
@pytest.mark.parametrize("family, model", [("dense", "dense_tp_tiny"), ("hybrid", "hybrid_tp_tiny"),
                                           ("mla_moe", "mla_moe_tp_tiny")])
def test_topology_gates_pass_at_tp1_in_a_group_of_their_own_and_the_all_reduce_control_differs(tmp_path, family,
                                                                                              model):
    lines: list[str] = []
    results = run_gates(family, "isoexec_tp4", "cpu", tmp_path, model=model, log=lines.append, only=ONLY)
    assert not dist.is_initialized()          # the group made for the gates is gone again
    assert {r.family for r in results} == {"tp_trainer_logits", "tp_trainer_logprobs", "tp_engine_generate_verify",
                                           "negative_control"}
    assert all(r.ok for r in results), lines
    arts = _by_gate(load_artifacts(tmp_path))
    for dtype in ("float32", "bfloat16"):
        for name in ("tp_trainer_logits", "tp_trainer_logprobs", "tp_engine_generate_verify"):
            a = arts[(name, dtype)]
            assert a["verdict"] == "pass" and a["counts"]["compared"] > 0 and a["counts"]["differing"] == 0
            assert a["gate"]["shapes"]["tp"] == 1 and a["gate"]["shapes"]["backend"] == "gloo"
    ctrl = arts[("negative_control", "float32")]
    assert ctrl["gate"]["of"] == "tp_engine_generate_verify" and ctrl["counts"]["differing"] > 0


def test_topology_gates_under_torchrun_at_tp2_every_rank_agrees_and_rank0_writes(tmp_path):
    out = tmp_path / "gates"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "isoexec.cli", "gates", "run", "--family", "dense", "--composition", "isoexec_tp4",
                           "--arch", "cpu", "--model", "dense_tp_tiny", "--only", ",".join(sorted(ONLY)),
                           "--out", str(out), "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)        # one report, from rank 0
    assert summary["passed"] and len(summary["gates"]) == 8
    arts = _by_gate(load_artifacts(out))
    assert len(arts) == 8
    for (name, dtype), a in arts.items():
        assert a["gate"]["shapes"]["tp"] == 2
        if name != "negative_control":
            assert a["counts"]["differing"] == 0 and a["counts"]["compared"] > 0
    assert arts[("negative_control", "float32")]["counts"]["differing"] > 0


def test_single_process_contracts_get_no_topology_gates():
    """isoexec and native pin every axis to [1]: nothing for the topology gates to prove, so a
    gates run of them (the workflow's, for every family) has none. native_tp4 claims tp variant,
    bits that depend on tp: nothing for them to prove either."""
    from isoexec.compose import build_contract
    from isoexec.gates.topology_gates import claims_tp

    for family in ("dense", "hybrid", "mla_moe", "hybrid_moe"):
        for comp in ("isoexec", "native"):
            assert not claims_tp(build_contract(family, comp, "cpu")), (family, comp)
    assert claims_tp(build_contract("dense", "isoexec_tp4", "cpu", "dense_tp_tiny"))
    for family in ("dense", "hybrid"):
        assert not claims_tp(build_contract(family, "native_tp4", "cpu", f"{family}_tp_tiny"))


@pytest.mark.parametrize("family", ["dense", "hybrid", "mla_moe", "hybrid_moe"])
def test_the_negative_control_contract_differs_from_the_gates_only_in_the_row_parallel_sums(family):
    """The control takes the stock all-reduce from its contract, as every run takes its sums (no
    patched function): the gates' contract with no K_LEAVES on the row-parallel regions (their
    discharges dropped), tp claimed variant and no tolerance; every kernel and other constant kept."""
    from isoexec.compose import build_contract
    from isoexec.contract import K_LEAVES, ROW_PARALLEL_OPS
    from isoexec.gates.topology_gates import all_reduce_control, claims_tp

    c = build_contract(family, "isoexec_tp4", "cpu", f"{family}_tp_tiny")
    ctrl = all_reduce_control(c)
    assert claims_tp(c) and not claims_tp(ctrl)
    assert ctrl.topology_claim("tp").kind == "variant" and ctrl.topology_claim("tp").domain == c.topology_claim("tp").domain
    assert not ctrl.claims.tolerances
    rows = 0
    for e, f in zip(sorted(c.composition, key=lambda e: (e.region, e.cases)),
                    sorted(ctrl.composition, key=lambda e: (e.region, e.cases)), strict=True):
        assert (e.region, e.cases, e.impl) == (f.region, f.cases, f.impl)
        if set(e.region) & set(ROW_PARALLEL_OPS):
            rows += 1
            assert e.constants[K_LEAVES] == 4 and dict(f.constants) == {k: v for k, v in e.constants.items()
                                                                         if k != K_LEAVES}
            assert f.discharge is None
        else:
            assert (dict(e.constants), e.discharge) == (dict(f.constants), f.discharge)
    assert rows >= 2
