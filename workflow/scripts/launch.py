"""How rule rl_run starts ``isoexec run``: one process, or one torchrun rank per GPU.

On a GPU arch an RL run takes the config's ``gpus`` GPUs and, with more than one, runs as a
data-parallel run under torchrun, one rank per GPU (docs/scale_out.md, "The RL run on N ranks");
on cpu it is one process. Shared by the rules (resources, the dry run's job line) and the job
script (workflow/scripts/rl_run.py); no torch is imported here.
"""

from __future__ import annotations

from typing import Mapping


def rl_world(config: Mapping) -> int:
    """Ranks of one RL run: ``gpus`` on a GPU arch, 1 on cpu."""
    return 1 if config.get("arch") == "cpu" else int(config.get("gpus", 1))


def rl_launcher(world: int) -> list[str]:
    """The command that stands for ``isoexec`` in an RL run of ``world`` ranks (empty: ``isoexec``
    itself). ``--standalone``: a rendezvous on a free local port, so runs on one node do not meet."""
    if world <= 1:
        return []
    return ["torchrun", "--standalone", f"--nproc_per_node={world}", "-m", "isoexec.cli"]
