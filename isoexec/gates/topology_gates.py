"""Topology gates: the tensor-parallel model and engine against one process, on a process group.

A contract with a ``tp`` topology claim (``configs/compositions/isoexec_tp4.yaml``) promises the
bits of one process at every tp of its domain. These gates check that promise at the size of the
process group they run in (``torchrun --nproc_per_node=N``; without torchrun, a group of one rank
is made for the run, so the collectives and the tensor-parallel code path run even on one device,
NCCL on a GPU, gloo on the CPU):

- ``tp_trainer_logits``: ``trainer_score`` logits of a packed batch from the tensor-parallel model
  (each rank's vocabulary slice) against the same columns of the one-process model;
- ``tp_trainer_logprobs``: ``trainer_score`` token logprobs of that batch, the tensor-parallel
  model's through the vocabulary-parallel logprob (``isoexec.dist.vocab_parallel_token_logprobs``:
  the logprob kernel's reference schedule on the CPU, its Triton schedule on a GPU), against the
  one-process model's;
- ``tp_engine_generate_verify``: the engine on each rank's shards serves the generate-then-verify
  traffic of ``engine_gates`` (mixed sampling, staggered arrivals, chunked prefill); its tokens and
  logprobs against the one-process engine's, and the one-process trainer recomputes every token
  it served;
- negative control of the latter: the same engine under ``all_reduce_control(contract)``, the
  gate's contract with its row-parallel regions' ``K_LEAVES`` unpinned (tp claimed ``variant``),
  so the tensor-parallel model, which takes its row-parallel sum from the contract
  (``TensorParallelDense._row_parallel``), sums each rank's partial by the stock ``all_reduce``
  (``isoexec.dist.all_reduce_row_parallel_linear``) instead of the contract's K leaves, and its
  logprobs differ. Every other region runs what the gate's contract says.

Every rank computes its own comparisons; the runner gathers them (``gathered``) and rank 0 writes
the artifact. The tp size and the backend are recorded in the artifact's shapes.
"""

from __future__ import annotations

import copy
import datetime
import os
import tempfile
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist

from ..contract import K_LEAVES, ROW_PARALLEL_OPS, ExecutionContract, check, frozen_mapping, with_identities
from ..dist.launch import init_from_env
from ..model import ForwardBatch
from ..model.tensor_parallel import tensor_parallel
from .compare import BitReport, compare_bits
from .engine_gates import _generate, _results_reports, verify_engine_logprobs

TOPOLOGY_GATES = ("tp_trainer_logits", "tp_trainer_logprobs", "tp_engine_generate_verify")
# packed trainer batch (sequence lengths) and engine traffic per arch
TRAINER_LENS = {"cpu": (37, 5, 64, 1), "sm90": (512, 200, 33, 1)}
ENGINE_SIZES = {"cpu": dict(requests=16, max_prompt=40, max_tokens=10),
                "sm90": dict(requests=64, max_prompt=300, max_tokens=96)}


def claims_tp(contract) -> bool:
    """Whether the contract claims the bits of one process at a tp size above 1 (kind
    ``invariant``): the gates have something to prove. The single-process compositions pin every
    axis to [1]; ``native_tp4`` claims tp ``variant``, bits that depend on tp, which promises
    nothing for these gates to check."""
    return any(t.axis == "tp" and t.kind == "invariant" and any(size > 1 for size in t.domain)
               for t in contract.claims.topology)


def all_reduce_control(contract: ExecutionContract) -> ExecutionContract:
    """The negative control's contract: ``contract`` with no ``K_LEAVES`` pinned on its row-parallel
    regions (``ROW_PARALLEL_OPS``; their discharges dropped, they prove nothing now), its tp claim
    ``variant`` and no tolerance claimed, as such a contract must (validate.py). The
    tensor-parallel model then sums those regions by ``all_reduce`` of their own kernel (the
    invariant GEMM's K loop of each rank's shard) instead of the fixed leaf order, the one change;
    it takes that choice from the contract, as every run does."""
    entries = tuple(replace(e, constants=frozen_mapping({k: v for k, v in e.constants.items() if k != K_LEAVES}),
                            discharge=None) if set(e.region) & set(ROW_PARALLEL_OPS) else e
                    for e in contract.composition)
    topology = tuple(replace(t, kind="variant", proof="stock-all-reduce") if t.axis == "tp" else t
                     for t in contract.claims.topology)
    claims = replace(contract.claims, topology=topology, tolerances=())
    return check(with_identities(replace(contract, composition=entries, claims=claims)))


