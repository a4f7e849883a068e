"""Rule rl_run: one RL run (family x arm x seed) in its folder, the rule's directory output.

* Clean start (the default): Snakemake removes the folder before the job, so the run starts at
  step 0 with nothing of an older run left (no checkpoint to trip over or to resume silently).
* Resume (``snakemake --config resume=true``): the rule flags the folder ``update()``, so
  Snakemake keeps it (and a backup, restored if the job fails) and ``isoexec run`` continues from
  its checkpoint: a run killed mid-way, or a finished run given more ``steps``. The inputs the run
  started with are in ``inputs.json`` (settings, SHA-256 of the contract and the data, the code
  version, the checkpoint folder's file list, or the SHA-256 of a shared warm-up's weights); a
  resume with other settings than ``steps`` or another data set is refused before any work, and a
  resumed run that had nothing left to do while
  its inputs changed (the contract, the code version, the checkpoint) fails with one line instead of
  keeping results made from the old inputs. A resumed run with steps left under such changes (say, a
  code fix after a walltime kill) goes on, and its log and ``run.json`` name what changed.

Files in the folder: rl_config.json (the settings ``isoexec run`` got), inputs.json, metrics.jsonl,
checkpoint.pt (every ``checkpoint_every`` steps), run.json (written last: settings, the run's
summary, whether it resumed, what its weights started from: the shared warm-up's folder and the
SHA-256 of its weights, a checkpoint, or a random init warmed up in the run).
"""


import hashlib
import json
import shutil
from pathlib import Path

from jobutil import JobFailed, job
from launch import rl_launcher, rl_nodes, rl_world

from isoexec.paths import atomic_write, sha256_file
from isoexec.report import run_cli

UNCHECKED = ("steps", "wandb")   # a finished run may be extended; logging changes no result


def file_digest(path) -> str | None:
    """SHA-256 of a file, or of a folder's files (names and bytes); None when missing."""
    p = Path(path)
    if p.is_file():
        return sha256_file(p)
    if p.is_dir():
        h = hashlib.sha256()
        for q in sorted(x for x in p.rglob("*") if x.is_file()):
            h.update(q.relative_to(p).as_posix().encode() + b"\0" + bytes.fromhex(file_digest(q)))
        return h.hexdigest()
    return None


def listing(path) -> list | None:
    """(name, size, mtime) of a checkpoint folder's files: cheap where hashing GBs of weights is not."""
    p = Path(path)
    if not p.is_dir():
        return None
    return [[q.relative_to(p).as_posix(), q.stat().st_size, q.stat().st_mtime_ns]
            for q in sorted(x for x in p.rglob("*") if x.is_file())]


def is_shared_warmup(folder) -> bool:
    """A checkpoint folder made by `isoexec warmup` (rule rl_warmup): it holds the record
    warmup.json (isoexec.rl.warmup.RECORD)."""
    return (Path(folder) / "warmup.json").is_file()


def checkpoint_print(folder):
    """A checkpoint folder's identity: the SHA-256 of a shared warm-up's weights (small, and the same
    bits when the warm-up is made again from the same inputs), else the file listing."""
    if is_shared_warmup(folder):
        return {"warmup_weights_sha256": file_digest(Path(folder) / "model.safetensors")}
    return listing(folder)


def fingerprint(settings: dict, contract, code) -> dict:
    """What a run's results are made of."""
    return {"settings": {k: v for k, v in settings.items() if k != "wandb"},
            "contract": file_digest(contract),
            "data": file_digest(settings["dataset"]) if settings.get("dataset") else None,
            "checkpoint": checkpoint_print(settings["checkpoint"]) if settings.get("checkpoint") else None,
            "code": Path(code).read_text()}


def changed(before: dict, now: dict) -> list[str]:
    """The inputs that differ: ``settings.<key>`` per setting, else the input's name."""
    out = []
    old_s, new_s = before.get("settings") or {}, now.get("settings") or {}
    out += [f"settings.{k}" for k in sorted(set(old_s) | set(new_s)) if old_s.get(k) != new_s.get(k)]
    out += [k for k in ("contract", "data", "checkpoint", "code") if before.get(k) != now.get(k)]
    return out


