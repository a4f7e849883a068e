"""Bad input found by trying the CLI as a new user: one line on stderr naming the problem, exit 2,
no traceback, and nothing written, checked before any work starts."""

import subprocess
import sys

import yaml

from isoexec.paths import configs_dir

CLI = [sys.executable, "-m", "isoexec.cli"]


def run(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def _one_line_refusal(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


def test_an_output_path_through_a_regular_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = run("contract", "build", "--family", "dense", "--composition", "isoexec", "--arch", "cpu",
            "--out", str(tmp_path / "afile" / "c.json"))
    _one_line_refusal(r, "afile", "is a file")
    r = run("gates", "run", "--family", "dense", "--composition", "isoexec", "--out", str(tmp_path / "afile"))
    _one_line_refusal(r, "expected a folder")
    assert (tmp_path / "afile").read_text() == "x"


def test_a_model_whose_layer_types_miss_layers_is_refused_before_any_gate(tmp_path):
    data = yaml.safe_load((configs_dir() / "models" / "hybrid_tiny.yaml").read_text())
    data["hf_config"]["layer_types"] = data["hf_config"]["layer_types"][:-1]
    bad = tmp_path / "bad_hybrid.yaml"
    bad.write_text(yaml.safe_dump(data))
    out = tmp_path / "gates"
    r = run("gates", "run", "--family", "hybrid", "--composition", "isoexec", "--model", str(bad), "--out", str(out))
    _one_line_refusal(r, "layer_types", "bad_hybrid.yaml")
    assert not out.exists()
