"""The README's engine example runs and verifies bitwise."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generate_then_verify_example():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "generate_then_verify.py")], capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("differing logprobs vs trainer: 0") == 2
