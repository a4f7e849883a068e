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


def init_from_env(arch: str) -> bool:
    """Join the process group torchrun describes (WORLD_SIZE > 1 in the environment, the default
    ``env://`` rendezvous): gloo for a CPU run, NCCL on CUDA (each process on device LOCAL_RANK).
    Returns whether this process is one of several ranks; a no-op if a group already exists."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if env_world_size() <= 1:
        return False
    if arch == "cpu":
        backend = "gloo"
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return dist.get_world_size() > 1
