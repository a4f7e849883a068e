"""What each rank of the FSDP2 trainer tests runs, and the inputs both sides rebuild from seeds.

Each rank (worlds.py spawns them, gloo) builds the tiny models from the contracts and model
configs the test process passes in the job (so no rank imports transformers) and runs the plans of
the selected tests; the tests compare the ranks' results with each other and with the
single-process ``Trainer``, run in the test process from the same seeds (``single_run``).

Plans: ``plan_trainer`` (forward bits, steps against a single process, refusals;
test_fsdp_trainer.py), ``plan_determinism`` (test_fsdp_determinism.py), ``plan_save`` and, in a
later world, ``plan_resume`` (test_fsdp_checkpoint.py). ``CASES`` says which (family, dtype) each
runs.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402

from dist_workers import _refusal  # noqa: E402
from isoexec.contract import decode  # noqa: E402
from isoexec.model import FAMILY_MODELS  # noqa: E402
from isoexec.train import PackedSequences, TrainBatch, TrainConfig, Trainer, score_logprobs  # noqa: E402

WORLD_SIZES = (1, 2, 4)
CHECKPOINT_DP = 2   # the world size of the checkpointed run and of its resume
FAMILIES = {"dense": "dense_tiny", "hybrid": "hybrid_tiny"}
# (family, dtype) per plan: the forward and step comparisons also run the dense model in bf16 (the
# determinism plan adds run C in bf16 on its own: see plan_determinism)
CASES = {"trainer": [("dense", "fp32"), ("hybrid", "fp32"), ("dense", "bf16")],
         "determinism": [("dense", "fp32"), ("hybrid", "fp32")],
         "save": [("dense", "fp32"), ("hybrid", "fp32")]}
CASES["resume"] = CASES["save"]
MODEL_SEED = 3
N_SEQ, MINI, SEQ_LEN, PROMPT = 8, 4, 8, 3   # a train call: 8 sequences of 8 tokens, two mini-batches of 4
SCORE_LENS = (7, 15, 9, 22, 5, 11, 16, 8)   # the scoring batch: 8 sequences of uneven lengths
CALLS = 2         # train calls in a checkpointed run (the others make one): each is two updates
VOCAB = 512
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# A: no clipping, so the step can be compared bit for bit with a single process whose
# micro-batches are the ranks' shares. B: a clip that engages (tiny models' gradient norms are
# well above 0.05), the default DAPO loss otherwise; for determinism and the tolerance comparison.
# C: B with one sequence per micro-batch, so that a rank reduces several per mini-batch and adds them.
# R: A with sequence rejection, to reject one rank's whole share (rejection_batch).
CONFIGS = {"A": dict(lr=1e-3, weight_decay=0.01, grad_clip=None, micro_batch_tokens=4096),
           "B": dict(lr=1e-3, weight_decay=0.01, grad_clip=0.05, micro_batch_tokens=4096),
           "C": dict(lr=1e-3, weight_decay=0.01, grad_clip=0.05, micro_batch_tokens=SEQ_LEN),
           "R": dict(lr=1e-3, weight_decay=0.01, grad_clip=None, micro_batch_tokens=4096, rs_kind="k1",
                     rs_threshold=0.5)}


def config(name: str, **kw) -> TrainConfig:
    return TrainConfig(**{**CONFIGS[name], **kw})


def score_batch() -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in SCORE_LENS]
    return seqs, [min(3, n - 1) for n in SCORE_LENS]


def train_batch(step: int) -> TrainBatch:
    """The mini-batch of step ``step``: sequences, advantages and rollout logprobs from a seed (no
    model involved), the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    seqs = [torch.randint(0, VOCAB, (SEQ_LEN,), generator=g).tolist() for _ in range(N_SEQ)]
    adv = torch.randn(N_SEQ, generator=g).tolist()
    rollout = [-(torch.randn(SEQ_LEN - PROMPT, generator=g).abs() + 5.0) for _ in range(N_SEQ)]
    return TrainBatch(seqs, [PROMPT] * N_SEQ, adv, rollout)


def build_model(job: dict, family: str, dtype=torch.float32, seed=MODEL_SEED):
    cls, _ = FAMILY_MODELS[family]
    m = cls(job["cfgs"][family], dtype=dtype).init_random(seed)
    m.install(decode(job["contracts"][family]))
    return m


