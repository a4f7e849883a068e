"""The Snakemake workflow: lint clean, the DAG it plans, the config schema, and real runs.

Every run happens in a temporary copy of the workflow (Snakefile, workflow/, configs/, profiles/,
environment.yml), so the tests neither lock nor write into the checkout. The ``isoexec`` CLI they call is the installed
package; a fake ``isoexec`` placed first on PATH stands in for `gates run` where a test needs the
CLI to fail in a particular way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
# the embedded default: four families (dense, hybrid, mla_moe, hybrid_moe) x two compositions, six
# benchmarks, one shared warm-up per family (one seed): 61 jobs
DEFAULT_FAMILIES = ["dense", "hybrid", "mla_moe", "hybrid_moe"]
EXPECTED_JOBS = {"contract_draft": 8, "gates": 4, "contract_admit": 8, "contract_show": 8, "contract_verify": 8,
                 "gates_table": 1, "contracts_table": 1, "bench": 6, "kernels_table": 1, "cpr_table": 1,
                 "synthetic_data": 1, "rl_warmup": 4, "rl_run": 8, "rl_tables": 1, "all": 1}


def scaled_jobs(n_families: int) -> dict[str, int]:
    """EXPECTED_JOBS (four families) for ``n_families`` families: per-family jobs scale, the
    tables, the data and the benchmarks do not."""
    per_family = ("contract_draft", "gates", "contract_admit", "contract_show", "contract_verify", "rl_warmup",
                  "rl_run")
    return {k: v * n_families // len(DEFAULT_FAMILIES) if k in per_family else v for k, v in EXPECTED_JOBS.items()}


def copy_workflow(dst: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copy2(REPO / "Snakefile", dst / "Snakefile")
    shutil.copytree(REPO / "workflow", dst / "workflow", ignore=ignore)
    shutil.copytree(REPO / "configs", dst / "configs", ignore=ignore)
    shutil.copytree(REPO / "profiles", dst / "profiles", ignore=ignore)  # Snakemake reads profiles/default itself
    shutil.copy2(REPO / "environment.yml", dst / "environment.yml")  # the rules' conda environment
    copy_rl_schema(dst)
    return dst


def copy_rl_schema(dst: Path) -> None:
    """The workflow schema refers to the package's RL config schema by its place in the checkout
    (../../isoexec/rl/config.schema.yaml from workflow/schemas/), so a copy of the workflow needs
    it. The whole package is linked, not a lone isoexec/rl/ folder: the rules' scripts run with the
    workflow folder on sys.path, where a folder named isoexec without its __init__.py would import
    as an empty namespace package ahead of an editable install (isoexec.rl.tables not found)."""
    link = dst / "isoexec"
    if not link.exists():
        link.symlink_to(REPO / "isoexec", target_is_directory=True)


def snakemake(cwd: Path, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)


def job_stats(out: str) -> dict[str, int]:
    """The `Job stats` table of a dry run, as {rule: count} (without the total)."""
    stats = {}
    block = out.split("Job stats:", 1)[1]
    for line in block.splitlines()[3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m:
            break
        if m.group(1) != "total":
            stats[m.group(1)] = int(m.group(2))
    return stats


def job_block(out: str, rule: str) -> str:
    """The first job of ``rule`` in a dry run's output: its lines up to the next job's timestamp
    (or a blank line, or the job stats)."""
    lines = out.split(f"rule {rule}:\n", 1)[1].splitlines()
    end = next((i for i, ln in enumerate(lines) if not ln.strip() or ln.startswith(("[", "Job stats"))), len(lines))
    return "\n".join(lines[:end])


def refusal_line(r: subprocess.CompletedProcess, prefix: str) -> str:
    """The line starting with ``prefix`` of a snakemake run that must have failed."""
    assert r.returncode != 0, (r.stdout + r.stderr)[-3000:]
    return next(ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(prefix))


def write_config(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def wf(tmp_path):
    return copy_workflow(tmp_path)


# ------------------------------------------------------------------------------- static checks
def test_lint_is_clean(wf):
    r = snakemake(wf, "--lint")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "good condition" in r.stdout + r.stderr


def test_dry_run_of_the_default_config_lists_the_expected_jobs(wf):
    import yaml

    assert yaml.safe_load((wf / "configs/config.yaml").read_text())["families"] == DEFAULT_FAMILIES
    r = snakemake(wf, "-n", "--cores", "1")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert job_stats(out) == EXPECTED_JOBS and sum(EXPECTED_JOBS.values()) == 61
    for path in ("results/cpu/contracts/dense/isoexec.draft.json", "results/cpu/contracts/dense/native.json",
                 "results/cpu/gates/dense", "results/cpu/gate_runs/dense.json",
                 "results/cpu/contracts/dense/isoexec.verify.json", "paper_figures/cpu/gates.md",
                 "paper_figures/cpu/contracts.md"):
        assert path in out, path


def test_dry_run_of_the_h200_config_asks_for_a_gpu(wf):
    r = snakemake(wf, "-n", "--cores", "all", "--configfile", "configs/h200.yaml")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    import yaml

    benches = yaml.safe_load((wf / "configs/h200.yaml").read_text())["benchmarks"]["names"]
    assert "train" in benches  # the H200 config also benchmarks the trainer step
    families = yaml.safe_load((wf / "configs/h200.yaml").read_text())["families"]
    assert families == ["dense", "hybrid", "mla_moe", "hybrid_moe"]   # the four families at real layer dims
    assert job_stats(out) == {**scaled_jobs(len(families)), "bench": len(benches)}
    assert "results/h200/gates/dense" in out and "configs/models/dense_qwen3_0p6b.yaml" in out
    gates_job = job_block(out, "gates")
    assert "gpu=1" in gates_job


PAPER_MISSING = ("checkpoints.dense is not set", "checkpoints.hybrid is not set", "checkpoints.mla_moe is not set",
                 "checkpoints.hybrid_moe is not set", "rl.dataset 'data/dapo-math-17k.parquet' does not exist",
                 "set rl.enabled: false")


def test_paper_config_refuses_rl_without_checkpoints_and_data(wf):
    """configs/paper.yaml runs RL on real weights and DAPO-Math-17k: until both are there a run stops
    before any job with one line naming what is missing, instead of random weights."""
    r = snakemake(wf, "--cores", "1", "--configfile", "configs/paper.yaml")
    assert r.returncode != 0
    assert not (wf / "results/paper").exists(), "a refused config wrote into its results folder"
    line = next(ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("config: the RL runs cannot start:"))
    for missing in PAPER_MISSING:
        assert missing in line, missing
    # a checkpoint that is named but is no checkpoint is bad input: refused by a dry run too
    bad = write_config(wf / "bad_ckpt.yaml", f"checkpoints: {{dense: {wf / 'nowhere'}, hybrid: {wf}}}\n")
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", "configs/paper.yaml", str(bad))
    assert r.returncode != 0 and "is not a Hugging Face checkpoint folder (no config.json)" in r.stdout + r.stderr


@pytest.mark.parametrize("flag", ["-n", "-np", "--dry-run"])
def test_paper_config_dry_run_previews_the_8_gpu_launch_before_checkpoints_and_data_exist(wf, flag):
    """On a fresh machine a dry run of configs/paper.yaml shows the plan the runs will have (real
    weights: no warm-up; torchrun on 8 GPUs) and says in one line what the real run still needs."""
    r = snakemake(wf, flag, "--cores", "1", "--configfile", "configs/paper.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    line = next(ln for ln in out.splitlines() if ln.startswith("config: the RL runs cannot start yet:"))
    for missing in PAPER_MISSING + ("this dry run shows the plan", "a real run refuses"):
        assert missing in line, missing
    assert job_stats(out)["rl_run"] == 8 and "rl_warmup" not in job_stats(out)
    assert "torchrun --standalone --nproc_per_node=8 -m isoexec.cli run --config results/paper/runs/dense/isoexec/" in out


def test_paper_config_dry_runs_with_checkpoints_and_data(wf):
    families = ("dense", "hybrid", "mla_moe", "hybrid_moe")   # the paper's four families
    for fam in families:
        (wf / "ckpt" / fam).mkdir(parents=True)
        (wf / "ckpt" / fam / "config.json").write_text("{}")
    (wf / "data").mkdir()
    (wf / "data/dapo-math-17k.parquet").write_bytes(b"PAR1")
    given = write_config(wf / "given.yaml", "checkpoints: {" + ", ".join(f"{f}: {wf / 'ckpt' / f}" for f in families) + "}\n")
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", "configs/paper.yaml", str(given))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "paper_figures/paper/contracts.md" in out and "configs/models/dense_qwen3_8b.yaml" in out
    assert job_stats(out)["rl_run"] == 2 * len(families) and "results/paper/runs/dense/isoexec/seed0" in out
    assert "rl_warmup" not in job_stats(out)   # real weights: no warm-up
    for model in ("mla_moe_glm47_flash", "hybrid_moe_qwen3p5_35b_a3b"):
        assert f"configs/models/{model}.yaml" in out, model


def test_the_qwen3_8b_model_config_has_its_dimensions():
    import yaml

    cfg = yaml.safe_load((REPO / "configs/models/dense_qwen3_8b.yaml").read_text())["hf_config"]
    assert {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings")} == {
        "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False}
    assert cfg["rope_parameters"]["rope_theta"] == 1e6
    assert yaml.safe_load((REPO / "configs/paper.yaml").read_text())["models"]["dense"] == "dense_qwen3_8b"


def test_cpu_jobs_ask_for_no_gpu_and_one_thread(wf):
    """On cpu every job runs on one thread (the tiny models gain nothing from more), so Snakemake
    runs one job per core, the jobs on the way to the RL runs before the benchmarks; on a GPU arch
    the gates and RL runs keep their host threads."""
    r = snakemake(wf, "-n", "--cores", "4")
    out = r.stdout + r.stderr
    for rule in ("gates", "rl_warmup", "rl_run", "bench", "contract_draft", "contract_admit"):
        job = job_block(out, rule)
        assert "gpu=0" in job or "gpu=" not in job, rule
        assert "threads:" not in job, rule   # Snakemake names a job's threads when they are more than 1
        assert ("priority: 1" in job) == (rule != "bench"), (rule, job)
    gpu = snakemake(wf, "-n", "--cores", "4", "--configfile", "configs/h200.yaml")
    for rule, threads in (("gates", 4), ("rl_warmup", 2), ("rl_run", 2)):
        job = job_block(gpu.stdout + gpu.stderr, rule)
        assert f"threads: {threads}" in job, (rule, job)


@pytest.mark.parametrize("profile", ["--workflow-profile=workflow/profiles/default", "--profile=workflow/profiles/slurm"])
def test_profiles_parse(wf, profile):
    r = snakemake(wf, "-n", profile, "--configfile", "configs/h200.yaml")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "Using" in out and "profile" in out
    if "slurm" in profile:   # every GPU job (gates, bench, rl_warmup, rl_run) goes to the GPU partition
        for rule in ("gates", "bench", "rl_warmup", "rl_run"):
            job = job_block(out, rule)
            assert "gpu=1" in job and "slurm_partition=<your GPU partition>" in job, rule
            mem = int(re.search(r"mem_mb=(\d+)", job).group(1))
            assert mem >= 64000 and "cpus_per_gpu=" in job, rule


# ------------------------------------------------------------------------------- config schema
def test_schema_refuses_an_unknown_family(wf):
    bad = write_config(wf / "bad.yaml", "families: [dense, nosuch]\n")
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(bad))
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "Error validating config file" in err and "'nosuch' is not one of" in err


def test_schema_refuses_an_unknown_key(wf):
    bad = write_config(wf / "bad.yaml", "famlies: [dense]\n")
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(bad))
    assert r.returncode != 0 and "'famlies' was unexpected" in r.stdout + r.stderr


@pytest.mark.parametrize("text,expect", [
    ("dataset: {name: DAPO-Math-17k, path: null}\n", "'dataset' was unexpected"),   # removed: rl.dataset is the one
    ("rl: {synthetic: {n: 10, max_operands: 9}}\n", "'max_operands' was unexpected"),
    ("rl: {settings: {steps: banana}}\n", "'banana' is not of type 'integer'"),
    ("rl: {settings: {engine: [1, 2]}}\n", "is not of type 'object'"),
    ("rl: {settings: {dtype: float7}}\n", "'float7' is not one of"),
    ("rl: {settings: {temperature: hot}}\n", "'hot' is not of type 'number'"),
    # rl.settings is the package's schema (isoexec/rl/config.schema.yaml), nested sections included
    ("rl: {settings: {engine: {max_num_seqs: many}}}\n", "'many' is not of type 'integer'"),
    ("rl: {settings: {train: {loss: ppo}}}\n", "'ppo' is not one of ['dapo', 'grpo', 'reinforce']"),
    ("rl: {arms: {a: {composition: native, settings: {wandb: {projct: x}}}}}\n", "'projct' was unexpected"),
    ("rl: {settings: {family: dense}}\n", "'family' should not be valid under"),   # set by the workflow
    ("rl: {settings: {seed: 1}}\n", "'seed' should not be valid under"),
    ("rl: {require_checkpoints: maybe}\n", "'maybe' is not of type 'boolean'"),
    ("resume: 3\n", "3 is not one of [True, False, 'true', 'false']"),
])
def test_schema_checks_every_key_and_type(wf, text, expect):
    assert expect in schema_error(wf, text)


def schema_error(wf: Path, text: str) -> str:
    """The error of the Snakefile's ``validate(config, <schema>)`` for ``text`` given as
    ``--configfile``: merged over the Snakefile's ``configfile:`` as Snakemake merges it, validated
    against the schema the Snakefile names. In this process: a `snakemake -n` per bad config costs
    a Snakemake start-up (about 1.3 s) for the same call; the two tests above show that the
    workflow makes it and stops on its error."""
    import yaml
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import update_config, validate

    snakefile = (wf / "Snakefile").read_text()
    default = re.search(r'^configfile: "([^"]+)"$', snakefile, re.M).group(1)
    schema = re.search(r'^validate\(config, "([^"]+)"\)$', snakefile, re.M).group(1)
    config = yaml.safe_load((wf / default).read_text())
    update_config(config, yaml.safe_load(text))
    with pytest.raises(WorkflowError) as e:
        validate(config, str(wf / schema))
    return str(e.value)


def test_rl_settings_synthetic_is_refused_by_the_workflow(wf):
    """The runs read the data set the workflow makes from rl.synthetic; rl.settings.synthetic would be
    silently ignored, so the schema refuses it (in each arm's settings too)."""
    for text in ("rl: {settings: {synthetic: {n: 10}}}\n",
                 "rl: {arms: {a: {composition: native, settings: {synthetic: {n: 10}}}}}\n"):
        err = schema_error(wf, text)
        assert "Error validating config file" in err
        assert "'synthetic' should not be valid under" in err, text


def test_schema_refuses_a_bad_arch(wf):
    r = snakemake(wf, "-n", "--cores", "1", "--config", "arch=sm80")
    assert r.returncode != 0 and "'sm80' is not one of" in r.stdout + r.stderr


def test_a_family_without_a_model_config_is_refused(wf):
    # the default config has an entry for every family, and --configfile merges `models` over it, so
    # the copy's default loses its mla_moe entry first
    default = wf / "configs/config.yaml"
    text = default.read_text()
    assert text.count("\n  mla_moe: mla_moe_tiny\n") == 1
    default.write_text(text.replace("\n  mla_moe: mla_moe_tiny\n", "\n"))
    bad = write_config(wf / "bad.yaml", "families: [dense, mla_moe]\n")
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(bad))
    assert r.returncode != 0 and "`models` has no entry for family mla_moe" in r.stdout + r.stderr


