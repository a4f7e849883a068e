"""The device meshes of the data-parallel trainers: the ``dp`` axis, and the ``(ep_replica, ep)`` mesh.

``dp_mesh()`` lays every rank of the default process group along one axis named ``dp``; the FSDP2
trainer (``isoexec/dist/fsdp/``) shards parameters, gradients and optimizer state along it and
deals each mini-batch's sequences out along it. The axis has a name so that a later mesh with a
tensor-parallel axis beside it (``("dp", "tp")``) keeps the same spelling; until the model is
sharded by TP a mesh with any other axis is refused.

``ep_mesh(ep)`` is the second mesh of the expert-parallel trainer
(``isoexec.dist.fsdp.ExpertParallelTrainer``), over the same ranks: shape ``(N / ep, ep)``, ranks
laid out row-major, so rank ``r`` sits at ``(r // ep, r % ep)``. Along ``ep`` (a row: the ``ep``
consecutive ranks ``[g * ep, (g + 1) * ep)``) the ranks hold one copy of the routed experts
between them, each its own slice, and exchange token rows in every MoE layer; along
``ep_replica`` (a column: the ranks ``j, j + ep, j + 2 ep, ...``) they hold the same slice and
add its gradients. The replicated (non-expert) parameters are still sharded over the whole world
by the ``dp`` mesh, and every rank still takes its own sequences: data parallelism is over all N
ranks, and ep only decides who holds which experts.

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
EP = "ep"
EP_REPLICA = "ep_replica"


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


def check_ep_size(ep, world_size: int) -> None:
    """Refuse an expert-parallel size that is not a positive integer dividing ``world_size`` (one
    ``ValueError`` line, from the sizes alone)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert-parallel size ep={ep!r}: need a positive integer")
    if world_size % ep:
        raise ValueError(f"expert-parallel size ep={ep} does not divide the world of {world_size} process(es); "
                         "the ep groups are whole runs of consecutive ranks")


def ep_mesh(ep: int, device_type: str = "cpu") -> DeviceMesh:
    """The ``(ep_replica, ep)`` mesh of ``ep`` ranks per expert group over every rank of the default
    group (module docstring), on ``device_type``."""
    ws = _world_size()
    check_ep_size(ep, ws)
    return init_device_mesh(device_type, (ws // ep, ep), mesh_dim_names=(EP_REPLICA, EP))