def rejection_batch(trainer, ws: int) -> TrainBatch:
    """Step 0's batch with rollout logprobs equal to the trainer's own scores, except for the
    sequences the last rank takes from each mini-batch, which are 1 nat off: with k1 rejection at
    0.5 the last rank's whole share is rejected (at dp = 1: the whole batch)."""
    b = train_batch(0)
    last = range((ws - 1) * MINI // ws, MINI)
    rollout = [s - (1.0 if i % MINI in last else 0.0) for i, s in enumerate(trainer.score(b.sequences, b.prompt_lens))]
    return TrainBatch(b.sequences, b.prompt_lens, b.advantages, rollout)


def train_steps(trainer, steps=range(1), save_after=None, path=None, batch_of=None) -> list[dict]:
    """One ``train`` call per entry of ``steps`` (the batch ``train_batch(step)``: two mini-batches
    of MINI, one update each), old logprobs recomputed; ``save(path)`` after call ``save_after``."""
    out = []
    for step in steps:
        batch = train_batch(step) if batch_of is None else batch_of(trainer)
        out.append(trainer.train(batch, trainer.old_logprobs(batch), mini_batch_size=MINI))
        if save_after == step:
            trainer.save(path)
    return out


def single_run(job: dict, family: str, cfg: TrainConfig, dtype=torch.float32, **kw) -> tuple[dict, list[dict]]:
    """The single-process reference: ``Trainer`` (no process group) through ``train_steps``; fp32
    masters by name, and the statistics."""
    t = Trainer(build_model(job, family, dtype), cfg)
    stats = train_steps(t, **kw)
    return {n: m.clone() for n, m in zip(t.optimizer.names, t.optimizer.masters)}, stats


# ---------------------------------------------------------------------------------------- plans
def _fsdp_run(job, family, cfg, dtype=torch.float32, **kw) -> dict:
    from isoexec.dist.fsdp import FSDPTrainer

    t = FSDPTrainer(build_model(job, family, dtype), cfg)
    stats = train_steps(t, **kw)
    return {"params": t.full_parameters(), "stats": stats}


def plan_trainer(job, ws, rank) -> dict:
    """Forward bits (scoring and the training forward), one step of run A, one of the rejection
    run R, and the refusals."""
    from isoexec.dist.fsdp import FSDPTrainer, free_params
    from isoexec.dist.mesh import dp_mesh

    res = {}
    seqs, pls = score_batch()
    for family, dtype_name in CASES["trainer"]:
        dtype = DTYPES[dtype_name]
        key = f"{family}/{dtype_name}"
        t = FSDPTrainer(build_model(job, family, dtype), config("A"))
        r = {"score": t.score(seqs, pls), "share": list(t._share(N_SEQ))}
        # the training forward (trainer_fwd, with a graph) of this rank's share of a step's sequences
        packed = PackedSequences.from_lists([train_batch(0).sequences[i] for i in r["share"]])
        r["fwd"] = score_logprobs(t.model, packed, grad=True).detach()
        free_params(t.model)
        r["A"] = _fsdp_run(job, family, config("A"), dtype)
        if key == "dense/fp32":
            r["R"] = _fsdp_run(job, family, config("R"), batch_of=lambda tr: rejection_batch(tr, ws))
            t = FSDPTrainer(build_model(job, family), config("A"))
            b = train_batch(0)
            r["S"] = {"stats": t.sft_step(b.sequences, b.prompt_lens), "params": t.full_parameters()}
        res[key] = r
    # refusals: every rank raises before any collective, so none is left waiting
    t = FSDPTrainer(build_model(job, "dense"), config("A"))
    if ws > 1:
        bad = train_batch(0).select(range(MINI - 1))
        res["refuse/score"] = _refusal(lambda: t.score(seqs[:ws + 1], pls[:ws + 1]))
        res["refuse/train"] = _refusal(lambda: t.train(bad, [x.clone() for x in bad.rollout_logprobs], MINI - 1))
    res["refuse/mesh"] = _refusal(lambda: dp_mesh(ws + 1))
    res["after_refusals"] = t.score(seqs, pls)     # the group still works
    return res


def plan_determinism(job, ws, rank) -> dict:
    """Run B (one train call, two updates) twice per family; and, for the dense model in fp32 and
    bf16, run C twice (B with one sequence per micro-batch: a rank accumulates several)."""
    res = {f"{family}/{dt}": {"B": _fsdp_run(job, family, config("B")), "B_again": _fsdp_run(job, family, config("B"))}
           for family, dt in CASES["determinism"]}
    if ws == MINI:   # one sequence per rank and mini-batch: run C is run B
        return res
    for dt in ("fp32", "bf16"):
        runs = res.setdefault(f"dense/{dt}", {})
        for name in ("C", "C_again"):
            runs[name] = _fsdp_run(job, "dense", config("C"), DTYPES[dt])
    return res


def plan_save(job, ws, rank) -> dict:
    """Per family: CALLS train calls of config B uninterrupted, and the same saving a checkpoint
    after the first call (it goes on to the second); a save before any step is refused."""
    from isoexec.dist.fsdp import FSDPTrainer

    res = {}
    for family, dt in CASES["save"]:
        res[family] = {"plain": _fsdp_run(job, family, config("B"), steps=range(CALLS)),
                       "saving": _fsdp_run(job, family, config("B"), steps=range(CALLS), save_after=0,
                                           path=f"{job['path']}/{family}")}
    t = FSDPTrainer(build_model(job, "dense"), config("B"))
    try:
        t.save(f"{job['path']}/never")
        res["refuse/save_before_step"] = "accepted"
    except RuntimeError as e:
        res["refuse/save_before_step"] = f"RuntimeError: {e}"
    return res


def plan_resume(job, ws, rank) -> dict:
    """Per family: a fresh trainer (other initial weights) loads the checkpoint and makes the
    second train call."""
    from isoexec.dist.fsdp import FSDPTrainer

    res = {}
    for family, dt in CASES["resume"]:
        t = FSDPTrainer(build_model(job, family, seed=MODEL_SEED + 1), config("B"))
        t.load(f"{job['path']}/{family}")
        stats = train_steps(t, steps=range(1, CALLS))
        res[family] = {"params": t.full_parameters(), "stats": stats, "step": t.step, "rl_updates": t.rl_updates}
    return res


def make_job(path: str) -> dict:
    """The contracts (encoded) and model configs the ranks build from, read here once; ``path``:
    the checkpoint folder of plans save and resume."""
    from isoexec.compose import build_contract, load_model_config
    from isoexec.contract import encode

    fams = sorted({f for cases in CASES.values() for f, _ in cases})
    return {"path": path,
            "contracts": {f: encode(build_contract(f, "isoexec", "cpu", FAMILIES[f])) for f in fams},
            "cfgs": {f: FAMILY_MODELS[f][1].from_hf(load_model_config(FAMILIES[f])["hf_config"]) for f in fams}}
