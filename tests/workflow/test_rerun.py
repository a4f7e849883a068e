"""Reruns never serve stale results (docs/workflow.md).

After an upstream change with the same params (the data set), a params change, or an edit to the
package, the workflow reruns what the change affects, and its tables and run metrics equal those of
a clean run with the new inputs. RL runs start clean unless `--config resume=true`; a resumed run
with nothing left to do while its inputs changed fails with one line, and one with steps left
continues from its checkpoint.

Small settings, so that the four workflow runs take about a minute on 2 cores: the dense family, the
isoexec composition only, no benchmarks, a stand-in for `gates run` (the gates have their own tests;
here a stopped gate run is recorded and the draft contract is kept), a 4-step shared warm-up (rule
rl_warmup), 2 RL steps of 2 prompts x 2 samples without dynamic sampling (every step trains, so a
learning-rate change shows in step 1). The warm-up reruns with what it reads (the data, the
learning rate, the code) and the runs with it; an RL-only setting leaves it alone. The package and
kernel sources run from a copy on PYTHONPATH: the test edits that
copy (a code change), and edits in the checkout meanwhile cannot change the code version under it.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CONFIG = """\
    families: [dense]
    compositions: [isoexec]
    benchmarks: {names: []}
    rl:
      enabled: true
      synthetic: {n: 40, max_operand: 9, min_terms: 2, max_terms: 2, ops: "+"}
      settings:
        steps: 2
        prompts_per_step: 2
        samples_per_prompt: 2
        mini_batch_size: 1
        max_prompt_tokens: 24
        max_response_tokens: 8
        overlong_cache: 2
        prompt_style: compact
        dynamic_sampling: false
        warmup_sft_steps: 4
        warmup_batch_size: 4
        train: {lr: 3.0e-3}
    """

FAKE_ISOEXEC = """\
#!{python}
# Stands in for `isoexec gates run` (a run stopped before any gate: recorded, the draft is kept);
# everything else goes to the real CLI.
import sys
if sys.argv[1:3] == ["gates", "run"]:
    print("isoexec: error: gates are not run in this test", file=sys.stderr)
    sys.exit(1)
from isoexec.cli import main
sys.exit(main())
"""

RUN = "res/cpu/runs/dense/isoexec/seed0"
pytestmark = pytest.mark.slow   # about 3 min on 2 cores: eight workflow runs and three dry runs (-m "not slow" skips them)


def make_workspace(root: Path, pkgs: Path, bindir: Path) -> dict:
    """A copy of the workflow in ``root`` and the environment its runs use."""
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("Snakefile", "environment.yml"):
        shutil.copy2(REPO / name, root / name)
    for name in ("workflow", "configs", "profiles"):
        shutil.copytree(REPO / name, root / name, ignore=ignore)
    # the workflow schema refers to the package's RL config schema by its place in the checkout
    (root / "isoexec/rl").mkdir(parents=True)
    shutil.copy2(REPO / "isoexec/rl/config.schema.yaml", root / "isoexec/rl/config.schema.yaml")
    return {**os.environ, "PYTHONPATH": str(pkgs), "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


def snakemake(cwd: Path, env: dict, config: str, *extra: str) -> subprocess.CompletedProcess:
    (cwd / "small.yaml").write_text(textwrap.dedent(config))
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "small.yaml",
                           "--config", "results_dir=res", "figures_dir=figs", *extra],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def ran(r: subprocess.CompletedProcess) -> set[str]:
    """The rules whose jobs finished in a Snakemake run."""
    return {ln.split("(Rule: ", 1)[1].rstrip(")") for ln in (r.stdout + r.stderr).splitlines()
            if "(Rule: " in ln and "Finished" in ln}


def metrics(root: Path) -> list[dict]:
    """The run's metrics lines without their timings."""
    lines = [json.loads(ln) for ln in (root / RUN / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.startswith("time_")} for x in lines]


