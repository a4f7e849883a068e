"""What each rank of the expert-parallel trainer tests (test_ep_trainer.py) runs, and the inputs
both sides rebuild from seeds.

``run_world(world_size, out_dir, job)`` starts ``world_size`` gloo processes; each builds the tiny
MoE models from the contracts and configs of the job (so no rank imports transformers) and runs
``plan``; the test compares the ranks' results with each other and with the single-process
``Trainer`` (``single_run``, in the test process, from the same seeds).

Models (``MODELS``): ``glm``, ``mla_moe_tiny`` (8 routed experts: 4 and 4 at ep = 2) and ``qwen7``,
``hybrid_moe_tiny`` cut to 7 routed experts (3 and 4 at ep = 2: slices of unequal size), both under
``isoexec_ep4`` (ep claimed 1, 2, 4). The batch (``train_batch``): 8 sequences of uneven lengths,
two mini-batches of 4 (two AdamW updates per train call, the second off-policy), packed by
``micro_batch_tokens`` = 24 so that at dp = 2 rank 0 runs two micro-batches of each mini-batch and
rank 1 one (the lockstep's empty pass), the clip engaged (tiny models' gradient norms are far above
0.05).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dist_workers import _refusal, spawn_plan_world  # noqa: E402
from isoexec.contract import decode  # noqa: E402
from isoexec.errors import BindingRefused, TopologyRefused  # noqa: E402
from isoexec.model import FAMILY_MODELS, HybridMoeConfig, HybridMoeModel, MlaMoeConfig, MlaMoeModel  # noqa: E402
from isoexec.train import TrainBatch, TrainConfig, Trainer  # noqa: E402

COMPOSITION = "isoexec_ep4"
# name -> (family, model config, class, config class, routed experts or None for the config's own)
MODELS = {"glm": ("mla_moe", "mla_moe_tiny", MlaMoeModel, MlaMoeConfig, None),
          "qwen7": ("hybrid_moe", "hybrid_moe_tiny", HybridMoeModel, HybridMoeConfig, 7)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_SEED = 5
LENGTHS = (14, 12, 5, 5, 9, 7, 10, 6)   # two mini-batches of 4; at dp = 2 rank 0 packs 2 + 1, rank 1 1 + 1
PROMPT = 3
MINI = 4
VOCAB = 512
CONFIG = dict(lr=1e-3, weight_decay=0.01, grad_clip=0.05, micro_batch_tokens=24)
SCORE_LENS = (7, 15, 9, 22, 5, 11, 16, 8)
CALLS = 2   # train calls in the checkpointed run


def config(**kw) -> TrainConfig:
    return TrainConfig(**{**CONFIG, **kw})


def train_batch(call: int) -> TrainBatch:
    g = torch.Generator().manual_seed(2000 + call)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    adv = torch.randn(len(LENGTHS), generator=g).tolist()
    rollout = [-(torch.randn(n - PROMPT, generator=g).abs() + 5.0) for n in LENGTHS]
    return TrainBatch(seqs, [PROMPT] * len(LENGTHS), adv, rollout)


def score_batch() -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in SCORE_LENS]
    return seqs, [min(3, n - 1) for n in SCORE_LENS]


def make_job(path: str) -> dict:
    """The contracts (encoded) and model configs, built once in the test process; ``path``: the
    checkpoint folder."""
    from isoexec.compose import build_contract, load_model_config
    from isoexec.contract import encode

    job = {"path": path, "contracts": {}, "cfgs": {}}
    for name, (family, model, _, cfg_cls, experts) in MODELS.items():
        hf = dict(load_model_config(model)["hf_config"])
        if experts is not None:
            hf["num_experts"] = experts
        job["cfgs"][name] = cfg_cls.from_hf(hf)
        for comp in (COMPOSITION, "isoexec"):
            job["contracts"][(name, comp)] = encode(build_contract(family, comp, "cpu", model))
    job["cfgs"]["dense"] = FAMILY_MODELS["dense"][1].from_hf(load_model_config("dense_tiny")["hf_config"])
    job["contracts"][("dense", "isoexec")] = encode(build_contract("dense", "isoexec", "cpu", "dense_tiny"))
    return job


def build_model(job: dict, name: str, dtype=torch.float32, seed=MODEL_SEED, composition=COMPOSITION):
    m = MODELS[name][2](job["cfgs"][name], dtype=dtype).init_random(seed)
    m.install(decode(job["contracts"][(name, composition)]))
    return m


def train_calls(trainer, calls=range(1), save_after=None, path=None) -> list[dict]:
    """One ``train`` call per entry of ``calls`` (pi_old recomputed: the trainer's own scores)."""
    out = []
    for call in calls:
        b = train_batch(call)
        out.append(trainer.train(b, trainer.old_logprobs(b), mini_batch_size=MINI))
        if save_after == call:
            trainer.save(path)
    return out


def single_run(job: dict, name: str, dtype=torch.float32) -> tuple[dict, list[dict], dict]:
    """The one-process reference: ``Trainer`` through one train call; (fp32 masters, statistics,
    the initial weights)."""
    t = Trainer(build_model(job, name, dtype), config())
    init = {n: m.clone() for n, m in zip(t.optimizer.names, t.optimizer.masters)}
    stats = train_calls(t)
    return {n: m.clone() for n, m in zip(t.optimizer.names, t.optimizer.masters)}, stats, init


# ---------------------------------------------------------------------------------------- plan
def counting_empty_passes(trainer) -> list:
    """Make ``trainer`` count the empty passes it runs (``FSDPTrainer._lockstep``): [training, scoring]."""
    counts, run = [0, 0], trainer._empty_pass

    def counted(grad):
        counts[0 if grad else 1] += 1
        return run(grad)

    trainer._empty_pass = counted
    return counts


def _ep_run(job, name, ep, dtype=torch.float32, cfg=None, **kw) -> dict:
    from isoexec.dist.fsdp import ExpertParallelTrainer

    t = ExpertParallelTrainer(build_model(job, name, dtype), cfg or config(), ep)
    empty = counting_empty_passes(t)
    stats = train_calls(t, **kw)
    return {"params": t.full_parameters(), "stats": stats, "empty_passes": empty}


# (model, dtype, ep) of the runs made twice
RUNS = (("glm", "fp32", 2), ("qwen7", "fp32", 2), ("glm", "bf16", 2), ("glm", "fp32", 1))


def plan(job, ws, rank) -> dict:
    """Refusals first (a rank that refused while another went on would hang the world), then per
    run of ``RUNS`` one train call twice, scoring at ep = 2, one call with activation checkpointing,
    and a checkpointed run with its resume in a fresh trainer."""
    from isoexec.dist.fsdp import ExpertParallelTrainer

    res = {"times": {"start": time.monotonic()}}
    res["refuse/unclaimed_ep"] = _refusal(lambda: ExpertParallelTrainer(
        build_model(job, "glm", composition="isoexec"), config(), ws), errors=(TopologyRefused,))
    res["refuse/ep_divides"] = _refusal(lambda: ExpertParallelTrainer(build_model(job, "glm"), config(), ws + 1))
    dense_cls = FAMILY_MODELS["dense"][0]   # a dense model (contract installed): no experts
    dense = dense_cls(job["cfgs"]["dense"]).init_random(MODEL_SEED)
    dense.install(decode(job["contracts"][("dense", "isoexec")]))
    res["refuse/dense"] = _refusal(lambda: ExpertParallelTrainer(dense, config(), 1), errors=(BindingRefused,))
    dist.barrier()   # the ranks are still paired up: no rank entered a collective another skipped
    res["times"]["refusals"] = time.monotonic()
    seqs, pls = score_batch()
    for name, dt, ep in RUNS:
        key = f"{name}/{dt}/ep{ep}"
        r = {"run": _ep_run(job, name, ep, DTYPES[dt]), "again": _ep_run(job, name, ep, DTYPES[dt])}
        if ep == ws:
            t = ExpertParallelTrainer(build_model(job, name, DTYPES[dt]), config(), ep)
            empty = counting_empty_passes(t)
            r["score"] = t.score(seqs, pls)
            r["score_empty_passes"] = empty[1]
            r["expert_range"] = t.model.expert_range
            r["expert_rows"] = [L.experts_gate_up.shape[0] for L in t.model.layers if hasattr(L, "experts_gate_up")]
        res[key] = r
        res["times"][key] = time.monotonic()
    # activation checkpointing: each layer's forward, MoE exchanges included, recomputed in the backward
    res["glm/fp32/ep2"]["checkpointed"] = _ep_run(job, "glm", ws, cfg=config(activation_checkpointing=True))
    # checkpoint after the first of two train calls, then a fresh trainer (other initial weights) resumes
    path = f"{job['path']}/glm"
    res["plain"] = _ep_run(job, "glm", ws, calls=range(CALLS))
    res["saving"] = _ep_run(job, "glm", ws, calls=range(CALLS), save_after=0, path=path)
    t = ExpertParallelTrainer(build_model(job, "glm", seed=MODEL_SEED + 1), config(), ws)
    t.load(path)
    res["resumed"] = {"stats": train_calls(t, calls=range(1, CALLS)), "params": t.full_parameters(),
                      "step": t.step, "rl_updates": t.rl_updates}
    res["times"]["checkpoint"] = time.monotonic()
    return res


def _plan_in(job: dict, world_size: int, rank: int, out_dir: str) -> dict:
    return plan(job, world_size, rank)


def run_world(world_size: int, out_dir: Path, job: dict) -> list[dict]:
    """Every rank's results of one world of ``world_size`` gloo processes."""
    return spawn_plan_world(_plan_in, world_size, out_dir, job)
