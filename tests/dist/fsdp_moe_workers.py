"""What each rank of test_fsdp_moe.py runs: the FSDP2 trainer (``FSDPTrainer``, every parameter
sharded, the routed experts included) on the tiny MoE models in the world of two gloo ranks, with
FSDP2's ``set_reduce_scatter_unused_params`` and without it (removed from ``FSDPModule`` while the
model is sharded, as torch 2.11 lacks it; the CPU torch has it).

Models (``MODELS``): ``glm`` (``mla_moe_tiny``: 1 dense + 2 MoE layers, 8 experts, top-2 in
groups) and ``qwen`` (``hybrid_moe_tiny``: 4 MoE layers, 8 experts, softmax top-2), under the
``isoexec`` composition, and the same two as ``glm_native`` and ``qwen_native`` under the ``native``
composition (``COMPOSITIONS``): the stock regions, the MLA and SDPA attention, the Gated DeltaNet
chunk form and conv, transformers' router and grouped_mm experts, through an empty pass of each
kind (before ``isoexec_kernels._empty.no_token`` the native attention and chunk form raised on it).
One train call of one mini-batch of 4 sequences (``LENGTHS``), one AdamW
update without clipping, micro-batches of at most ``BUDGET`` tokens: rank 0 takes sequences 0 and
1 (6 + 5 tokens: two micro-batches), rank 1 sequences 2 and 3 (3 + 3: one), so rank 1 runs one
empty training pass (no token) in lockstep with rank 0's second micro-batch, and one empty scoring
pass when the call's old logprobs are scored. Short micro-batches leave experts idle, and the two
ranks' micro-batches route to different experts.

What a run records, besides the fp32 masters after the call: every ``experts`` region call of the
training forward (per-expert row counts, in call order: a pass runs the model's MoE layers in
order), and, at every FSDP2 unit's post-backward (``FSDPParamGroup.post_backward``, wrapped for
the run), the unit's parameters that require a gradient, those without one, and whether FSDP2's
zeros-for-unused switch is on in that unit.
"""

from __future__ import annotations

import contextlib
import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

from isoexec.contract import decode  # noqa: E402
from isoexec.enforce import Bound  # noqa: E402
from isoexec.model import HybridMoeConfig, HybridMoeModel, MlaMoeConfig, MlaMoeModel  # noqa: E402
from isoexec.train import TrainBatch, TrainConfig, Trainer  # noqa: E402

WORLD = 2
MODELS = {"glm": ("mla_moe", "mla_moe_tiny", MlaMoeModel, MlaMoeConfig),
          "qwen": ("hybrid_moe", "hybrid_moe_tiny", HybridMoeModel, HybridMoeConfig)}
MODELS.update({f"{name}_native": m for name, m in MODELS.items()})
COMPOSITIONS = {name: "native" if name.endswith("_native") else "isoexec" for name in MODELS}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_SEED = 7
LENGTHS = (6, 5, 3, 3)   # rank 0: [6], [5]; rank 1: [3, 3] and an empty pass
PROMPT = 2
MINI = len(LENGTHS)      # one mini-batch, one update
BUDGET = 8
VOCAB = 512
CONFIG = dict(lr=1e-3, weight_decay=0.01, grad_clip=None, micro_batch_tokens=BUDGET)
# the single process's order of the same sequences: its in-order packing by BUDGET makes the
# micro-batches [0], [2, 3], [1], whose gradients it accumulates as (g0 + g23) + g1, the sum the
# sharded run makes (rank 0's and rank 1's first micro-batches reduced in rank order, then rank 0's
# second with rank 1's empty pass, added into the sharded gradient)
SINGLE_ORDER = (0, 2, 3, 1)
SWITCH = "set_reduce_scatter_unused_params"
# (model, dtype, switch, activation checkpointing)
RUNS = (("glm", "fp32", True, False), ("glm", "fp32", False, False),
        ("qwen", "fp32", True, False), ("qwen", "fp32", False, False),
        ("glm", "bf16", True, False), ("glm", "bf16", False, False),
        ("qwen", "fp32", False, True),
        ("glm_native", "fp32", True, False), ("glm_native", "fp32", False, False),
        ("qwen_native", "fp32", True, False), ("qwen_native", "fp32", False, False))


def run_key(name, dt, switch, ckpt) -> str:
    return f"{name}/{dt}/{'switch' if switch else 'no_switch'}{'/checkpointed' if ckpt else ''}"


def config(**kw) -> TrainConfig:
    return TrainConfig(**{**CONFIG, **kw})


