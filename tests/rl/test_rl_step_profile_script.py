"""scripts/rl_step_profile.py, the tool that finds where an RL step's time goes, on the CPU: in one
process and under torchrun at world size 1 (gloo) it runs the tiny dense model's steps, profiles the
last one and writes its stage times, the operator tables and the process's threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "rl_step_profile.py"


def _config(tmp_path: Path) -> Path:
    rl = {"family": "dense", "model": "dense_tiny", "arch": "cpu", "dataset": "synthetic",
          "synthetic": {"n": 40, "max_operand": 9, "min_terms": 2, "max_terms": 2, "ops": "+"},
          "prompts_per_step": 2, "samples_per_prompt": 2, "mini_batch_size": 1, "max_prompt_tokens": 24,
          "max_response_tokens": 6, "overlong_cache": 2, "prompt_style": "compact", "warmup_sft_steps": 0,
          "dynamic_sampling": False}
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump({"rl": rl}))
    return path


def _run(tmp_path: Path, launcher: list[str], out: str) -> dict:
    proc = subprocess.run([*launcher, str(SCRIPT), "--config", str(_config(tmp_path)), "--steps", "2",
                           "--top", "5", "--out", str(tmp_path / out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "==== threads" in proc.stdout
    return json.loads((tmp_path / out / "profile.json").read_text())


def _check(res: dict, distributed: bool) -> None:
    assert res["distributed"] is distributed and res["world_size"] == 1 and res["step"] == 1
    assert res["stages_s"]["time_step_s"] > 0 and res["stages_s"]["time_training_s"] > 0
    g = res["gc_during_step"]
    assert len(g["collections_by_generation"]) == 3 and g["seconds"] >= 0 and g["tracked_objects"] > 1000
    for key in ("by_self_cpu", "by_cpu", "by_self_device"):
        assert len(res[key]) == 5 and all(r["calls"] > 0 for r in res[key])
    if Path("/proc/self/task").is_dir():   # Linux: every thread, the main one among them
        main = [t for t in res["threads_after_step"] if t["tid"] == res["pid"]]
        assert len(main) == 1 and main[0]["cpus_allowed"] and main[0]["cpu_s"] > 0
        assert 1 <= res["cpus_allowed"] <= res["os_cpus"]


def test_profile_script_writes_stages_tables_and_threads_in_one_process(tmp_path):
    _check(_run(tmp_path, [sys.executable], "one"), distributed=False)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_profile_script_takes_the_distributed_path_under_torchrun_world_one(tmp_path):
    res = _run(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"], "tr")
    _check(res, distributed=True)