def test_schema_fills_defaults(wf):
    minimal = write_config(wf / "minimal.yaml", """\
        run_name: minimal
        arch: cpu
        families: [dense]
        models: {dense: dense_tiny}
        """)
    # (--configfile would merge it over configs/config.yaml, so validate it on its own)
    from snakemake.utils import validate
    import yaml

    cfg = yaml.safe_load(minimal.read_text())
    validate(cfg, str(wf / "workflow/schemas/config.schema.yaml"))
    assert cfg["compositions"] == ["isoexec", "native"]
    assert cfg["gates"] == {"composition": "isoexec", "seed": 0}
    assert cfg["results_dir"] == "results" and cfg["figures_dir"] == "paper_figures"


@pytest.mark.parametrize("name", ["config", "h200", "h200x2", "h200x8", "paper"])
def test_shipped_configs_validate_on_their_own(name):
    from snakemake.utils import validate
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    validate(cfg, str(REPO / "workflow/schemas/config.schema.yaml"))
    assert cfg["run_name"] == {"config": "cpu"}.get(name, name)


def test_rl_arms_run_side_by_side_each_on_its_compositions_contract(wf):
    """rl.arms: one run folder per arm; an arm's contract is its composition's; settings keys are
    checked by the schema (a typo in an arm is refused before any job)."""
    cfg = write_config(wf / "arms.yaml", """\
        families: [dense]
        rl:
          enabled: true
          arms:
            native: {composition: native}
            native_tis: {composition: native, settings: {train: {tis_threshold: 2}}}
            native_tis_k3: {composition: native, settings: {train: {tis_threshold: 2, rs_kind: k3, rs_threshold: 0.001}}}
            isoexec: {composition: isoexec}
        """)
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(cfg), "--config", "results_dir=res")
    assert r.returncode == 0, r.stderr[-3000:]
    assert job_stats(r.stdout)["rl_run"] == 4 and job_stats(r.stdout)["rl_warmup"] == 1   # one warm-up for the four
    for arm, comp in (("native", "native"), ("native_tis", "native"), ("native_tis_k3", "native"),
                      ("isoexec", "isoexec")):
        block = r.stdout.split(f"output: res/cpu/runs/dense/{arm}/seed0\n", 1)
        assert len(block) == 2, arm
        job = r.stdout[r.stdout.rfind("rule rl_run:", 0, len(block[0])):len(block[0]) + 400]
        assert f"res/cpu/contracts/dense/{comp}.json" in job, (arm, job)
        assert "res/cpu/warmup/dense/seed0" in job, (arm, job)
    bad = write_config(wf / "bad_arm.yaml", """\
        rl: {enabled: true, arms: {x: {composition: native, settings: {train: {tis_cap: 2}}}}}
        """)
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(bad))
    assert r.returncode != 0 and "tis_cap" in r.stdout + r.stderr


