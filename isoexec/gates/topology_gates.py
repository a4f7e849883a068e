"""Topology gates: the tensor-parallel model and engine against one process, on a process group.

A contract with a ``tp`` topology claim (``configs/compositions/isoexec_tp4.yaml``) promises the
bits of one process at every tp of its domain. These gates check that promise at the size of the
process group they run in (``torchrun --nproc_per_node=N``; without torchrun, a group of one rank
is made for the run, so the collectives and the tensor-parallel code path run even on one device,
NCCL on a GPU, gloo on the CPU):

- ``tp_trainer_logits``: ``trainer_score`` logits of a packed batch from the tensor-parallel model
  (each rank's vocabulary slice) against the same columns of the one-process model;
- ``tp_engine_generate_verify``: the engine on each rank's shards serves the generate-then-verify
  traffic of ``engine_gates`` (mixed sampling, staggered arrivals, chunked prefill); its tokens and
  logprobs against the one-process engine's, and the one-process trainer recomputes every token
  it served;
- negative control of the latter: the same engine with each rank's row-parallel partial summed by
  the stock ``all_reduce`` (``isoexec.dist.all_reduce_row_parallel_linear``), which does not run
  the contract's K leaves, so its logprobs differ.

Every rank computes its own comparisons; the runner gathers them (``gathered``) and rank 0 writes
the artifact. The tp size and the backend are recorded in the artifact's shapes.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..dist import all_reduce_row_parallel_linear
from ..dist.launch import init_from_env
from ..model import ForwardBatch, tp_dense, tp_hybrid, tp_moe
from ..model.tensor_parallel import tensor_parallel
from .compare import BitReport, compare_bits
from .engine_gates import _generate, _results_reports, verify_engine_logprobs

TOPOLOGY_GATES = ("tp_trainer_logits", "tp_engine_generate_verify")
# packed trainer batch (sequence lengths) and engine traffic per arch
TRAINER_LENS = {"cpu": (37, 5, 64, 1), "sm90": (512, 200, 33, 1)}
ENGINE_SIZES = {"cpu": dict(requests=16, max_prompt=40, max_tokens=10),
                "sm90": dict(requests=64, max_prompt=300, max_tokens=96)}


def claims_tp(contract) -> bool:
    """Whether the contract claims a tp size above 1 (the gates have something to prove; the
    single-process compositions pin every axis to [1])."""
    return any(t.axis == "tp" and any(size > 1 for size in t.domain) for t in contract.claims.topology)


@contextmanager
def process_group(arch: str):
    """The process group the gates run in: the one already made, torchrun's (any world size), or
    else a group of this process alone (a file store, no port), removed afterwards."""
    if dist.is_initialized():
        yield
        return
    if init_from_env(arch):   # torchrun's group (the process ends with the run)
        yield
        return
    backend = "gloo" if arch == "cpu" else "nccl"
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(backend, store=dist.FileStore(os.path.join(d, "store"), 1), rank=0,
                                world_size=1, timeout=datetime.timedelta(minutes=10))
        try:
            yield
        finally:
            dist.destroy_process_group()


# the modules whose row-parallel linear the negative control replaces (the hybrid model's attention
# and Gated DeltaNet layers call tp_hybrid's, MLA's o_proj tp_moe's, every dense MLP tp_dense's)
_ROW_PARALLEL_USERS = (tp_dense, tp_hybrid, tp_moe)


def tp_trainer_logits(model, contract, gen: torch.Generator, arch: str) -> tuple[list[BitReport], dict]:
    tpm = tensor_parallel(model)
    lens = list(TRAINER_LENS[arch])
    dev = model.embed.device
    ids = torch.randint(0, model.cfg.vocab_size, (sum(lens),), generator=gen).to(dev)
    batch = ForwardBatch.packed(lens, "trainer_score", dev)
    with torch.no_grad():
        one = model.logits(model.hidden_states(ids, batch), "trainer_score")
        part = tpm.logits(tpm.hidden_states(ids, batch), "trainer_score")
    v0, v1 = tpm.vocab_range
    return [compare_bits(part, one[:, v0:v1])], {"lens": lens, "vocab_slice": [v0, v1]}


def tp_engine_generate_verify(model, contract, gen: torch.Generator, arch: str, stock_all_reduce: bool = False
                              ) -> tuple[list[BitReport], dict]:
    """The TP engine against the one-process engine on the same traffic, then generate-then-verify.
    ``stock_all_reduce``: the negative control (row-parallel partials summed by ``all_reduce``)."""
    sizes = ENGINE_SIZES[arch]
    state = gen.get_state()
    _, want = _generate(model, contract, gen, **sizes)
    gen.set_state(state)   # the same prompts, parameters and arrivals for the TP engine
    tpm = tensor_parallel(model)
    real = [m.row_parallel_linear for m in _ROW_PARALLEL_USERS]
    if stock_all_reduce:
        for m in _ROW_PARALLEL_USERS:
            m.row_parallel_linear = all_reduce_row_parallel_linear
    try:
        # the control runs eagerly: the patched module function is what a captured graph would
        # have frozen otherwise
        _, got = _generate(tpm, contract, gen, **sizes, **({"cuda_graphs": False} if stock_all_reduce else {}))
    finally:
        for m, fn in zip(_ROW_PARALLEL_USERS, real):
            m.row_parallel_linear = fn
    reports = _results_reports(want, got) + [verify_engine_logprobs(model, got)]
    return reports, {**sizes, "tokens": sum(len(r.ids) for r in got)}


def gathered(reports: list[BitReport]) -> list[BitReport]:
    """Every rank's reports, in rank order (a copy of each rank's counts on every rank)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, reports)
    return [r for rank_reports in every for r in rank_reports]


def group_info(arch: str) -> dict:
    return {"tp": dist.get_world_size(), "backend": dist.get_backend(), "arch": arch}


__all__ = ["TOPOLOGY_GATES", "claims_tp", "gathered", "group_info", "process_group",
           "tp_engine_generate_verify", "tp_trainer_logits"]
