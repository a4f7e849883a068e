"""Rule rl_run on several GPUs: with `gpus` > 1 on a GPU arch every RL run is launched under
torchrun, one data-parallel rank per GPU (workflow/scripts/launch.py), and asks for `gpus` GPUs;
on cpu, or with one GPU, it stays one `isoexec run` process."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

import launch  # noqa: E402
from test_workflow import copy_workflow, job_block, job_stats, snakemake, write_config  # noqa: E402

from isoexec.report import run_cli  # noqa: E402

FAMILIES = ("dense", "hybrid", "mla_moe", "hybrid_moe")


def test_world_and_launcher():
    assert launch.rl_world({"arch": "cpu", "gpus": 8}) == 1
    assert launch.rl_world({"arch": "sm90", "gpus": 8}) == 8
    assert launch.rl_world({"arch": "sm90"}) == 1
    assert launch.rl_launcher(1) == []
    assert launch.rl_launcher(8) == ["torchrun", "--standalone", "--nproc_per_node=8", "-m", "isoexec.cli"]


def test_paper_config_plans_every_rl_run_under_torchrun(tmp_path):
    """configs/paper.yaml (gpus: 8), with stand-in checkpoint folders and data set so that it plans:
    every rl_run job is `torchrun --standalone --nproc_per_node=8 -m isoexec.cli run ...`."""
    wf = copy_workflow(tmp_path)
    for f in FAMILIES:
        (wf / "ckpt" / f).mkdir(parents=True)
        (wf / "ckpt" / f / "config.json").write_text("{}")
    (wf / "data").mkdir()
    (wf / "data" / "dapo-math-17k.parquet").write_bytes(b"")
    extra = write_config(wf / "ckpts.yaml", "checkpoints: {" + ", ".join(f"{f}: {wf / 'ckpt' / f}" for f in FAMILIES)
                         + "}\n")
    r = snakemake(wf, "-n", "--configfile", "configs/paper.yaml", str(extra))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = re.findall(r"^Job \d+: rl_run (\w+) (\w+) seed (\d+) on 8 GPUs: (.*)$", r.stdout, re.M)
    assert len(lines) == job_stats(r.stdout)["rl_run"] > 0
    for fam, arm, seed, cmd in lines:
        out = f"results/paper/runs/{fam}/{arm}/seed{seed}"
        assert cmd == (f"torchrun --standalone --nproc_per_node=8 -m isoexec.cli run --config {out}/rl_config.json "
                       f"--out {out}"), cmd


def test_one_gpu_and_cpu_runs_stay_one_process(tmp_path):
    wf = copy_workflow(tmp_path)
    r = snakemake(wf, "-n", "--configfile", "configs/h200.yaml")   # gpus: 1
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torchrun" not in r.stdout and "gpu=1" in job_block(r.stdout, "rl_run")
    r = snakemake(wf, "-n", "--cores", "1", "--config", "gpus=4")   # the cpu default: no GPU, one process
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torchrun" not in r.stdout and job_stats(r.stdout)["rl_run"] > 0


def test_run_cli_runs_and_shows_the_launcher():
    log = io.StringIO()
    launcher = [sys.executable, "-m", "isoexec.cli"]
    proc = run_cli(["--help"], log, launcher=launcher)
    assert "run" in proc.stdout
    assert log.getvalue().splitlines()[0] == f"$ {sys.executable} -m isoexec.cli --help"