def rl_jobs(out: str, rule: str) -> list[str]:
    """Every job of ``rule`` in a dry run's output (its lines up to the next job)."""
    return [b.split("\n[", 1)[0] for b in out.split(f"rule {rule}:\n")[1:]]


def test_one_shared_warmup_per_family_and_seed_for_every_arm(wf):
    """Two compositions, two seeds, four families: one rl_warmup job per (family, seed), run with no
    composition of its own (the native one), and both arms of a seed take that warm-up's folder as
    input; warmup_sft_steps 0 plans none, and a family with real weights gets none."""
    cfg = write_config(wf / "seeds.yaml", "rl: {enabled: true, seeds: [0, 1], settings: {warmup_sft_steps: 3}}\n")
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(cfg), "--config", "results_dir=res")
    assert r.returncode == 0, r.stderr[-3000:]
    assert job_stats(r.stdout)["rl_warmup"] == 8 and job_stats(r.stdout)["rl_run"] == 16
    warmups = rl_jobs(r.stdout, "rl_warmup")
    outputs = sorted(re.search(r"output: (\S+)", j).group(1) for j in warmups)
    assert outputs == sorted(f"res/cpu/warmup/{f}/seed{s}" for f in DEFAULT_FAMILIES for s in (0, 1))
    for j in warmups:
        assert "configs/compositions/native.yaml" in j and "contracts/" not in j, j
    for job in rl_jobs(r.stdout, "rl_run"):
        fam, arm, seed = re.search(r"wildcards: family=(\w+), arm=(\w+), seed=(\d+)", job).groups()
        assert f"res/cpu/warmup/{fam}/seed{seed}," in job, job
    none = write_config(wf / "none.yaml", "rl: {enabled: true, settings: {warmup_sft_steps: 0}}\n")
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(none))
    assert r.returncode == 0 and "rl_warmup" not in job_stats(r.stdout) and job_stats(r.stdout)["rl_run"] == 8
    (wf / "ckpt").mkdir()
    (wf / "ckpt/config.json").write_text("{}")
    real = write_config(wf / "real.yaml", f"checkpoints: {{dense: {wf / 'ckpt'}}}\n")
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(real))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(re.search(r"output: (\S+)", j).group(1) for j in rl_jobs(r.stdout, "rl_warmup")) == sorted(
        f"results/cpu/warmup/{f}/seed0" for f in DEFAULT_FAMILIES if f != "dense")


