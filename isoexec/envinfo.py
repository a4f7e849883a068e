"""Facts about the machine a result was measured on (recorded in every artifact and benchmark)."""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch


@functools.lru_cache(maxsize=None)
def git_commit() -> str:
    """``$ISOEXEC_COMMIT`` when set (a copied or extracted tree on a GPU machine, whose enclosing
    git metadata, if any, is not the code that runs), else HEAD of the checkout ("-dirty" if
    tracked files changed)."""
    if os.environ.get("ISOEXEC_COMMIT"):
        return os.environ["ISOEXEC_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _version(mod: str) -> str:
    """The version of package ``mod``: the imported module's own when the process has imported it,
    else the installed distribution's. Reading the metadata instead of importing keeps a gate run or
    a benchmark from importing transformers (about a second of CPU) only to write its version."""
    m = sys.modules.get(mod)
    if m is not None:
        return str(getattr(m, "__version__", "unknown"))
    try:
        return metadata.version(mod)
    except metadata.PackageNotFoundError:
        return "absent"


def device_name(arch: str | None = None) -> str:
    if torch.cuda.is_available() and arch != "cpu":
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def runtime_arch() -> str:
    """'sm90' on a Hopper GPU, 'smXY' on another CUDA GPU, 'cpu' without CUDA."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return f"sm{major}{minor}"
    return "cpu"


def env_info(arch: str | None = None) -> dict:
    return {
        "device": device_name(arch),
        "arch": arch or runtime_arch(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
