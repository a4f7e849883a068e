"""scripts/tp_engine_check.py, the 2-GPU run's TP gate, on two gloo ranks under torchrun: it
exits 0, and its JSON says every rank found 0 differing trainer logits, 0 token mismatches and 0
differing engine logprobs against one process, 0 in generate-then-verify, while the all-reduce
control differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_the_tp_engine_check_passes_on_two_gloo_ranks_and_its_control_differs(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "scripts" / "tp_engine_check.py"), "--device", "cpu", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and res["backend"] == "gloo" and res["passed"]
    for r in res["ranks"]:
        assert r["passed"] and r["trainer_logits"]["compared"] > 0 and r["trainer_logits"]["differing"] == 0
        assert r["engine"]["token_mismatches"] == 0 and r["engine"]["logprobs_compared"] > 0
        assert r["engine"]["logprobs_differing"] == 0 and r["generate_then_verify"]["differing"] == 0
    ctrl = res["negative_control_all_reduce"]
    assert ctrl["token_mismatches"] + ctrl["logprobs_differing"] > 0
    assert "PASSED on every rank" in proc.stdout