def test_arms_that_would_warm_up_differently_are_refused(wf):
    """The warm-up is shared by every arm, so the settings it reads must be the same in every arm: an
    arm with its own learning rate is refused before any job, with one line; an arm with its own
    RL-only settings (token TIS) is not, nor are arms of their own learning rates without a warm-up."""
    bad = write_config(wf / "bad.yaml", """\
        rl:
          enabled: true
          arms:
            native: {composition: native, settings: {train: {lr: 1.0e-3}}}
            isoexec: {composition: isoexec}
        """)
    line = refusal_line(snakemake(wf, "-n", "--cores", "1", "--configfile", str(bad)), "config: the RL runs cannot start")
    assert "rl.arms native vs isoexec differ in train.lr, which the supervised warm-up reads" in line, line
    assert "set them in rl.settings" in line
    ok = write_config(wf / "ok.yaml", """\
        rl:
          enabled: true
          arms:
            native_tis: {composition: native, settings: {train: {tis_threshold: 2}}}
            isoexec: {composition: isoexec}
        """)
    assert snakemake(wf, "-n", "--cores", "1", "--configfile", str(ok)).returncode == 0
    cold = write_config(wf / "cold.yaml", "rl: {settings: {warmup_sft_steps: 0}}\n")   # no warm-up: nothing shared
    assert snakemake(wf, "-n", "--cores", "1", "--configfile", str(bad), str(cold)).returncode == 0


