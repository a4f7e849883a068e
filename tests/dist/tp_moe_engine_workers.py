"""What each rank of the tensor-parallel MoE engine tests runs (test_tp_moe_engine.py).

``world_cases(job, rank)`` runs in the world of 4 gloo processes of the other tensor-parallel tests
(worlds.py, part ``tp_moe_engine``): every rank serves the same requests with an ``Engine`` on its
shards of each MoE family's tiny model (``mla_moe_tp_tiny``, ``hybrid_moe_tp_tiny``, the models of
test_tp_moe_model.py), at TP = 2 in its pair's group and at TP = 4 in the whole world, under the
``isoexec_tp4`` contract, fp32 and bf16. The pool is small, so prompts are prefilled in chunks and
running sequences are preempted; decode lookahead is on (the default). After the first
``generate`` the engine takes new full weights through ``Engine.update_weights`` (each rank cuts
its shards: heads, experts, vocabulary rows) and serves the first requests again (fp32).

While it serves, a rank keeps a log of every MoE layer it ran (the case, the step's rows T and
how many of them its own slice routed) and counts the collectives it entered, so the test can see
decode steps of fewer rows than ranks, a rank routing none of its own, and every rank of a group
entering the same collectives. The negative control (TP = 2, fp32, first run): the same engine with
every row-parallel sum all-reduced. The test compares with the one-process engine and trainer, computed
in the test process.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tp_model_workers as tw  # noqa: E402
import tp_moe_workers as mw  # noqa: E402
from isoexec.contract import decode  # noqa: E402
from isoexec.dist.collectives import group_size_rank  # noqa: E402
from isoexec.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from isoexec.model import tp_moe  # noqa: E402

FAMILIES = tuple(mw.MODELS)
NEW_WEIGHTS_SEED = tw.SEED + 5
N_REQUESTS = 5
N_SECOND = 3     # the requests served again after the weight update
# 32 tokens per step in chunks of 16, 4 running sequences, 6 pages of 16 tokens: the 30- and
# 20-token prompts are chunked, and the pool runs out when the 30-token one decodes into its third
# page, so a sequence is preempted and recomputed
ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=4, num_pages=6, chunk_align=16)
# the collectives the tensor-parallel layers use (isoexec/dist/collectives.py)
COLLECTIVES = ("all_gather", "all_to_all_single", "all_reduce")
# the weight update is served in fp32 (bf16: the first run only, for time)
UPDATE = {"fp32": True, "bf16": False}


def requests(vocab_size: int):
    """Prompts of 1-30 tokens and greedy / top-p / top-k sampling (seeded), each request asking
    for one more token than the one before, so the last ones decode with fewer rows than ranks."""
    g = torch.Generator().manual_seed(tw.SEED + 7)
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (30, 3, 20, 1, 9)]
    params = [SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], top_p=[1.0, 0.9, 1.0][i % 3],
                             top_k=[0, 0, 20][i % 3], seed=3000 + i, max_tokens=5 + 2 * i) for i in range(N_REQUESTS)]
    return prompts, params


def model_and_contract(family: str, dtype, seed: int = tw.SEED):
    """The one-process model every rank (and the test) builds: random weights from ``seed``."""
    model, contract = mw.model_and_contract(family, dtype)
    if seed != tw.SEED:
        model.init_random(seed)
    return model, contract


@contextmanager
def moe_log(group):
    """Record every MoE layer this rank runs (case, T, rows of its own slice) and count the
    collectives it enters, by wrapping ``tp_moe.tp_moe_layer`` and ``torch.distributed``'s
    collectives (the layers look both up at call time)."""
    log = {"layers": [], "collectives": Counter()}
    tp, rank = group_size_rank(group)
    real_layer = tp_moe.tp_moe_layer
    real_coll = {name: getattr(dist, name) for name in COLLECTIVES}

    def layer(plan, L, n, *args, **kwargs):
        t0, t1 = tp_moe._row_slice(n.shape[0], tp, rank)
        log["layers"].append((plan.case, n.shape[0], t1 - t0))
        return real_layer(plan, L, n, *args, **kwargs)

    def counted(name):
        def call(*args, **kwargs):
            log["collectives"][name] += 1
            return real_coll[name](*args, **kwargs)
        return call

    tp_moe.tp_moe_layer = layer
    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        yield log
    finally:
        tp_moe.tp_moe_layer = real_layer
        for name, fn in real_coll.items():
            setattr(dist, name, fn)


def serve(model, contract, family: str, dtype, update: bool = True) -> dict:
    """What ``generate`` serves on ``model`` (a one-process model or a rank's tensor-parallel
    shards), then, with ``update``, the first ``N_SECOND`` requests again after ``update_weights``
    with the full weights of the model made from NEW_WEIGHTS_SEED."""
    engine = Engine(model, contract, EngineConfig(**ENGINE), trainer_contract=contract)
    prompts, params = requests(model.cfg.vocab_size)
    out = {"first": engine.generate(prompts, params)}
    if update:
        new, _ = model_and_contract(family, dtype, NEW_WEIGHTS_SEED)
        engine.update_weights(dict(new.named_parameters()))
        out["second"] = engine.generate(prompts[:N_SECOND], params[:N_SECOND])
    out["preemptions"] = engine.scheduler.num_preemptions
    out["lookahead_steps"] = engine.num_ahead_steps
    out["kv_heads"] = engine.runner.kv.k[0].shape[2]
    return out


def cases(group=None) -> dict:
    """Everything one rank serves on the tensor-parallel ``group`` (None: one process, or the
    default group)."""
    res = {}
    for fam in FAMILIES:
        for dt, dtype in tw.DTYPES.items():
            model, contract = model_and_contract(fam, dtype)
            tpm = tp_moe.TensorParallelMoe(model, group)
            with moe_log(group) as log:
                res[f"{fam}/{dt}"] = serve(tpm, contract, fam, dtype, UPDATE[dt])
            res[f"{fam}/{dt}/log"] = {"layers": log["layers"], "collectives": dict(log["collectives"])}
        if group_size_rank(group)[0] == 2:
            # negative control (TP = 2): the same engine with every row-parallel sum all-reduced
            model, contract = model_and_contract(fam, torch.float32)
            res[f"{fam}/stock_all_reduce"] = mw._all_reduced(
                lambda: serve(tp_moe.TensorParallelMoe(model, group), contract, fam, torch.float32, update=False))
    return res


def world_cases(job: dict, rank: int) -> dict:
    """One rank of the world of 4: {2: its pair's results, 4: the world's}."""
    tw._built.update({key: (decode(c), cfg) for key, (c, cfg) in job["built"].items()})
    pairs = [dist.new_group(p) for p in tw.PAIRS]  # every rank creates every group
    return {2: cases(pairs[rank // 2]), 4: cases(None)}
