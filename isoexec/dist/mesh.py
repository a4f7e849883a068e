"""The device mesh of the data-parallel trainer: one axis, named ``dp``.

``dp_mesh()`` lays every rank of the default process group along one axis named ``dp``; the FSDP2
trainer (``isoexec/dist/fsdp/``) shards parameters, gradients and optimizer state along it and
deals each mini-batch's sequences out along it. The axis has a name so that a later mesh with a
tensor-parallel axis beside it (``("dp", "tp")``) keeps the same spelling; until the model is
sharded by TP a mesh with any other axis is refused.

The checks run before ``init_device_mesh`` (which creates groups, a collective) and depend only on
sizes every rank sees alike, so a wrong shape raises the same ``ValueError`` on every rank and no
rank is left waiting in a collective.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DP = "dp"


def check_mesh_shape(shape: Sequence[int], world_size: int) -> None:
    """Refuse a mesh shape whose ranks do not number ``world_size`` (or with a size below 1)."""
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"device mesh shape {shape}: every axis needs at least one rank")
    if math.prod(shape) != world_size:
        raise ValueError(f"device mesh shape {shape} holds {math.prod(shape)} rank(s) but the world has "
                         f"{world_size} process(es); the mesh must cover the world exactly")


def _world_size() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the data-parallel mesh needs an initialised default process group "
                           "(torch.distributed.init_process_group); one process without a group trains with "
                           "isoexec.train.Trainer")
    return dist.get_world_size()


def dp_mesh(dp: Optional[int] = None, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D mesh of ``dp`` ranks (default: the world size) with its axis named ``dp``, on
    ``device_type`` ("cpu" for gloo, "cuda" for NCCL)."""
    ws = _world_size()
    check_mesh_shape((ws if dp is None else dp,), ws)
    return init_device_mesh(device_type, (ws,), mesh_dim_names=(DP,))


def check_dp_mesh(mesh: DeviceMesh) -> tuple[int, int]:
    """(dp, this rank's index on the ``dp`` axis) of a mesh the trainer accepts: exactly one axis,
    named ``dp``, covering the world."""
    names = tuple(mesh.mesh_dim_names or ())
    if names != (DP,):
        raise ValueError(f"the data-parallel trainer needs a 1-D mesh with its axis named {DP!r}; got axes "
                         f"{names or 'without names'} of shape {tuple(mesh.mesh.shape)}")
    check_mesh_shape(tuple(mesh.mesh.shape), _world_size())
    return mesh.size(0), mesh.get_local_rank(DP)