def started_from(settings: dict) -> dict:
    """What the run's weights started from: the shared warm-up's folder (its path, the SHA-256 of its
    weights, the warm-up's composition, steps and NLL), a checkpoint (its path), or a random init
    warmed up in the run itself (with the run's own composition)."""
    ckpt = settings.get("checkpoint")
    if not ckpt:
        steps = int(settings.get("warmup_sft_steps", 0))
        return {"weights": "random", "seed": settings.get("seed"), "warmup_sft_steps": steps,
                "warmup_composition": settings.get("composition") if steps else None}
    if is_shared_warmup(ckpt):
        rec = json.loads((Path(ckpt) / "warmup.json").read_text())
        nll = rec.get("nll") or []
        return {"weights": "shared warm-up", "checkpoint": ckpt,
                "sha256": file_digest(Path(ckpt) / "model.safetensors"), "warmup_composition": rec.get("composition"),
                "warmup_sft_steps": (rec.get("settings") or {}).get("warmup_sft_steps"),
                "warmup_nll": [nll[0], nll[-1]] if nll else None}
    return {"weights": "checkpoint", "checkpoint": ckpt}


def steps_done(folder: Path) -> int:
    """Steps a finished invocation left in the folder (run.json, written last; 0 if none). A run that
    went further and was killed before writing run.json has left more, never fewer."""
    try:
        return int(json.loads((folder / "run.json").read_text()).get("steps_done", 0))
    except (OSError, ValueError, AttributeError):
        return 0


def nothing_left(folder: Path, settings: dict, diff: list[str]) -> str:
    return (f"resume=true, but {folder} had already run all {settings['steps']} steps with other inputs "
            f"({', '.join(diff)}); its results would be stale: rerun without resume=true to start it clean")


def main(smk) -> None:
    folder = Path(smk.output[0])
    settings = dict(smk.params.rl)
    resume = bool(smk.config.get("resume", False))
    with job(smk) as env, open(smk.log[0], "a") as log:
        now = fingerprint(settings, smk.input.contract, smk.input.code)
        resumed = resume and (folder / "checkpoint.pt").is_file()
        diff: list[str] = []
        if resumed:
            try:
                before = json.loads((folder / "inputs.json").read_text())
            except (OSError, ValueError):
                before = {}
            diff = changed(before, now) if before else ["unknown (the folder has no readable inputs.json)"]
            bad = [d for d in diff if d.startswith("settings.") and d[len("settings."):] not in UNCHECKED]
            if bad:
                raise JobFailed(f"resume=true, but {folder} was started with other settings "
                                f"({', '.join(b[len('settings.'):] for b in bad)}); rerun without resume=true to "
                                "start it clean")
            if "data" in diff:   # the prompt stream's position means nothing in another data set
                raise JobFailed(f"resume=true, but the data set of {folder} changed since it started; rerun "
                                "without resume=true to start it clean")
            if diff and steps_done(folder) >= settings["steps"]:   # known before loading any model
                raise JobFailed(nothing_left(folder, settings, diff))
            log.write(f"# resuming {folder} from its checkpoint; inputs changed since it started: "
                      f"{', '.join(diff) or 'none'}\n")
        elif folder.exists():   # Snakemake removes the folder first; this one was made by hand
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        cfg = folder / "rl_config.json"
        atomic_write(cfg, json.dumps(settings, indent=1, sort_keys=True) + "\n")
        atomic_write(folder / "inputs.json", json.dumps(now, indent=1, sort_keys=True) + "\n")
        # more than one GPU: one torchrun rank per GPU; more than one node: srun starts a torchrun
        # on each node of the SLURM job (workflow/scripts/launch.py)
        proc = run_cli(["run", "--config", str(cfg), "--out", str(folder)], log, env=env,
                       launcher=rl_launcher(rl_world(smk.config), rl_nodes(smk.config)))
        out = proc.stdout.strip()
        summary = json.loads(out.splitlines()[-1]) if out else {"steps_run": 0}
        if resumed and not out and diff:   # the checkpoint was further on than the last run.json said
            raise JobFailed(nothing_left(folder, settings, diff))
        n = len((folder / "metrics.jsonl").read_text().splitlines())
        atomic_write(folder / "run.json", json.dumps(
            {"settings": settings, "summary": summary, "steps_done": n, "resumed": resumed,
             "inputs_changed_since_start": diff, "started_from": started_from(settings)}, indent=1,
            sort_keys=True) + "\n")


if __name__ == "__main__":
    main(snakemake)  # noqa: F821 - set by Snakemake's script directive
