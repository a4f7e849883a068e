"""scripts/chunk_prefix_probe.py (a GPU probe for CPR version 4) runs end to end under the Triton
interpreter and writes its JSON: every prefix compared, its control (the batch twice) agreeing.
(What the interpreter's host matmul says about prefixes is no answer: the probe is for the GPU.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chunk_prefix_probe_runs_under_the_interpreter_with_an_agreeing_control(tmp_path):
    out = tmp_path / "probe.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "scripts/chunk_prefix_probe.py", "--device", "cpu", "--length", "6",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dot"], r["init"]) for r in rows] == [("tf32x3", False), ("tf32x3", True)]
    for r in rows:
        assert r["control_differing"] == 0
        assert len(r["differing_by_length"]) == 6 and r["elements_compared"] == 21 * 2 * 16   # 1+..+6 rows
        assert 0 <= r["prefixes_differing"] <= 6 and r["elements_differing"] == sum(r["differing_by_length"])