def tables(root: Path) -> dict[str, str]:
    """The tables whose content does not depend on timing (runs.csv without its timing columns)."""
    out = {n: (root / "figs/cpu" / n).read_text() for n in ("gates.md", "gates.csv", "contracts.md", "contracts.csv",
                                                           "logprob_diff.md")}
    rows = list(csv.DictReader(io.StringIO((root / "figs/cpu/runs.csv").read_text())))
    out["runs.csv"] = json.dumps([{k: v for k, v in r.items() if not k.startswith("t_")} for r in rows])
    return out


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def reruns(tmp_path_factory):
    """Workspace A: a clean run, then a data change, then a learning-rate change together with an edit
    to the package. Workspace B: one clean run with A's final inputs. Returns what each step did."""
    tmp = tmp_path_factory.mktemp("reruns")
    pkgs = tmp / "pkgs"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "isoexec", pkgs / "isoexec", ignore=ignore)
    shutil.copytree(REPO / "isoexec_kernels", pkgs / "isoexec_kernels", ignore=ignore)
    bindir = tmp / "bin"
    bindir.mkdir()
    (bindir / "isoexec").write_text(FAKE_ISOEXEC.format(python=sys.executable))
    (bindir / "isoexec").chmod(0o755)
    a, b = tmp / "a", tmp / "b"
    env = make_workspace(a, pkgs, bindir)
    make_workspace(b, pkgs, bindir)
    out = {"a": a, "b": b, "env": env}

    ok(snakemake(a, env, CONFIG))
    out["clean"] = {"metrics": metrics(a), "code": (a / "res/cpu/code_version.txt").read_text()}

    data_changed = CONFIG.replace("max_operand: 9", "max_operand: 8")
    out["data_run"] = ok(snakemake(a, env, data_changed))
    out["data"] = {"metrics": metrics(a), "log": (a / "res/cpu/logs/runs/dense_isoexec_seed0.log").read_text()}

    final = data_changed.replace("lr: 3.0e-3", "lr: 1.0e-2")
    with open(pkgs / "isoexec" / "rl" / "reward.py", "a") as f:   # an edit that changes no result
        f.write("\n# edited by tests/workflow/test_rerun.py\n")
    out["final_run"] = ok(snakemake(a, env, final))
    out["final"] = {"metrics": metrics(a), "tables": tables(a), "code": (a / "res/cpu/code_version.txt").read_text()}

    ok(snakemake(b, env, final))
    out["clean_b"] = {"metrics": metrics(b), "tables": tables(b)}
    out["config"] = final
    return out


def test_an_upstream_change_with_the_same_params_reruns_the_runs_clean(reruns):
    """A new data set (same RL params) reruns the data, the runs and their tables, not the contracts,
    and each run starts again at step 0 instead of resuming its finished checkpoint."""
    r = reruns["data_run"]
    assert ran(r) == {"synthetic_data", "rl_warmup", "rl_run", "rl_tables", "all"}, ran(r)
    assert reruns["data"]["metrics"] != reruns["clean"]["metrics"]
    assert [x["step"] for x in reruns["data"]["metrics"]] == [0, 1]
    assert "resum" not in reruns["data"]["log"]


def test_a_params_change_and_a_code_edit_rerun_what_they_affect(reruns):
    r = reruns["final_run"]
    assert reruns["final"]["code"] != reruns["clean"]["code"]
    # the code edit reruns every job that runs package code; the changed lr starts the run clean
    # (before, the old checkpoint stayed and the run stopped on a configuration mismatch)
    assert {"contract_draft", "contract_admit", "contract_show", "contract_verify", "gates", "synthetic_data",
            "rl_warmup", "rl_run", "gates_table", "contracts_table", "rl_tables"} <= ran(r), ran(r)
    assert reruns["final"]["metrics"] != reruns["data"]["metrics"]


def test_the_rerun_gives_the_tables_of_a_clean_run(reruns):
    assert reruns["final"]["metrics"] == reruns["clean_b"]["metrics"]
    for name, text in reruns["final"]["tables"].items():
        assert text == reruns["clean_b"]["tables"][name], name


def test_nothing_is_rerun_when_nothing_changed(reruns):
    r = ok(snakemake(reruns["b"], reruns["env"], reruns["config"], "-n"))
    assert "Nothing to be done" in r.stdout + r.stderr


