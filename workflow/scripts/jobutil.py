"""What every job script of the workflow shares (workflow/scripts/*.py; docs/workflow.md).

:func:`job` wraps a script's body: it hands out the job's GPUs (``resources: gpu``, see
gpus.py) and its threads (``OMP_NUM_THREADS``, the rule's ``threads``) as the environment for the
``isoexec`` commands, and turns a failure into one line, ``<rule>: <why>``, on stderr and at the
end of the job's log, with exit status 1.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, MutableMapping

from gpus import NoGPU, gpu_env
from isoexec.report import CommandFailed


class JobFailed(RuntimeError):
    """A job script found something it must not paper over (the message is the one line shown)."""


def _append(log_path, text: str) -> None:
    if log_path:
        with open(log_path, "a") as f:
            f.write(text + "\n")


@contextlib.contextmanager
def job(smk) -> Iterator[MutableMapping[str, str]]:
    """``with job(snakemake) as env:`` run the job's commands with ``env``."""
    log_path = smk.log[0] if len(smk.log) else None
    try:
        with gpu_env(int(getattr(smk.resources, "gpu", 0) or 0), log=lambda s: _append(log_path, f"# {s}")) as env:
            env["OMP_NUM_THREADS"] = str(smk.threads)   # torch's intra-op threads: the job's own cores
            yield env
    except (CommandFailed, JobFailed, NoGPU) as exc:
        line = f"{smk.rule}: {exc}"
        _append(log_path, line)
        sys.exit(line)
