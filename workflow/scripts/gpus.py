"""A GPU (or several) per job, for jobs that Snakemake runs on this machine.

Snakemake counts a ``gpu`` resource (``--resources gpu=N`` caps how many GPUs the running jobs
ask for together) but does not say *which* GPU a job gets, so without help every job would run on
device 0. :func:`gpu_env` picks the devices: a job that asks for ``n`` GPUs takes an exclusive
lock on ``n`` of the devices it can see, runs its command with ``CUDA_VISIBLE_DEVICES`` naming
them, and releases the locks when the command ends. The locks are ``flock`` locks on one file per
device in a folder of the system temp dir, so they are freed by the kernel when the holding
process dies (a killed job never leaves a device taken), and two Snakemake runs on one machine
share the devices too. A job that finds fewer than ``n`` free devices waits for them.

The devices a job can see are those of ``CUDA_VISIBLE_DEVICES`` when it is set, else every GPU
``nvidia-smi -L`` lists. On SLURM every job is its own allocation: SLURM sets
``CUDA_VISIBLE_DEVICES`` to the job's GPUs and the lock folder is per allocation
(``SLURM_JOB_ID``), so the job takes exactly what it was given; Snakemake run by hand inside one
``salloc`` allocation shares that allocation's GPUs among its jobs the same way as on a
workstation. ``ISOEXEC_GPU_LOCK_DIR`` overrides the lock folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, MutableMapping


class NoGPU(RuntimeError):
    """A job asks for more GPUs than it can see."""


def visible_devices(env: Mapping[str, str]) -> list[str]:
    """The device ids a job may use: ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) when set, else the
    indices of the GPUs ``nvidia-smi -L`` lists (none when there is no ``nvidia-smi``)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [d.strip() for d in cvd.split(",") if d.strip() and d.strip() != "-1"]
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def lock_dir(env: Mapping[str, str]) -> Path:
    if env.get("ISOEXEC_GPU_LOCK_DIR"):
        return Path(env["ISOEXEC_GPU_LOCK_DIR"])
    name = f"isoexec-gpu-locks-{os.getuid()}"
    if env.get("SLURM_JOB_ID"):
        name += f"-slurm{env['SLURM_JOB_ID']}"
    return Path(tempfile.gettempdir()) / name


def _try_lock(path: Path):
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


@contextlib.contextmanager
def gpu_env(n: int, env: Mapping[str, str] | None = None, *, log: Callable[[str], None] = lambda s: None,
            timeout_s: float | None = None, poll_s: float = 1.0) -> Iterator[MutableMapping[str, str]]:
    """The environment for a job that asks for ``n`` GPUs: a copy of ``env`` (default: this
    process's) whose ``CUDA_VISIBLE_DEVICES`` names ``n`` devices held by this job until the block
    ends. ``n`` = 0 changes nothing. Raises :class:`NoGPU` when fewer than ``n`` devices are
    visible at all, or when ``timeout_s`` passes without ``n`` free ones (default: wait)."""
    out = dict(os.environ if env is None else env)
    if n <= 0:
        yield out
        return
    devices = visible_devices(out)
    if len(devices) < n:
        where = (f"CUDA_VISIBLE_DEVICES={out['CUDA_VISIBLE_DEVICES']!r}" if "CUDA_VISIBLE_DEVICES" in out
                 else "nvidia-smi -L")
        raise NoGPU(f"the job asks for {n} GPU(s) but {len(devices)} are visible ({where})")
    folder = lock_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    t0, said = time.monotonic(), False
    while True:
        held = []
        for d in devices:
            f = _try_lock(folder / (re.sub(r"[^A-Za-z0-9_.-]", "_", d) + ".lock"))
            if f is not None:
                held.append((d, f))
                if len(held) == n:
                    break
        if len(held) == n:
            break
        for _, f in held:   # never hold some while waiting for the rest (two jobs could wait on each other)
            f.close()
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise NoGPU(f"no {n} free GPU(s) among {','.join(devices)} after {timeout_s:.0f} s (locks in {folder})")
        if not said:
            log(f"waiting for {n} free GPU(s) among {','.join(devices)} (the others are held by running jobs)")
            said = True
        time.sleep(poll_s)
    out["CUDA_VISIBLE_DEVICES"] = ",".join(d for d, _ in held)
    log(f"CUDA_VISIBLE_DEVICES={out['CUDA_VISIBLE_DEVICES']}")
    try:
        yield out
    finally:
        for _, f in held:
            f.close()
