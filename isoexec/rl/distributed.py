"""The synchronous RL run on N data-parallel ranks (``torchrun --nproc_per_node=N -m isoexec.cli run``).

Every rank holds the FSDP2 trainer (``isoexec.dist.fsdp.FSDPTrainer`` over dp = the world size; with
``trainer_ep: e`` (MoE families) ``isoexec.dist.fsdp.ExpertParallelTrainer``, the same data
parallelism with each MoE layer's routed experts dealt over the e consecutive ranks
``[g * e, (g + 1) * e)`` instead of sharded by FSDP2) and a colocated engine: with full weights
(``engine_tp: 1``, the default), or, with ``engine_tp: t``
(every family; the MoE families eager, without CUDA graphs), a tensor-parallel engine (``isoexec.model.tensor_parallel``) sharded over its engine group, the t consecutive
ranks ``[g * t, (g + 1) * t)``. What a rank does in one step:

- **generation.** Each generation round's prompts are dealt out in whole groups (a prompt and all
  its samples) to the N / t engine groups: group g takes the prompts ``[g * m / G, (g + 1) * m / G)``
  of the round's m (``deal``; counts may differ by one, a group may get none in a refill round), and
  every rank of the group serves them in step on its shards. A sample keeps the
  request id and the seed the single-process run gives it (its index in the round, and
  ``derive_seed(seed, step, round, prompt id, sample)``), so its tokens do not depend on N. The
  results are gathered in rank order and one copy per engine group is kept (its first rank's), which
  is the single-process order, so every rank then sees
  the whole round: rewards, DAPO's dynamic sampling and the group advantages are computed by
  every rank from all the groups, with no further communication.
- **scoring and training.** ``FSDPTrainer.score`` and ``FSDPTrainer.train`` take the whole list
  of sequences on every rank and deal it out themselves (``partition.sequence_share``).
- **the live check.** Each rank also counts the tokens its own engine sampled whose logprob
  differs (bitwise) from the trainer's score; the counts are gathered, written to the metrics as
  ``live_check_differing_per_rank``, and any non-zero count stops every rank before the backward.
- **weight sync.** ``gathered_parameters()`` gathers the fp32 masters whole on every rank, one
  parameter at a time as the engine reads it (under ``trainer_ep`` the expert slices too, over
  their ep group; isoexec/dist/lazy_parameters.py), so a rank holds one whole parameter at a time,
  not the model's fp32 copy; each rank's
  engine runs the contract handshake with the trainer contract of rank 0 (its encoded bytes,
  broadcast once and checked equal to every rank's own) and copies them in.

Only rank 0 writes metrics.jsonl and logs. Checkpoints (``RLRun._save_sharded``): every rank
writes its trainer shards with ``FSDPTrainer.save`` into ``trainer_step<k>/``, then rank 0 writes
checkpoint.pt (configuration, step, prompt stream, world size, that folder's name); a run resumes
from it at the same world size only. Every refusal here depends only on the configuration and the
output folder, which every rank reads alike, so a bad world size (or a checkpoint written at
another one) is refused on every rank before any collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..dist.launch import env_world_size, init_from_env  # noqa: F401 (re-exported: the run's entry)
from ..errors import ConfigError


def world() -> tuple[int, int]:
    """(world size, rank) of the default group; (1, 0) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def deal(n_units: int, world_size: int, rank: int) -> range:
    """The units ``[rank * n / N, (rank + 1) * n / N)`` rank ``rank`` of ``world_size`` takes from
    ``n_units`` (partition.py's rule: as even as possible, the larger parts last; may be empty)."""
    return range(rank * n_units // world_size, (rank + 1) * n_units // world_size)


def check_world(cfg, world_size: int) -> None:
    """Refuse a world size the run cannot deal out evenly: one ``ConfigError`` line, from the
    configuration alone (so every rank refuses, before any collective)."""
    n = cfg.samples_per_prompt
    mini = cfg.mini_batch_size * n
    problems = []
    if cfg.prompts_per_step % world_size:
        problems.append(f"prompts_per_step={cfg.prompts_per_step} (groups are dealt to ranks whole)")
    if mini % world_size:
        problems.append(f"mini_batch_size x samples_per_prompt = {cfg.mini_batch_size} x {n} = {mini} sequences "
                        "(every rank trains on the same number of each mini-batch's sequences)")
    if problems:
        raise ConfigError(f"rl config: a world of {world_size} ranks must divide " + " and ".join(problems)
                          + "; pick a world size that divides them")


def check_engine_tp(cfg, world_size: int) -> None:
    """Refuse an engine tp the world cannot hold: it must divide the world size (one ``ConfigError``
    line, from the configuration and the world size alone, on every rank)."""
    tp = cfg.engine_tp
    if tp > 1 and world_size == 1:
        raise ConfigError(f"rl config: engine_tp={tp} shards the engine over {tp} ranks, and this run is one "
                          f"process: start it under torchrun with a multiple of {tp} processes, or set engine_tp: 1")
    if world_size % tp:
        raise ConfigError(f"rl config: engine_tp={tp} does not divide the world of {world_size} ranks (engine "
                          "groups are whole runs of consecutive ranks); pick an engine_tp that divides it")


def check_trainer_ep(cfg, world_size: int) -> None:
    """Refuse a trainer ep the world cannot hold: it must divide the world size, and a one-process
    run has no experts to deal out (one ``ConfigError`` line, from the configuration and the world
    size alone, on every rank). The contract's ep claim is checked by the trainer itself, before its
    first collective (``ExpertParallelTrainer``)."""
    ep = cfg.trainer_ep
    if ep > 1 and world_size == 1:
        raise ConfigError(f"rl config: trainer_ep={ep} deals the trainer's experts over {ep} ranks, and this run is "
                          f"one process: start it under torchrun with a multiple of {ep} processes, or set "
                          "trainer_ep: 1")
    if world_size % ep:
        raise ConfigError(f"rl config: trainer_ep={ep} does not divide the world of {world_size} ranks (ep groups are "
                          "whole runs of consecutive ranks); pick a trainer_ep that divides it")


def engine_groups(world_size: int, tp: int) -> list:
    """The process groups of the engine: ranks ``[g * tp, (g + 1) * tp)`` for each g, created on every
    rank in the same order (``new_group`` must be called by all ranks alike)."""
    return [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world_size // tp)]


def check_warmup_batch(batch: int, world_size: int) -> None:
    if batch % world_size:
        raise ConfigError(f"rl config: the warm-up SFT takes {batch} sequences per step, which a world of "
                          f"{world_size} ranks does not divide; set warmup_batch_size to a multiple of "
                          f"{world_size}, or warm up once with `isoexec warmup` and start from its folder")


def all_gather(obj: Any) -> list:
    """Every rank's ``obj`` (python objects, CPU tensors) in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_bytes(data: bytes) -> bytes:
    """Rank 0's ``data`` on every rank."""
    box = [data if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def differing_tokens(rollout: list[torch.Tensor], trainer: list[torch.Tensor]) -> int:
    """Tokens whose fp32 logprob differs bitwise between the engine and the trainer (a length
    mismatch counts every token of the longer one)."""
    bad = 0
    for a, b in zip(rollout, trainer):
        a = a.detach().to("cpu", torch.float32).contiguous()
        b = b.detach().to("cpu", torch.float32).contiguous()
        if a.shape != b.shape:
            bad += max(a.numel(), b.numel())
        else:
            bad += int((a.view(torch.int32) != b.view(torch.int32)).sum())
    return bad


class NullMetrics:
    """The metrics writer of a rank other than 0: it writes nothing."""

    def write(self, metrics):
        return dict(metrics)

    def truncate_after(self, step: int) -> int:
        return 0

    def close(self) -> None:
        pass
