"""Joining the process group a launcher describes (torchrun's environment, ``env://``)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..errors import ConfigError


def env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when unset)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process (it names the run in every worker's environment)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def init_from_env(arch: str) -> bool:
    """Join the process group torchrun describes (the default ``env://`` rendezvous): gloo for a
    CPU run, NCCL on CUDA (each process on device LOCAL_RANK). Under torchrun a world of one rank
    joins too, so ``torchrun --nproc_per_node=1`` runs the distributed code path on one device.
    Returns whether this call joined a group (the caller then leaves it); False if a group already
    exists or this process is not one of torchrun's (WORLD_SIZE unset or 1)."""
    if dist.is_available() and dist.is_initialized():
        return False
    if env_world_size() <= 1 and not launched_by_torchrun():
        return False
    if arch == "cpu":
        backend = "gloo"
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return True
