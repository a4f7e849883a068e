"""The workflow's RL jobs (thin wrappers the Snakemake rules call)."""

from __future__ import annotations

import json
from pathlib import Path

from ..paths import atomic_write


def make_synthetic(out: str, params: dict, seed: int, log: str) -> None:
    from ..report import run_cli

    with open(log, "w") as lf:
        run_cli(["data", "synthetic", "--params", json.dumps(dict(params)), "--seed", str(seed), "--out", out], lf)


def run_job(settings: dict, done: str, log: str) -> None:
    """Run (or resume) one RL run in the folder of ``done``; write ``done`` when it finishes."""
    from ..report import run_cli

    folder = Path(done).parent
    cfg_path = folder / "rl_config.json"
    atomic_write(cfg_path, json.dumps(settings, indent=1, sort_keys=True) + "\n")
    with open(log, "a") as lf:
        proc = run_cli(["run", "--config", str(cfg_path), "--out", str(folder)], lf)
    summary = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    atomic_write(done, json.dumps({"settings": settings, "summary": summary}, indent=1, sort_keys=True) + "\n")


def render(done_files, first_output: str, run: str, log: str) -> None:
    """Tables and figures from the runs whose run.json markers are ``done_files``."""
    from .tables import run_from_folder, render_tables

    runs = [run_from_folder(Path(d).parent) for d in done_files]
    pooled = render_tables(runs, Path(first_output).parent, run)
    Path(log).write_text(f"{len(runs)} runs rendered: {sorted(pooled)}\n")
