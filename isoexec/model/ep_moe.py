"""The MoE models' trainer forward (and backward) under expert parallelism, with the bits of one process.

``ExpertParallelMoe(model, group)`` takes a single-process ``MlaMoeModel`` or ``HybridMoeModel``
with its contract installed and returns this rank's model of the expert-parallel ``group``: a
model of the same family (so the trainer code that drives a model drives it, under the same
parameter names) that holds

  * of every MoE layer's stacked expert weights (``experts_gate_up`` [E, 2I, H], ``experts_down``
    [E, H, I]) only this rank's experts, ``expert_shard_range(E, ep, rank)``: whole experts in one
    contiguous range, rank j from ``j * E // ep`` (6 experts over 4 ranks are 1, 2, 1, 2);
  * everything else replicated: the embedding, attention or Gated DeltaNet, the dense MLP layers,
    the router (and GLM's correction bias), the shared expert and its gate, the norms, the lm_head.

Its MoE layers run through ``isoexec.dist.expert_parallel_moe`` (the model's ``moe_ep``): each
rank routes its own tokens with the single-process router and dispatch, sends each (token, expert)
row to the expert's owner by ``all_to_all`` (a copy), the owner runs the single-process ``experts``
region on the rows it received, the rows come back by the reverse ``all_to_all`` in the order the
rank dispatched them, and the single-process ``combine`` adds each token's k rows in fp32 in
ascending expert index, the shared expert last. A row's output from the experts region depends on
that row and the expert's weights only (the invariant GEMM's fixed K order per row; the rows that
share a call do not matter), and nothing is added across ranks, so every token's hidden state,
logits and logprob are the one-process model's bits, at every ep
(tests/dist/test_ep_model.py: EP = 1, 2, 4, fp32 and bf16, both families).

Which tokens a rank holds is the caller's choice, and the model's bits do not depend on it: a
sequence's logprobs are a function of that sequence alone (attention and the GDN recurrence run
per sequence, every other op per row). A data-parallel caller gives each rank its own whole
sequences, packed in its own ``ForwardBatch`` (``partition.sequence_share``, or any split; a rank
may hold none, T = 0); the whole batch on every rank works too (each expert then computes every
row ep times). What every rank of the group must do is call the forward together: each MoE layer
is a collective (an ``all_gather`` of per-expert row counts and two ``all_to_all``), so every rank
runs the same case the same number of times, in step, tokens or not.

The backward runs under EP too (``trainer_fwd``; ``expert_parallel_moe``'s one autograd node per
MoE layer runs the exchange in reverse: the output rows' gradients to the owners, the experts
region's backward there, the input rows' gradients back). What a rank's gradients then hold: for a
replicated parameter, the gradient of its own tokens' loss, which a data-parallel trainer adds over
the ranks as over dp; for its expert slices, the gradient of every rank's rows they received,
complete already: they are not to be added across the group. The trainer over such a model is
``isoexec.dist.fsdp.ExpertParallelTrainer``: it shards and reduces the replicated parameters over
every rank with FSDP2, keeps the expert slices out of FSDP2 and adds each slice's gradients only
over the ranks that hold the same slice (other ep groups). Only forward bits must match
(docs/variance_sources.md): the gradients are fixed run to run and equal one process's within
rounding (the test measures both).

Refused before anything is cut or sent, on every rank (the ranks see the same sizes), in one
``TopologyRefused`` naming them: an ep the contract does not claim (``check_topology``: the
``isoexec`` and ``native`` compositions pin ep to 1; ``isoexec_ep4`` claims 1, 2 and 4), an ep the
routed experts cannot be dealt to (ep > E: a rank would own none), and MoE regions other than the
invariant ones whose row independence the exchange relies on (``ep_problems``). A model that is not
of a MoE family, or has no contract installed, is a ``BindingRefused``. Trainer cases only
(``trainer_fwd``, ``trainer_score``): an engine's ranks step on their own requests, which the
layer's collectives cannot follow (the engine under EP is not built).
"""

from __future__ import annotations

import torch
from torch import nn