def under_contract(model, contract: ExecutionContract):
    """``model``'s weights under another contract: a shallow copy of the module (the parameters are
    shared, not copied) with ``contract`` installed; ``model`` keeps its own."""
    other = copy.copy(model)
    other.install(contract)
    return other


@contextmanager
def process_group(arch: str):
    """The process group the gates (and ``bench tp_dist``) run in: the one already made, torchrun's
    (any world size), or else a group of this process alone (a file store, no port); the last two
    are removed afterwards. Torchrun's is left at the end only when every rank has reached it: a
    rank that exits with its gloo group alive while another still works can die in the group's
    threads ("terminate called without an active exception")."""
    if dist.is_initialized():
        yield
        return
    if init_from_env(arch):   # torchrun's group
        try:
            yield
        except BaseException:
            dist.destroy_process_group()
            raise
        dist.barrier()
        dist.destroy_process_group()
        return
    backend = "gloo" if arch == "cpu" else "nccl"
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(backend, store=dist.FileStore(os.path.join(d, "store"), 1), rank=0,
                                world_size=1, timeout=datetime.timedelta(minutes=10))
        try:
            yield
        finally:
            dist.destroy_process_group()


def _trainer_batch(model, gen: torch.Generator, arch: str):
    """(lens, token ids, targets, packed trainer_score batch) of the trainer gates, on the model's device."""
    lens = list(TRAINER_LENS[arch])
    dev = model.embed.device
    ids = torch.randint(0, model.cfg.vocab_size, (sum(lens),), generator=gen).to(dev)
    targets = torch.randint(0, model.cfg.vocab_size, (sum(lens),), generator=gen).to(dev)
    return lens, ids, targets, ForwardBatch.packed(lens, "trainer_score", dev)


def tp_trainer_logits(model, contract, gen: torch.Generator, arch: str) -> tuple[list[BitReport], dict]:
    tpm = tensor_parallel(model)
    lens, ids, _, batch = _trainer_batch(model, gen, arch)
    with torch.no_grad():
        one = model.logits(model.hidden_states(ids, batch), "trainer_score")
        part = tpm.logits(tpm.hidden_states(ids, batch), "trainer_score")
    v0, v1 = tpm.vocab_range
    return [compare_bits(part, one[:, v0:v1])], {"lens": lens, "vocab_slice": [v0, v1]}


def tp_trainer_logprobs(model, contract, gen: torch.Generator, arch: str) -> tuple[list[BitReport], dict]:
    tpm = tensor_parallel(model)
    lens, ids, targets, batch = _trainer_batch(model, gen, arch)
    with torch.no_grad():
        one = model.token_logprobs(model.hidden_states(ids, batch), targets, "trainer_score")
        part = tpm.token_logprobs(tpm.hidden_states(ids, batch), targets, "trainer_score")
    return [compare_bits(part, one)], {"lens": lens, "vocab_slice": list(tpm.vocab_range)}


def tp_engine_generate_verify(model, contract, gen: torch.Generator, arch: str, stock_all_reduce: bool = False
                              ) -> tuple[list[BitReport], dict]:
    """The TP engine against the one-process engine on the same traffic, then generate-then-verify.
    ``stock_all_reduce``: the negative control, the TP engine under ``all_reduce_control(contract)``
    (row-parallel partials summed by ``all_reduce``), against the same one-process engine."""
    sizes = ENGINE_SIZES[arch]
    state = gen.get_state()
    _, want = _generate(model, contract, gen, **sizes)
    gen.set_state(state)   # the same prompts, parameters and arrivals for the TP engine
    served = all_reduce_control(contract) if stock_all_reduce else contract
    tpm = tensor_parallel(under_contract(model, served) if stock_all_reduce else model)
    _, got = _generate(tpm, served, gen, **sizes)
    reports = _results_reports(want, got) + [verify_engine_logprobs(model, got)]
    return reports, {**sizes, "tokens": sum(len(r.ids) for r in got)}


def gathered(reports: list[BitReport]) -> list[BitReport]:
    """Every rank's reports, in rank order (a copy of each rank's counts on every rank)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, reports)
    return [r for rank_reports in every for r in rank_reports]


def group_info(arch: str) -> dict:
    return {"tp": dist.get_world_size(), "backend": dist.get_backend(), "arch": arch}


__all__ = ["TOPOLOGY_GATES", "all_reduce_control", "under_contract", "claims_tp", "gathered", "group_info", "process_group",
           "tp_engine_generate_verify", "tp_trainer_logits", "tp_trainer_logprobs"]
