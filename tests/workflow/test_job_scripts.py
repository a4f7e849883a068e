"""The workflow's job helpers (workflow/scripts/): a GPU per job, the code version, and the RL run's
inputs and resume checks (rl_run.py with a stand-in `isoexec run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

import code_version  # noqa: E402
import gpus  # noqa: E402


# ------------------------------------------------------------------------------- GPUs
@pytest.fixture
def gpu_env_vars(tmp_path):
    def make(devices: str | None) -> dict:
        env = {"ISOEXEC_GPU_LOCK_DIR": str(tmp_path / "locks"), "PATH": os.environ.get("PATH", "")}
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        return env
    return make


def test_a_job_without_gpus_keeps_its_environment(gpu_env_vars):
    env = gpu_env_vars("0,1")
    with gpus.gpu_env(0, env) as out:
        assert out == env


def test_concurrent_jobs_get_different_devices_and_release_them(gpu_env_vars):
    env = gpu_env_vars("GPU-aaa,GPU-bbb,GPU-ccc")
    with gpus.gpu_env(1, env) as a, gpus.gpu_env(2, env) as b:
        assert a["CUDA_VISIBLE_DEVICES"] == "GPU-aaa" and b["CUDA_VISIBLE_DEVICES"] == "GPU-bbb,GPU-ccc"
        with pytest.raises(gpus.NoGPU, match="no 1 free GPU"):
            with gpus.gpu_env(1, env, timeout_s=0.2, poll_s=0.05):
                pass
    with gpus.gpu_env(3, env) as c:   # all released
        assert c["CUDA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb,GPU-ccc"


def test_a_waiting_job_gets_the_device_when_it_is_freed(gpu_env_vars):
    env = gpu_env_vars("7")
    said, got = [], []
    with gpus.gpu_env(1, env):
        t = threading.Thread(target=lambda: got.append(
            gpus.gpu_env(1, env, log=said.append, poll_s=0.05).__enter__()["CUDA_VISIBLE_DEVICES"]))
        t.start()
        time.sleep(0.3)
        assert not got and said and said[0].startswith("waiting for 1 free GPU(s) among 7")
    t.join(5)
    assert got == ["7"]


def test_a_killed_job_frees_its_device(gpu_env_vars, tmp_path):
    env = gpu_env_vars("0")
    holder = subprocess.Popen([sys.executable, "-c", (
        f"import sys, time; sys.path.insert(0, {str(REPO / 'workflow/scripts')!r}); import gpus\n"
        f"with gpus.gpu_env(1, {env!r}):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(gpus.NoGPU):
            with gpus.gpu_env(1, env, timeout_s=0.2, poll_s=0.05):
                pass
    finally:
        holder.kill()
        holder.wait()
    with gpus.gpu_env(1, env, timeout_s=5, poll_s=0.05) as out:
        assert out["CUDA_VISIBLE_DEVICES"] == "0"


def test_asking_for_more_gpus_than_visible_fails_at_once(gpu_env_vars):
    with pytest.raises(gpus.NoGPU, match=r"asks for 2 GPU\(s\) but 1 are visible \(CUDA_VISIBLE_DEVICES='4'\)"):
        with gpus.gpu_env(2, gpu_env_vars("4")):
            pass
    assert gpus.visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert gpus.visible_devices({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_without_cuda_visible_devices_nvidia_smi_lists_the_gpus(gpu_env_vars, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-1)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-2)'\n")
    smi.chmod(0o755)
    env = {**gpu_env_vars(None), "PATH": str(bindir)}
    assert gpus.visible_devices(env) == ["0", "1"]
    with gpus.gpu_env(1, env) as a, gpus.gpu_env(1, env) as b:
        assert {a["CUDA_VISIBLE_DEVICES"], b["CUDA_VISIBLE_DEVICES"]} == {"0", "1"}
    assert gpus.visible_devices({"PATH": str(tmp_path / "nothing")}) == []


def test_slurm_jobs_lock_in_a_folder_of_their_own():
    a, b = gpus.lock_dir({"SLURM_JOB_ID": "11"}), gpus.lock_dir({"SLURM_JOB_ID": "12"})
    assert a != b and a.name.endswith("-slurm11") and gpus.lock_dir({}) not in (a, b)


# ------------------------------------------------------------------------------- code version
def test_the_code_version_follows_python_sources_only(tmp_path):
    pkg, kern = tmp_path / "isoexec", tmp_path / "isoexec_kernels"
    for d in (pkg / "sub", kern, pkg / "__pycache__"):
        d.mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (kern / "k.py").write_text("z = 3\n")
    (pkg / "__pycache__" / "a.cpython-311.py").write_text("junk")
    roots = {"isoexec": pkg, "isoexec_kernels": kern}
    v0, n = code_version.code_version(roots)
    assert n == 3
    (pkg / "notes.md").write_text("not code")
    (pkg / "__pycache__" / "a.cpython-311.py").write_text("other junk")
    assert code_version.code_version(roots)[0] == v0
    (kern / "k.py").write_text("z = 4\n")
    v1 = code_version.code_version(roots)[0]
    assert v1 != v0
    (kern / "k.py").write_text("z = 3\n")
    assert code_version.code_version(roots)[0] == v0
    (pkg / "sub" / "b.py").rename(pkg / "b.py")   # same bytes, other path
    assert code_version.code_version(roots)[0] != v0


def test_the_version_file_is_written_only_when_it_changes(tmp_path):
    f = tmp_path / "run" / "code_version.txt"
    assert code_version.write_if_changed(f, "sha256 aa\n")
    os.utime(f, (1_000_000, 1_000_000))
    assert not code_version.write_if_changed(f, "sha256 aa\n")
    assert f.stat().st_mtime == 1_000_000
    assert code_version.write_if_changed(f, "sha256 bb\n")
    assert f.read_text() == "sha256 bb\n" and f.stat().st_mtime > 1_000_000


def test_the_installed_packages_are_hashed():
    dirs = code_version.package_dirs()
    assert set(dirs) == {"isoexec", "isoexec_kernels"}
    assert (dirs["isoexec"] / "cli.py").is_file() and (dirs["isoexec_kernels"] / "__init__.py").is_file()
    text = code_version.version_text(dirs)
    assert text.startswith("sha256 ") and len(text.split()[1]) == 64


# ------------------------------------------------------------------------------- RL run inputs
def test_the_rl_fingerprint_names_what_changed(tmp_path):
    sys.modules.pop("rl_run", None)
    import rl_run

    contract, data, code = tmp_path / "c.json", tmp_path / "d.parquet", tmp_path / "code_version.txt"
    contract.write_text("{}")
    data.write_bytes(b"rows")
    code.write_text("sha256 aa\n")
    settings = {"steps": 2, "dataset": str(data), "train": {"lr": 1e-3}, "wandb": {"enabled": True}}
    before = rl_run.fingerprint(settings, contract, code)
    assert "wandb" not in before["settings"] and before["checkpoint"] is None
    assert rl_run.changed(before, rl_run.fingerprint(settings, contract, code)) == []
    data.write_bytes(b"other rows")
    code.write_text("sha256 bb\n")
    now = rl_run.fingerprint({**settings, "steps": 3, "train": {"lr": 2e-3}, "wandb": {}}, contract, code)
    assert rl_run.changed(before, now) == ["settings.steps", "settings.train", "data", "code"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert rl_run.fingerprint({**settings, "checkpoint": str(ckpt)}, contract, code)["checkpoint"][0][:2] == [
        "config.json", 2]


def test_a_shared_warmup_is_known_by_its_weights_and_named_in_run_json(tmp_path):
    """A run from the shared warm-up's folder: inputs.json holds the SHA-256 of its weights (a warm-up
    made again with the same bits is no change, other bits are), and run.json's `started_from` names
    the folder, that SHA-256 and the warm-up's composition; without a checkpoint it names the in-run
    warm-up and its composition."""
    import hashlib

    sys.modules.pop("rl_run", None)
    import rl_run

    contract, code, w = tmp_path / "c.json", tmp_path / "code_version.txt", tmp_path / "warmup"
    contract.write_text("{}")
    code.write_text("sha256 aa\n")
    w.mkdir()
    (w / "config.json").write_text("{}")
    (w / "model.safetensors").write_bytes(b"weights")
    (w / "warmup.json").write_text(json.dumps({"composition": "native", "settings": {"warmup_sft_steps": 4},
                                               "nll": [6.0, 2.0, 1.0]}))
    settings = {"steps": 2, "checkpoint": str(w), "composition": "isoexec", "warmup_sft_steps": 4}
    before = rl_run.fingerprint(settings, contract, code)
    digest = hashlib.sha256(b"weights").hexdigest()
    assert before["checkpoint"] == {"warmup_weights_sha256": digest}
    time.sleep(0.01)
    (w / "model.safetensors").write_bytes(b"weights")       # made again: same bits, a new mtime
    assert rl_run.changed(before, rl_run.fingerprint(settings, contract, code)) == []
    (w / "model.safetensors").write_bytes(b"other weights")
    assert rl_run.changed(before, rl_run.fingerprint(settings, contract, code)) == ["checkpoint"]
    (w / "model.safetensors").write_bytes(b"weights")
    assert rl_run.started_from(settings) == {"weights": "shared warm-up", "checkpoint": str(w), "sha256": digest,
                                             "warmup_composition": "native", "warmup_sft_steps": 4,
                                             "warmup_nll": [6.0, 1.0]}
    assert rl_run.started_from({**settings, "checkpoint": None, "seed": 0}) == {
        "weights": "random", "seed": 0, "warmup_sft_steps": 4, "warmup_composition": "isoexec"}
    (w / "warmup.json").unlink()   # any other checkpoint folder: its path, and its file listing in inputs.json
    assert rl_run.started_from(settings) == {"weights": "checkpoint", "checkpoint": str(w)}
    assert rl_run.fingerprint(settings, contract, code)["checkpoint"][0][:2] == ["config.json", 2]


FAKE_RUN = """\
#!{python}
# Stands in for `isoexec run`: records whether it found a checkpoint, runs STEPS_RUN steps.
import json, os, pathlib, sys
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
pathlib.Path(os.environ["CALLED"]).write_text("checkpoint" if (out / "checkpoint.pt").exists() else "fresh")
pathlib.Path(os.environ["CALLED"] + ".threads").write_text(os.environ.get("OMP_NUM_THREADS", "unset"))
n = int(os.environ["STEPS_RUN"])
with open(out / "metrics.jsonl", "a") as f:
    for i in range(n):
        f.write(json.dumps({{"step": i}}) + "\\n")