from ..contract import ExecutionContract
from ..dist.collectives import group_size_rank
from ..dist.expert_parallel import ExpertParallelGroup
from ..dist.lazy_parameters import ShardedView
from ..dist.partition import expert_shard_range
from ..enforce import ExecutionPlan, RuntimeFacts, check_topology
from ..envinfo import runtime_arch
from ..errors import BindingRefused
from .hybrid_moe import HybridMoeModel
from .mla_moe import EP_REGION_IMPLS, MlaMoeModel

TRAINER_CASES = ("trainer_fwd", "trainer_score")
EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")
_FAMILIES = {"mla_moe": MlaMoeModel, "hybrid_moe": HybridMoeModel}
#: the families with routed experts, which expert parallelism serves
EP_FAMILIES = tuple(_FAMILIES)


def num_routed_experts(cfg) -> int:
    """E, the routed experts of every MoE layer of a MoE family's config."""
    return cfg.n_routed_experts if hasattr(cfg, "n_routed_experts") else cfg.num_experts


def ep_problems(model, contract: ExecutionContract, ep: int) -> list[str]:
    """Why ``model`` cannot run ``contract`` with its experts over ``ep`` ranks (empty: it can):
    a family without routed experts (at ep > 1), more ranks than routed experts, and MoE regions
    other than ``EP_REGION_IMPLS``. ``check_topology`` reports them with its own (the ep claim)."""
    if model.family not in _FAMILIES:
        return [] if ep == 1 else [f"the {model.family} family has no routed experts to deal out (ep={ep})"]
    E = num_routed_experts(model.cfg)
    out = []
    if ep > E:
        out.append(f"ep={ep} is more than the {E} routed expert(s) of each MoE layer; every rank must own at "
                   "least one whole expert")
    if ep > 1:
        for e in contract.composition:
            for o in e.region:
                want = EP_REGION_IMPLS.get(o)
                if e.half == "function" and want is not None and e.impl.id != want:
                    out.append(f"region of {o} runs {e.impl.id} ({e.impl.arch}); at ep > 1 it must be {want}, "
                               "whose rows the expert-parallel exchange reproduces")
    return out


def is_expert_weight(name: str) -> bool:
    """Whether the MoE-model parameter ``name`` is a stacked routed-expert weight (cut by expert)."""
    return name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


def check_ep(model, ep: int, arch: str | None = None) -> None:
    """Refuse ``model`` (its installed contract) at ``ep`` in one ``TopologyRefused``: the contract's
    ep claim and ``ep_problems``. Depends on sizes only, so a caller runs it before any collective
    (``ExpertParallelMoe``, and the expert-parallel trainer before it builds its meshes)."""
    if model.contract is None:
        raise BindingRefused("expert-parallel model: install a contract on the model first")
    arch = arch or ("cpu" if model.embed.device.type == "cpu" else runtime_arch())
    check_topology(model.contract, RuntimeFacts(arch=arch, ep=ep),
                   model.tp_problems(model.contract, 1) + ep_problems(model, model.contract, ep))