# ------------------------------------------------------------------------------- real runs
def read_outputs(wf: Path, run: str) -> tuple[str, str, dict]:
    fig = wf / "figs" / run
    gates_md = (fig / "gates.md").read_text()
    contracts_md = (fig / "contracts.md").read_text()
    record = json.loads((wf / "res" / run / "gate_runs" / "dense.json").read_text())
    return gates_md, contracts_md, record


def run_args(run: str, *extra: str, tables_only: bool = False) -> list[str]:
    """A real run into res/<run> and figs/<run>; ``tables_only`` builds just the gate and contract
    tables of the dense family (the tests about gate failures assert about dense only and need
    neither the benchmarks nor the RL runs)."""
    targets = [f"figs/{run}/gates.md", f"figs/{run}/contracts.md"] if tables_only else []
    dense = ["families=[dense]"] if tables_only else []
    return ["--cores", "all", *targets, "--config", f"run_name={run}", "results_dir=res", "figures_dir=figs",
            *dense, *extra]


def test_failing_gates_are_recorded_and_the_workflow_finishes(wf):
    """Gates of the native composition fail on CPU (stock kernels are batch-variant): `gates run`
    exits 1, which is recorded; the isoexec contract then has no artifact of its own and is not
    admitted; the native contract claims no tolerance 0 (n.a.). Real CLI, dense family only."""
    cfg = write_config(wf / "native_gates.yaml", "gates: {composition: native, seed: 3}\n")
    r = snakemake(wf, *run_args("neg", "--configfile", str(cfg), tables_only=True))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    gates_md, contracts_md, record = read_outputs(wf, "neg")
    assert record["status"] == "failed" and record["returncode"] == 1 and record["seed"] == 3
    assert record["composition"] == "native"
    rows = [ln for ln in gates_md.splitlines() if ln.startswith("| dense |") and "`" in ln]
    assert rows and any(ln.split("|")[9].strip() == "fail" for ln in rows)
    assert "FAILED:" in gates_md
    assert re.search(r"\| dense \| isoexec \| \d+ \| claimed \| not admitted \|", contracts_md)
    assert re.search(r"\| dense \| native \| \d+ \| not claimed \| n\.a\. \|", contracts_md)
    assert "no artifact for gate(s)" in contracts_md
    admission = json.loads((wf / "res/neg/contracts/dense/isoexec.admission.json").read_text())
    assert admission["built_with_gates"] is False
    # the kept draft is byte-identical to the draft build
    assert ((wf / "res/neg/contracts/dense/isoexec.json").read_bytes()
            == (wf / "res/neg/contracts/dense/isoexec.draft.json").read_bytes())