def planned(r: subprocess.CompletedProcess) -> set[str]:
    """The rules a dry run would run."""
    return {ln.split("rule ", 1)[1].rstrip(":") for ln in r.stdout.splitlines()
            if ln.startswith(("rule ", "localrule "))}


def test_the_warmup_reruns_only_when_what_it_reads_changes(reruns):
    """On B (finished): a setting the warm-up reads (its batch size) reruns it and the run after it; an
    RL-only setting (the response length) reruns the run and leaves the warm-up as it is. Both arms'
    runs started from the warm-up: run.json names its folder and the SHA-256 of its weights."""
    b, env, config = reruns["b"], reruns["env"], reruns["config"]
    r = ok(snakemake(b, env, config.replace("warmup_batch_size: 4", "warmup_batch_size: 3"), "-n"))
    assert {"rl_warmup", "rl_run"} <= planned(r), planned(r)
    r = ok(snakemake(b, env, config.replace("max_response_tokens: 8", "max_response_tokens: 10"), "-n"))
    assert "rl_run" in planned(r) and "rl_warmup" not in planned(r), planned(r)
    start = json.loads((b / RUN / "run.json").read_text())["started_from"]
    record = json.loads((b / "res/cpu/warmup/dense/seed0/warmup.json").read_text())
    assert start["weights"] == "shared warm-up" and start["warmup_composition"] == "native"
    assert start["checkpoint"] == str((b / "res/cpu/warmup/dense/seed0").resolve())
    assert start["sha256"] == record["weights_sha256"]
    assert "warm-up SFT: 4 steps" in (b / "res/cpu/logs/warmup/dense_seed0.log").read_text()
    assert "starting from the shared warm-up" in (b / "res/cpu/logs/runs/dense_isoexec_seed0.log").read_text()


def test_resume_only_when_asked_and_never_over_changed_inputs(reruns):
    """On B (finished, 2 steps), with resume=true: fewer steps leave nothing to do under a changed
    input, which fails with one line and keeps the run as it was (no table is rendered from it); a
    new data set or a changed clip range (an RL setting; a changed learning rate would also remake the
    shared warm-up first) is refused before any work; more steps continue from the
    checkpoint. (Other changed inputs, the contract or the code, meet the same checks:
    tests/workflow/test_job_scripts.py.)"""
    b, env, config = reruns["b"], reruns["env"], reruns["config"]
    before, table_time = (b / RUN / "metrics.jsonl").read_text(), (b / "figs/cpu/logprob_diff.md").stat().st_mtime_ns
    r = snakemake(b, env, config.replace("steps: 2", "steps: 1"), "resume=true")
    assert r.returncode != 0
    line = next(ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("rl_run: resume=true"))
    assert f"{RUN} had already run all 1 steps with other inputs (settings.steps)" in line, line
    assert "without resume=true" in line
    assert (b / RUN / "metrics.jsonl").read_text() == before          # the run's folder is restored
    assert (b / "figs/cpu/logprob_diff.md").stat().st_mtime_ns == table_time   # and no table rendered from it

    r = snakemake(b, env, config.replace("lr: 1.0e-2", "lr: 1.0e-2, clip_low: 0.1"), "resume=true")
    assert "rl_warmup" not in ran(r)
    assert r.returncode != 0
    assert "was started with other settings (train); rerun without resume=true" in r.stdout + r.stderr

    longer = config.replace("steps: 2", "steps: 3")
    r = ok(snakemake(b, env, longer, "resume=true"))
    assert "rl_run" in ran(r)
    done = json.loads((b / RUN / "run.json").read_text())
    assert done["resumed"] is True and done["summary"]["steps_run"] == 1 and done["steps_done"] == 3
    assert done["inputs_changed_since_start"] == ["settings.steps"]
    assert metrics(b)[:2] == reruns["clean_b"]["metrics"] and [x["step"] for x in metrics(b)] == [0, 1, 2]
    assert "resumed from" in (b / "res/cpu/logs/runs/dense_isoexec_seed0.log").read_text()

    r = snakemake(b, env, longer.replace("max_operand: 8", "max_operand: 7"), "resume=true")
    assert r.returncode != 0 and f"rl_run: resume=true, but the data set of {RUN} changed" in r.stdout + r.stderr
