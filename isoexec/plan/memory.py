"""The memory plan of a workflow config: every family's row against one GPU's memory."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .rows import GIB, PlanRow, default_gpu_memory, plan_row
from .workflow_config import WorkflowPlan, read_workflow_config


@dataclass(frozen=True)
class MemoryPlan:
    workflow: WorkflowPlan
    rows: list[PlanRow]
    gpu_gib: float
    gpu_note: str                 # where the GPU memory figure comes from

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.rows)


def memory_plan(config_path: str, gpu_memory_gib: float | None = None) -> MemoryPlan:
    """Plan the runs of the workflow config at ``config_path`` on GPUs of ``gpu_memory_gib`` GiB
    (default: the config's own ``gpu_memory_gib``, else the figure for its arch,
    ``rows.DEFAULT_GPU_MEMORY_GIB``)."""
    if gpu_memory_gib is not None and not gpu_memory_gib > 0:
        raise ConfigError(f"--gpu-memory-gib {gpu_memory_gib}: must be a positive number of GiB")
    wf = read_workflow_config(config_path)     # its schema refuses a gpu_memory_gib that is not > 0
    if gpu_memory_gib is not None:
        gib, note = gpu_memory_gib, "--gpu-memory-gib"
    elif wf.gpu_memory_gib is not None:
        gib, note = wf.gpu_memory_gib, "gpu_memory_gib of the config; --gpu-memory-gib overrides it"
    else:
        gib, why = default_gpu_memory(wf.arch)
        note = f"default for arch {wf.arch}: {why}; set with --gpu-memory-gib"
    return MemoryPlan(wf, [plan_row(s, int(gib * GIB)) for s in wf.shapes], gib, note)