def train_batch(order=None) -> TrainBatch:
    g = torch.Generator().manual_seed(3000)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    adv = torch.randn(len(LENGTHS), generator=g).tolist()
    rollout = [-(torch.randn(n - PROMPT, generator=g).abs() + 5.0) for n in LENGTHS]
    order = range(len(LENGTHS)) if order is None else order
    return TrainBatch([seqs[i] for i in order], [PROMPT] * len(LENGTHS), [adv[i] for i in order],
                      [rollout[i] for i in order])


def make_job() -> dict:
    """The contracts (encoded) and model configs, built once outside the ranks."""
    from isoexec.compose import build_contract, load_model_config
    from isoexec.contract import encode

    job = {"contracts": {}, "cfgs": {}}
    for name, (family, model, _, cfg_cls) in MODELS.items():
        job["cfgs"][name] = cfg_cls.from_hf(load_model_config(model)["hf_config"])
        job["contracts"][name] = encode(build_contract(family, COMPOSITIONS[name], "cpu", model))
    return job


def build_model(job: dict, name: str, dtype=torch.float32):
    m = MODELS[name][2](job["cfgs"][name], dtype=dtype).init_random(MODEL_SEED)
    m.install(decode(job["contracts"][name]))
    return m


def single_run(job: dict, name: str, dtype=torch.float32) -> dict:
    """The one-process ``Trainer``'s fp32 masters after the same call on ``SINGLE_ORDER``."""
    t = Trainer(build_model(job, name, dtype), config())
    b = train_batch(SINGLE_ORDER)
    t.train(b, t.old_logprobs(b), mini_batch_size=MINI)
    return {n: m.clone() for n, m in zip(t.optimizer.names, t.optimizer.masters)}


# ---------------------------------------------------------------------------------------- watches
def record_expert_rows(model) -> list:
    """Make the training forward's ``experts`` region record each call's per-expert row counts."""
    plan, calls = model.plans["trainer_fwd"], []
    bound = plan.by_op["experts"]

    def recording(x, disp, gate_up, down):
        calls.append(disp.counts.tolist())
        return bound.fn(x, disp, gate_up, down)

    plan.by_op["experts"] = Bound(recording, bound.record)
    return calls


@contextlib.contextmanager
def watched_post_backward(log: list):
    """Record, at each FSDP2 unit's post-backward while gathered, its parameters requiring a
    gradient, those without one (FSDP2 reduce-scatters only the others unless the switch is on)
    and the switch's state in the unit."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    inner = FSDPParamGroup.post_backward

    def post_backward(self, *args):
        if self.is_unsharded:
            need = [fp for fp in self.fsdp_params if fp.unsharded_param.requires_grad]
            log.append({"unit": self._module_fqn, "params": [fp._param_fqn for fp in need],
                        "missing": [fp._param_fqn for fp in need
                                    if fp.unsharded_param.grad is None and fp.unsharded_accumulated_grad is None],
                        "switch": getattr(self, "reduce_scatter_unused_params", None)})
        return inner(self, *args)

    FSDPParamGroup.post_backward = post_backward
    try:
        yield
    finally:
        FSDPParamGroup.post_backward = inner


@contextlib.contextmanager
def without_switch(remove: bool):
    """``FSDPModule`` without ``set_reduce_scatter_unused_params`` (torch 2.11's), put back after."""
    method = FSDPModule.__dict__.get(SWITCH) if remove else None
    if method is not None:
        delattr(FSDPModule, SWITCH)
    try:
        yield
    finally:
        if method is not None:
            setattr(FSDPModule, SWITCH, method)


# -------------------------------------------------------------------------------------------- plan
def _run(job, name, dt, switch, ckpt) -> dict:
    from isoexec.dist.fsdp import FSDPTrainer

    model = build_model(job, name, DTYPES[dt])
    rows, units, empty = record_expert_rows(model), [], [0, 0]
    with without_switch(not switch), watched_post_backward(units):
        t = FSDPTrainer(model, config(activation_checkpointing=ckpt))
        has_switch = hasattr(t.model, SWITCH)
        run_empty = t._empty_pass

        def counted(grad):
            empty[0 if grad else 1] += 1
            return run_empty(grad)

        t._empty_pass = counted
        b = train_batch()
        old = t.old_logprobs(b)
        stats = t.train(b, old, mini_batch_size=MINI)
    return {"params": t.full_parameters(), "stats": stats, "rows": rows, "units": units,
            "empty_passes": empty, "has_switch": has_switch,
            "moe_layers": sum(hasattr(L, "experts_gate_up") for L in model.layers)}


def plan(job, ws, rank) -> dict:
    return {run_key(*r): _run(job, *r) for r in RUNS}