FAKE_ISOEXEC = """\
#!{python}
# Stands in for `isoexec gates run`; everything else goes to the real CLI.
import os, sys
if sys.argv[1:3] == ["gates", "run"]:
    mode = os.environ["FAKE_GATES"]
    if mode == "stop":
        print("isoexec: error: region act, case trainer_score: cannot import 'isoexec_kernels.nope'", file=sys.stderr)
        sys.exit(1)
    print("isoexec: error: unknown composition 'nope'", file=sys.stderr)
    sys.exit(2)
from isoexec.cli import main
sys.exit(main())
"""


def fake_env(tmp_path: Path, mode: str) -> dict:
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    exe = bindir / "isoexec"
    exe.write_text(FAKE_ISOEXEC.format(python=sys.executable))
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "FAKE_GATES": mode}


# The fake gate runs below assert about the isoexec contract only: the native composition's contract
# jobs (4 CLI start-ups) would add nothing to them.
ISOEXEC_ONLY = "compositions=[isoexec]"


def test_a_gate_run_that_stops_early_is_recorded_as_missing(wf, tmp_path):
    r = snakemake(wf, *run_args("stop", ISOEXEC_ONLY, tables_only=True), env=fake_env(tmp_path, "stop"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    gates_md, contracts_md, record = read_outputs(wf, "stop")
    assert record["status"] == "error" and "cannot import 'isoexec_kernels.nope'" in record["error"]
    assert "stopped after 0 artifact(s)" in gates_md and "No gate artifact was written." in gates_md
    assert "the gate run stopped early" in gates_md
    assert re.search(r"\| dense \| isoexec \| \d+ \| claimed \| not admitted \|.*stopped early", contracts_md)


def test_bad_input_to_the_gates_fails_the_job(wf, tmp_path):
    r = snakemake(wf, *run_args("bad", ISOEXEC_ONLY, tables_only=True), env=fake_env(tmp_path, "bad"))
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "exited 2 (bad input)" in out and "unknown composition 'nope'" in out
    assert not (wf / "figs/bad/gates.md").exists()
    assert not (wf / "res/bad/gates/dense").exists()  # a failed directory output is removed


FAKE_GPU_ISOEXEC = """\
#!{python}
# `contract build` writes a stub; `gates run` records the devices it was given, holds them a while.
import json, os, pathlib, sys, time
args = sys.argv[1:]
out = pathlib.Path(args[args.index("--out") + 1])
if args[:2] == ["contract", "build"]:
    out.write_text("{{}}")
    sys.exit(0)
family = args[args.index("--family") + 1]
pathlib.Path(os.environ["CVD_LOG"], family).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
time.sleep(3)
print(json.dumps({{"passed": True, "gates": []}}))
"""


def test_local_gpu_jobs_each_get_a_device_of_their_own(wf, tmp_path):
    """Two gate jobs at once (each asking for gpu=1, of gpu=2) on a machine whose visible GPUs are 3
    and 5: one runs on 3, the other on 5, and each log says which."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "isoexec").write_text(FAKE_GPU_ISOEXEC.format(python=sys.executable))
    (bindir / "isoexec").chmod(0o755)
    seen = tmp_path / "seen"
    seen.mkdir()
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "CUDA_VISIBLE_DEVICES": "3,5",
           "CVD_LOG": str(seen), "ISOEXEC_GPU_LOCK_DIR": str(tmp_path / "locks")}
    r = snakemake(wf, "res/cpu/gate_runs/dense.json", "res/cpu/gate_runs/hybrid.json", "--cores", "2",
                  "--resources", "gpu=2", "--set-resources", "gates:gpu=1", "--set-threads", "gates=1",
                  "--config", "results_dir=res", env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = {f: (seen / f).read_text() for f in ("dense", "hybrid")}
    assert sorted(got.values()) == ["3", "5"], got
    for f, dev in got.items():
        assert f"# CUDA_VISIBLE_DEVICES={dev}" in (wf / f"res/cpu/logs/gates/{f}.log").read_text()


def test_the_bench_rule_accepts_every_benchmark_the_cli_has():
    """The `bench` rule's wildcard constraint names the benchmarks it can make: a name the CLI and
    the schema accept but the rule does not would leave the kernels table without an input. The
    benchmarks of several ranks (torchrun) are the CLI's only."""
    from isoexec.bench import BENCHES, DISTRIBUTED_BENCHES

    text = (REPO / "workflow/rules/bench.smk").read_text()
    names = re.search(r'name="([\w|]+)"', text.split("rule bench:", 1)[1]).group(1).split("|")
    assert DISTRIBUTED_BENCHES and set(DISTRIBUTED_BENCHES) <= set(BENCHES)
    assert sorted(names) == sorted(set(BENCHES) - set(DISTRIBUTED_BENCHES))


def test_the_schemas_compositions_are_the_composition_files():
    """The workflow schema names every composition of configs/compositions/ and no other."""
    import yaml

    from isoexec.paths import configs_dir

    schema = yaml.safe_load((configs_dir().parent / "workflow/schemas/config.schema.yaml").read_text())
    files = {p.stem for p in (configs_dir() / "compositions").glob("*.yaml")}
    assert set(schema["$defs"]["composition"]["enum"]) == files
