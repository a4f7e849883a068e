"""Rule rl_run on several GPUs and nodes: with `gpus` > 1 on a GPU arch every RL run is launched
under torchrun, one data-parallel rank per GPU (workflow/scripts/launch.py), and asks for `gpus`
GPUs; with `nodes` > 1 (SLURM) srun starts one torchrun per node and the job asks for the nodes and
`gpus` GPUs on each; on cpu, or with one GPU, it stays one `isoexec run` process."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    # `gpus` is per node: nodes x gpus ranks; on cpu one process whatever both say
    assert launch.rl_world({"arch": "sm90", "gpus": 4, "nodes": 2}) == 8
    assert launch.rl_nodes({"arch": "sm90", "gpus": 4, "nodes": 2}) == 2
    assert launch.rl_world({"arch": "cpu", "gpus": 4, "nodes": 2}) == 1 == launch.rl_nodes({"arch": "cpu", "nodes": 2})
    assert launch.rl_launcher(8, 1) == launch.rl_launcher(8)
    assert launch.rl_launcher(8, 2)[:2] == ["bash", "-c"]


@pytest.mark.parametrize("value", [0, -1, "two", 1.5, True, None, [2]])
def test_nodes_error_names_the_key(value):
    err = launch.nodes_error({"nodes": value})
    assert err is not None and err.startswith("config: `nodes` must be an integer >= 1") and "\n" not in err
    assert err.endswith(f"got {value!r}")


def test_nodes_error_accepts_integers_from_one():
    assert launch.nodes_error({}) is None
    assert launch.nodes_error({"nodes": 1}) is None and launch.nodes_error({"nodes": 16}) is None


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


def test_two_gpu_config_plans_the_tensor_parallel_pair_under_torchrun_on_two_gpus(tmp_path):
    """configs/h200x2.yaml (the 2-GPU run): every rl_run of the native_tp4 / isoexec_tp4 pair, each
    engine at TP = 2, runs under torchrun on the machine's two GPUs and asks for both."""
    wf = copy_workflow(tmp_path)
    r = snakemake(wf, "-n", "--configfile", "configs/h200x2.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = re.findall(r"^Job \d+: rl_run (\w+) (\w+) seed (\d+) on 2 GPUs: (.*)$", r.stdout, re.M)
    assert sorted((f, a) for f, a, _, _ in lines) == [(f, a) for f in ("dense", "hybrid") for a in ("isoexec", "native")]
    for fam, arm, seed, cmd in lines:
        out = f"results/h200x2/runs/{fam}/{arm}/seed{seed}"
        assert cmd == (f"torchrun --standalone --nproc_per_node=2 -m isoexec.cli run --config {out}/rl_config.json "
                       f"--out {out}"), cmd
    cfg = yaml.safe_load((REPO / "configs/h200x2.yaml").read_text())
    assert cfg["gpus"] == 2 and {a["composition"]: a["settings"]["engine_tp"] for a in cfg["rl"]["arms"].values()} == \
        {"native_tp4": 2, "isoexec_tp4": 2}


def test_eight_gpu_config_plans_every_familys_tensor_parallel_pair_under_torchrun_on_eight_gpus(tmp_path):
    """configs/h200x8.yaml (the 8-GPU run): the native_tp4 / isoexec_tp4 pair of all four families at
    the paper's model sizes, each engine at TP = 2, runs under torchrun on the machine's eight GPUs,
    from random weights with no warm-up job."""
    wf = copy_workflow(tmp_path)
    r = snakemake(wf, "-n", "--configfile", "configs/h200x8.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = re.findall(r"^Job \d+: rl_run (\w+) (\w+) seed (\d+) on 8 GPUs: (.*)$", r.stdout, re.M)
    assert len(lines) == job_stats(r.stdout)["rl_run"]
    assert sorted((f, a) for f, a, _, _ in lines) == [(f, a) for f in sorted(FAMILIES) for a in ("isoexec", "native")]
    for fam, arm, seed, cmd in lines:
        out = f"results/h200x8/runs/{fam}/{arm}/seed{seed}"
        assert cmd == (f"torchrun --standalone --nproc_per_node=8 -m isoexec.cli run --config {out}/rl_config.json "
                       f"--out {out}"), cmd
    assert "rl_warmup" not in job_stats(r.stdout)      # warmup_sft_steps: 0, no one-GPU warm-up of a 35B model
    cfg = yaml.safe_load((REPO / "configs/h200x8.yaml").read_text())
    assert cfg["gpus"] == 8 and {a["composition"]: a["settings"]["engine_tp"] for a in cfg["rl"]["arms"].values()} == \
        {"native_tp4": 2, "isoexec_tp4": 2}
    paper = yaml.safe_load((REPO / "configs/paper.yaml").read_text())
    assert cfg["models"] == paper["models"] and cfg["rl"]["settings"]["steps"] >= 10
    # the gates of every family run its layer-dimension model (gates.models), the runs the paper's
    gates = {re.search(r"wildcards: family=(\w+)", j).group(1): j for j in r.stdout.split("rule gates:\n")[1:]}
    assert sorted(gates) == sorted(FAMILIES)
    for fam, job in gates.items():
        want = cfg["gates"]["models"][fam]
        assert want.endswith("_dims") and f"configs/models/{want}.yaml" in job.split("\n[", 1)[0], (fam, job)
        assert f"configs/models/{cfg['models'][fam]}.yaml" not in job.split("\n[", 1)[0], (fam, job)


def test_eight_gpu_config_fits_the_plan_on_h200s(tmp_path):
    """`isoexec plan --config configs/h200x8.yaml` (the config's gpu_memory_gib: 139): a row per
    family and distinct arm, each at dp 8 and engine TP 2, and every one fits; with the engines
    whole (engine_tp 1) hybrid_moe's rows do not."""
    from isoexec.plan import memory_plan

    plan = memory_plan(str(REPO / "configs/h200x8.yaml"))
    assert plan.gpu_gib == 139 and plan.gpu_note.startswith("gpu_memory_gib of the config")
    assert {r.shape.family for r in plan.rows} == set(FAMILIES)
    assert {a for r in plan.rows for a in r.shape.arms} == {"isoexec", "native"}
    assert all((r.shape.dp, r.shape.engine_tp) == (8, 2) for r in plan.rows)
    assert plan.fits, [(r.shape.family, r.shape.arms, r.verdict()) for r in plan.rows if not r.fits]
    cfg = yaml.safe_load((REPO / "configs/h200x8.yaml").read_text())
    for arm in cfg["rl"]["arms"].values():
        arm["settings"]["engine_tp"] = 1
    (tmp_path / "whole.yaml").write_text(yaml.safe_dump(cfg))
    whole = memory_plan(str(tmp_path / "whole.yaml"))
    assert sorted(r.shape.family for r in whole.rows if not r.fits) == ["hybrid_moe", "hybrid_moe"]


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


# ------------------------------------------------------------------------------- more than one node
TWO_NODES = "nodes: 2\ngpus: 4\n"
MULTI_NODE_CMD = ("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --whole --kill-on-bad-exit=1 torchrun --nnodes=2 "
                  "--nproc_per_node=4 --rdzv_backend=c10d "
                  '--rdzv_endpoint=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):$((20000 + SLURM_JOB_ID % 10000)) '
                  "--rdzv_id=$SLURM_JOB_ID -m isoexec.cli")


def rl_run_jobs(out: str) -> list[tuple[str, str, str, str, str]]:
    """(family, arm, seed, command, resources line) of every multi-node rl_run job of a dry run."""
    return re.findall(r"^Job \d+: rl_run (\w+) (\w+) seed (\d+) on 2 nodes x 4 GPUs: (.*)\n    resources: (.*)$",
                      out, re.M)


@pytest.mark.parametrize("profile", [(), ("--profile", "workflow/profiles/slurm")])
def test_two_nodes_plan_srun_and_torchrun_for_every_rl_run(tmp_path, profile):
    """nodes: 2, gpus: 4 on sm90 (configs/h200.yaml): every rl_run job is srun starting one torchrun per
    node, --nnodes=2 --nproc_per_node=4, the rendezvous on the allocation's first node evaluated in the
    job (the dry run shows the shell text, not a host), and asks for 2 nodes with gpu:4 each. A dry
    run plans it with any executor; the SLURM profile adds its CPUs and memory per node."""
    wf = copy_workflow(tmp_path)
    extra = write_config(wf / "two_nodes.yaml", TWO_NODES)
    r = snakemake(wf, "-n", *profile, "--configfile", "configs/h200.yaml", str(extra))
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = rl_run_jobs(r.stdout)
    assert len(jobs) == job_stats(r.stdout)["rl_run"] == 8
    for fam, arm, seed, cmd, res in jobs:
        out = f"results/h200/runs/{fam}/{arm}/seed{seed}"
        assert cmd == f"{MULTI_NODE_CMD} run --config {out}/rl_config.json --out {out}", cmd
        assert res == "nodes=2, gres=gpu:4, tasks=2, mpi=srun, gpu=0, runtime=" + ("1440" if profile else "600"), res
    assert "--standalone" not in r.stdout
    # the other GPU jobs keep one GPU each, on one node
    for rule in ("gates", "bench", "rl_warmup"):
        job = job_block(r.stdout, rule)
        assert "gpu=1" in job and "nodes=" not in job and "gres=" not in job, (rule, job)
        if profile:
            assert "cpus_per_gpu=8" in job and re.search(r"mem_mb=(64000|128000)\b", job), (rule, job)


def test_two_nodes_sbatch_options(tmp_path):
    """What the installed SLURM executor plugin submits for a 2-node rl_run job (the rule's resources
    of the dry run above and the profile's): 2 nodes, 2 tasks, gpu:4 per node, the profile's CPUs per
    GPU and memory per node; no --gpus (a count over the whole job) and no --ntasks-per-gpu."""
    submit = pytest.importorskip("snakemake_executor_plugin_slurm.submit_string")
    utils = pytest.importorskip("snakemake_executor_plugin_slurm.utils")

    class Resources(dict):
        __getattr__ = dict.__getitem__

    profile = yaml.safe_load((REPO / "workflow/profiles/slurm/config.yaml").read_text())
    prof = profile["set-resources"]["rl_run"]
    assert not {"gpu", "gpus", "gres", "nodes", "tasks", "mpi"} & set(prof)   # the config's, through the rule
    res = Resources(nodes=2, gres="gpu:4", tasks=2, mpi="srun", gpu=0, tasks_per_gpu=0, **prof)
    job = type("Job", (), {"resources": res, "threads": profile["set-threads"]["rl_run"], "name": "rl_run",
                           "is_group": lambda self: False})()
    params = {"run_uuid": "u", "slurm_logfile": "log", "comment_str": "rl_run", "account": "-A acc",
              "partition": "-p gpu", "workdir": str(tmp_path)}
    call = submit.get_submit_command(job, params) + utils.set_gres_string(job)
    opts = call.split()
    for want in ("--nodes=2", "--ntasks=2", "--gres=gpu:4", f"--cpus-per-gpu={prof['cpus_per_gpu']}"):
        assert want in opts, (want, call)
    assert f"--mem {prof['mem_mb']}" in call, call
    assert not any(o.startswith(("--gpus", "--ntasks-per-gpu")) for o in opts), call


def test_one_node_keeps_the_standalone_launch(tmp_path):
    """nodes: 1 said explicitly is today's launch: torchrun --standalone on one node."""
    wf = copy_workflow(tmp_path)
    extra = write_config(wf / "one_node.yaml", "nodes: 1\ngpus: 4\n")
    r = snakemake(wf, "-n", "--configfile", "configs/h200.yaml", str(extra))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = re.findall(r"^Job \d+: rl_run \w+ \w+ seed \d+ on 4 GPUs: (torchrun --standalone --nproc_per_node=4 "
                       r"-m isoexec\.cli run --config \S+ --out \S+)$", r.stdout, re.M)
    assert len(lines) == job_stats(r.stdout)["rl_run"] == 8
    assert "srun" not in r.stdout and "--nnodes" not in r.stdout


@pytest.mark.parametrize("text,shown", [("nodes: 0\n", "0"), ("nodes: two\n", "'two'"), ("nodes: 1.5\n", "1.5")])
def test_a_bad_nodes_value_is_refused_with_one_line(tmp_path, text, shown):
    wf = copy_workflow(tmp_path)
    bad = write_config(wf / "bad.yaml", text)
    r = snakemake(wf, "-n", "--configfile", "configs/h200.yaml", str(bad))
    assert r.returncode != 0
    out = r.stdout + r.stderr
    line = f"config: `nodes` must be an integer >= 1 (the nodes one RL run spans, `gpus` GPUs on each), got {shown}"
    assert out.count(line) == 1, out[-2000:]
    assert "Traceback" not in out and "Failed validating" not in out and "rule " not in out


def test_two_nodes_are_refused_by_a_local_run_before_any_job(tmp_path):
    """A local run is one machine: nodes: 2 stops with one line once the jobs are planned, before any
    job starts (no job log is written)."""
    wf = copy_workflow(tmp_path)
    extra = write_config(wf / "two_nodes.yaml", TWO_NODES)
    r = snakemake(wf, "--cores", "1", "--configfile", "configs/h200.yaml", str(extra))
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert out.count("config: nodes: 2 asks for RL runs on 2 nodes, which run only on SLURM") == 1, out[-2000:]
    assert "executor (local)" in out and "Traceback" not in out
    assert not (wf / "results/h200/logs").exists()
    # without rl_run jobs to run (here the synthetic data set, a CPU job of a few seconds) it is not
    r = snakemake(wf, "results/h200/data/synthetic.parquet", "--cores", "1", "--configfile", "configs/h200.yaml",
                  str(extra))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (wf / "results/h200/data/synthetic.parquet").is_file() and "nodes: 2 asks" not in r.stdout + r.stderr


def _fake_slurm(bin_dir: Path) -> None:
    """Stand-ins for srun (prints its arguments and the node list it was given as JSON), scontrol
    show hostnames and squeue."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/bin/sh\n"
        f"exec {sys.executable} -c 'import json, os, sys; "
        "print(json.dumps({\"argv\": sys.argv[1:], \"nodelist\": os.environ.get(\"SLURM_JOB_NODELIST\")}))' \"$@\"\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        '[ "$1 $2" = "show hostnames" ] || exit 2\n'
        'case "$3" in "gpu[07-08]") printf "gpu07\\ngpu08\\n";; *) echo "unknown node list: $3" >&2; exit 1;; esac\n')
    (bin_dir / "squeue").write_text('#!/bin/sh\necho "gpu[07-08]"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)


@pytest.mark.parametrize("nodelist", ["gpu[07-08]", None])
def test_the_multi_node_launcher_runs_srun_with_the_first_node(tmp_path, nodelist):
    """The launcher run as the job runs it (bash, a stand-in srun): one torchrun per node, the
    rendezvous on the first node of the job's node list at a port from the job id; the node list is
    asked of squeue when the job's environment lacks it (the plugin's job step removes it)."""
    _fake_slurm(tmp_path / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}", SLURM_JOB_ID="4242")
    if nodelist:
        env["SLURM_JOB_NODELIST"] = nodelist
    args = ["run", "--config", "runs/a b/rl_config.json", "--out", "runs/a b"]
    proc = subprocess.run(launch.rl_launcher(8, 2) + args, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["nodelist"] == "gpu[07-08]"
    assert got["argv"] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--whole", "--kill-on-bad-exit=1",
                           "torchrun", "--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=c10d",
                           "--rdzv_endpoint=gpu07:24242", "--rdzv_id=4242", "-m", "isoexec.cli", *args]


def test_the_multi_node_launcher_outside_slurm_fails_with_one_line(tmp_path):
    _fake_slurm(tmp_path / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    log = io.StringIO()
    with pytest.raises(Exception) as e:
        run_cli(["run", "--config", "x.json", "--out", "x"], log, env=env, launcher=launch.rl_launcher(8, 2))
    assert "runs inside a SLURM job of that many nodes" in str(e.value) and "\n" not in str(e.value)
