"""How rule rl_run starts ``isoexec run``: one process, one torchrun rank per GPU on one node, or
one torchrun per node of a SLURM allocation.

On a GPU arch an RL run spans the config's ``nodes`` nodes with ``gpus`` GPUs on each (``gpus`` is
per node, the torchrun convention: ``--nproc_per_node``), one data-parallel rank per GPU, so
``nodes`` x ``gpus`` ranks in all (docs/scale_out.md, "The RL run on N ranks"); on cpu it is one
process whatever ``gpus`` and ``nodes`` say. Shared by the Snakefile (the ``nodes`` check), the
rules (resources, the dry run's job line) and the job script (workflow/scripts/rl_run.py); no torch
is imported here.
"""

from __future__ import annotations

import shlex
from typing import Mapping

# Executors under which an rl_run job of more than one node can run: the SLURM executor plugin
# submits it, and its job-step executor runs it inside the allocation.
MULTI_NODE_EXECUTORS = ("slurm", "slurm-jobstep")

# The node that hosts the rendezvous: the first of the job's allocation, looked up on the cluster
# when the job runs (the allocation does not exist when Snakemake plans the jobs).
HEAD_NODE = '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)'
# The rendezvous port, from the SLURM job id: two jobs whose first node is the same host (say,
# two 4-GPU jobs on 8-GPU nodes) must not meet on one port. 20000-29999 stays below Linux's
# ephemeral range (32768-60999), where an outgoing connection may hold the port.
RDZV_PORT = "$((20000 + SLURM_JOB_ID % 10000))"


def nodes_error(config: Mapping) -> str | None:
    """Why the config's ``nodes`` is not usable (None: it is), one line naming the key. Checked by
    the Snakefile before the schema, whose message would dump the key's whole schema entry."""
    nodes = config.get("nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        return (f"config: `nodes` must be an integer >= 1 (the nodes one RL run spans, `gpus` GPUs on each), "
                f"got {nodes!r}")
    return None


def rl_nodes(config: Mapping) -> int:
    """Nodes of one RL run: ``nodes`` on a GPU arch, 1 on cpu."""
    return 1 if config.get("arch") == "cpu" else int(config.get("nodes", 1))


def rl_world(config: Mapping) -> int:
    """Ranks of one RL run: ``nodes`` x ``gpus`` on a GPU arch, 1 on cpu."""
    return 1 if config.get("arch") == "cpu" else rl_nodes(config) * int(config.get("gpus", 1))


def multi_node_line(world: int, nodes: int) -> str:
    """The shell command that stands for ``isoexec`` in a run of ``world`` ranks over ``nodes`` > 1
    nodes, inside a SLURM job of that many nodes: srun starts one torchrun per node (``--whole``:
    each takes all the GPUs and CPUs the job holds on its node; ``--kill-on-bad-exit``: a node
    whose torchrun fails stops the others instead of leaving them waiting in a collective), and the
    torchruns meet at the c10d rendezvous on the allocation's first node, named by the job id."""
    return (f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --whole --kill-on-bad-exit=1 "
            f"torchrun --nnodes={nodes} --nproc_per_node={world // nodes} --rdzv_backend=c10d "
            f"--rdzv_endpoint={HEAD_NODE}:{RDZV_PORT} --rdzv_id=$SLURM_JOB_ID -m isoexec.cli")


def rl_launcher(world: int, nodes: int = 1) -> list[str]:
    """The command that stands for ``isoexec`` in an RL run of ``world`` ranks on ``nodes`` nodes
    (empty: ``isoexec`` itself). One node: ``--standalone``, a rendezvous on a free local port, so
    runs on one node do not meet. More: :func:`multi_node_line` run by bash, which evaluates the
    first node and the job id where the job runs; the arguments follow as ``"$@"``."""
    if nodes > 1:
        if world % nodes:
            raise ValueError(f"{world} ranks do not split evenly over {nodes} nodes")
        script = (
            "set -euo pipefail; "
            ': "${SLURM_JOB_ID:?an RL run on more than one node (nodes > 1) runs inside a SLURM job of that '
            'many nodes: run the workflow with --profile workflow/profiles/slurm, or set nodes: 1}"; '
            # the SLURM executor's job step starts the job with the allocation's SLURM_* variables
            # removed but for the job id, so the node list is asked of the scheduler when it is gone
            'export SLURM_JOB_NODELIST="${SLURM_JOB_NODELIST:-$(squeue -h -j "$SLURM_JOB_ID" -o %N)}"; '
            f'exec {multi_node_line(world, nodes)} "$@"')
        return ["bash", "-c", script, "isoexec"]
    if world <= 1:
        return []
    return ["torchrun", "--standalone", f"--nproc_per_node={world}", "-m", "isoexec.cli"]


def shown_launcher(world: int, nodes: int = 1) -> str:
    """The launcher as the dry run shows it: the srun line for more than one node (without bash's
    checks around it), else the torchrun command."""
    return multi_node_line(world, nodes) if nodes > 1 else shlex.join(rl_launcher(world))