def cut_parameter(cfg, ep: int, rank: int, name: str, full: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s part of the full MoE-model parameter ``name``: its experts' rows of the
    stacked expert weights, every other parameter whole (works on the ``meta`` device)."""
    if is_expert_weight(name):
        e0, e1 = expert_shard_range(num_routed_experts(cfg), ep, rank)
        return full[e0:e1]
    return full


class ExpertParallelMoe(nn.Module):
    """This rank's expert-parallel model of ``model`` (an ``MlaMoeModel`` or ``HybridMoeModel``
    with a contract installed) on ``group`` (None: the default group, or one process if none is
    initialised). ``ExpertParallelMoe(model, group)`` is an instance of the model's family class
    too (``ExpertParallelMlaMoe``, ``ExpertParallelHybridMoe``), with its public interface and
    parameter names. Module docstring."""

    def __new__(cls, model=None, group=None):
        if cls is ExpertParallelMoe:   # pick the family's class; copy and pickle pass the class itself
            family = getattr(model, "family", type(model).__name__)
            if family not in _EP_CLASSES:
                raise BindingRefused(f"expert-parallel model: the {family} family has no routed experts "
                                     f"(expert parallelism serves {', '.join(_EP_CLASSES)})")
            cls = _EP_CLASSES[family]
        return super().__new__(cls)

    def __init__(self, model, group=None):
        family_cls = _FAMILIES[self.family]
        ep, rank = group_size_rank(group)
        # every rank refuses here, before any weight is cut or any collective is entered
        check_ep(model, ep)
        contract, cfg = model.contract, model.cfg
        # the family's own structure on the meta device (no memory), then this rank's tensors
        family_cls.__init__(self, cfg, dtype=model.embed.dtype, device="meta")
        for name, full in model.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            owner = self.get_submodule(prefix) if prefix else self
            part = cut_parameter(cfg, ep, rank, name, full.detach())
            setattr(owner, leaf, nn.Parameter(part.clone(), requires_grad=full.requires_grad))
        left = [n for n, p in self.named_parameters() if p.is_meta]
        if left or list(model.named_buffers()):
            raise BindingRefused(f"expert-parallel model: the {self.family} model holds tensors this cut does not "
                                 f"know ({', '.join(left) or 'buffers'})")
        self.router_spec = model.router_spec
        self.contract = contract
        self.plans: dict[str, ExecutionPlan] = {c: model.plans[c] for c in TRAINER_CASES if c in model.plans}
        self.group, self.ep, self.rank = group, ep, rank
        self.expert_range = expert_shard_range(num_routed_experts(cfg), ep, rank)
        self.moe_ep = ExpertParallelGroup(group)

    # ------------------------------------------------------------------------------ contract
    def install(self, contract: ExecutionContract, facts: RuntimeFacts | None = None):
        """Bind ``contract`` (trainer cases), refusing first what ``ExpertParallelMoe`` refuses at
        this model's ep."""
        arch = facts.arch if facts is not None else (
            "cpu" if self.embed.device.type == "cpu" else runtime_arch())
        facts = RuntimeFacts(arch=arch, ep=self.ep)
        check_topology(contract, facts, self.tp_problems(contract, 1) + ep_problems(self, contract, self.ep))
        records = _FAMILIES[self.family].install(self, contract, facts)
        self.plans = {c: p for c, p in self.plans.items() if c in TRAINER_CASES}
        return records

    def _plan(self, case: str) -> ExecutionPlan:
        if case not in self.plans:
            raise BindingRefused(f"expert-parallel model: case {case!r} is not served (trainer cases only: the "
                                 "engine under expert parallelism is not built; the contract declares "
                                 f"{', '.join(sorted(self.plans)) or 'no trainer case'})")
        return self.plans[case]

    def shard_weights(self, full) -> ShardedView:
        """This rank's part of a full state dict (the one-process model's names, e.g. a trainer's
        ``full_parameters()``): its experts' rows of the expert weights, the rest whole, each cut
        when read (``ShardedView``); names this model does not hold pass through unchanged."""
        return ShardedView(full, lambda name, t: cut_parameter(self.cfg, self.ep, self.rank, name, t),
                           dict(self.named_parameters()))


class ExpertParallelMlaMoe(ExpertParallelMoe, MlaMoeModel):
    """``ExpertParallelMoe`` of an ``MlaMoeModel`` (GLM-4.7-Flash, DeepSeek-V3 style)."""


class ExpertParallelHybridMoe(ExpertParallelMoe, HybridMoeModel):
    """``ExpertParallelMoe`` of a ``HybridMoeModel`` (Qwen3.5-MoE)."""


_EP_CLASSES = {"mla_moe": ExpertParallelMlaMoe, "hybrid_moe": ExpertParallelHybridMoe}

__all__ = ["EP_FAMILIES", "EP_REGION_IMPLS", "ExpertParallelHybridMoe", "ExpertParallelMlaMoe", "ExpertParallelMoe",
           "TRAINER_CASES", "check_ep", "cut_parameter", "ep_problems", "is_expert_weight", "num_routed_experts"]