if n:
    print(json.dumps({{"steps_run": n}}))
"""


@pytest.fixture
def rl_job(tmp_path, monkeypatch):
    """rl_run.main on a run folder, with a stand-in `isoexec run` and the inputs of a finished
    2-step run; returns (run it, the folder, the contract file, the code version file)."""
    sys.modules.pop("rl_run", None)
    import rl_run
    from types import SimpleNamespace

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "isoexec").write_text(FAKE_RUN.format(python=sys.executable))
    (bindir / "isoexec").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("CALLED", str(tmp_path / "called"))
    contract, data, code = tmp_path / "c.json", tmp_path / "d.parquet", tmp_path / "code_version.txt"
    contract.write_text("{}")
    data.write_bytes(b"rows")
    code.write_text("sha256 aa\n")
    folder = tmp_path / "runs" / "seed0"
    folder.mkdir(parents=True)
    settings = {"steps": 2, "dataset": str(data)}
    (folder / "checkpoint.pt").write_bytes(b"state")
    (folder / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (folder / "inputs.json").write_text(json.dumps(rl_run.fingerprint(settings, contract, code)))
    (folder / "run.json").write_text(json.dumps({"steps_done": 2}))

    def run(resume: bool, steps_run: int, steps: int = 2):
        monkeypatch.setenv("STEPS_RUN", str(steps_run))
        smk = SimpleNamespace(output=[str(folder)], log=[str(tmp_path / "rl.log")], rule="rl_run",
                              params=SimpleNamespace(rl={**settings, "steps": steps}), config={"resume": resume},
                              input=SimpleNamespace(contract=str(contract), code=str(code)),
                              resources=SimpleNamespace(gpu=0), threads=3)
        rl_run.main(smk)
    return run, folder, contract, code


def test_a_resumed_run_with_nothing_left_fails_when_an_input_changed(rl_job, tmp_path):
    run, folder, contract, code = rl_job
    contract.write_text('{"other": 1}')
    with pytest.raises(SystemExit) as e:   # known from run.json: no model is loaded
        run(resume=True, steps_run=0)
    assert str(e.value) == (f"rl_run: resume=true, but {folder} had already run all 2 steps with other inputs "
                            "(contract); its results would be stale: rerun without resume=true to start it clean")
    assert not (tmp_path / "called").exists()
    assert (tmp_path / "rl.log").read_text().splitlines()[-1] == str(e.value)
    (folder / "run.json").unlink()   # killed after its last checkpoint, before run.json: the run says it
    code.write_text("sha256 bb\n")
    with pytest.raises(SystemExit, match=r"other inputs \(contract, code\)"):
        run(resume=True, steps_run=0)
    assert (tmp_path / "called").read_text() == "checkpoint"


def test_a_resumed_run_with_steps_left_goes_on_and_names_what_changed(rl_job, tmp_path):
    run, folder, contract, code = rl_job
    code.write_text("sha256 bb\n")
    run(resume=True, steps_run=1, steps=3)
    done = json.loads((folder / "run.json").read_text())
    assert done["resumed"] is True and done["inputs_changed_since_start"] == ["settings.steps", "code"]
    assert done["steps_done"] == 3 and (tmp_path / "called").read_text() == "checkpoint"
    assert "inputs changed since it started: settings.steps, code" in (tmp_path / "rl.log").read_text()


def test_a_resumed_run_with_unchanged_inputs_and_nothing_left_succeeds(rl_job, tmp_path):
    run, folder, _, _ = rl_job
    run(resume=True, steps_run=0)
    done = json.loads((folder / "run.json").read_text())
    assert done["summary"] == {"steps_run": 0} and done["inputs_changed_since_start"] == [] and done["steps_done"] == 2


def test_without_resume_a_run_starts_clean(rl_job, tmp_path):
    run, folder, contract, _ = rl_job
    contract.write_text('{"other": 1}')
    run(resume=False, steps_run=2)
    assert (tmp_path / "called").read_text() == "fresh" and not (folder / "checkpoint.pt").exists()
    assert (tmp_path / "called.threads").read_text() == "3"   # the command runs on the job's threads
    done = json.loads((folder / "run.json").read_text())
    assert done["resumed"] is False and done["steps_done"] == 2
