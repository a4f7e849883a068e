"""What each rank of the tensor-parallel engine tests runs (test_tp_engine.py).

``world_cases(job, rank)`` runs in the world of 4 gloo processes that the tensor-parallel model
tests use (worlds.py): every rank serves the same requests with an ``Engine`` on its shards of the
``dense_tp_tiny`` model, at TP = 2 in its pair's group and at TP = 4 in the whole world, under the
``isoexec_tp4`` contract, in fp32 and bf16. The pool is small, so prompts are prefilled in chunks
and running sequences are preempted and recomputed; decode lookahead is on (the default). After
the first ``generate`` the engine takes new full weights through ``Engine.update_weights`` (each
rank cuts its shards) and generates again. The test compares the results with the one-process
engine and the one-process trainer, computed in the test process."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tp_model_workers as tw  # noqa: E402
from isoexec.contract import decode  # noqa: E402
from isoexec.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from isoexec.model import tp_dense  # noqa: E402

N_REQUESTS = 10
# 32 tokens per step in chunks of 16, 4 running sequences, 6 pages of 16 tokens: long prompts
# are chunked and the pool runs out, so sequences are preempted and recomputed
ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=4, num_pages=6, chunk_align=16)
NEW_WEIGHTS_SEED = tw.SEED + 5


def requests(vocab_size: int):
    """The prompts (1-40 tokens) and sampling parameters (greedy, top-p, top-k; seeded) served."""
    g = torch.Generator().manual_seed(tw.SEED + 7)
    prompts = [torch.randint(0, vocab_size, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g).tolist()
               for _ in range(N_REQUESTS)]
    params = [SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], top_p=[1.0, 0.9, 1.0][i % 3],
                             top_k=[0, 0, 20][i % 3], seed=1000 + i, max_tokens=6 + i % 7) for i in range(N_REQUESTS)]
    return prompts, params


def serve(model, contract, dtype, update: bool = True, model_name: str = tw.MODEL, reqs=requests,
          engine_config: dict = ENGINE) -> dict:
    """Results of ``generate`` on ``model`` (a one-process model or a rank's tensor-parallel
    shards of the config ``model_name``) for the requests ``reqs(vocab_size)`` gives, then again
    after ``update_weights`` with the full weights of a model made from NEW_WEIGHTS_SEED."""
    engine = Engine(model, contract, EngineConfig(**engine_config), trainer_contract=contract)
    prompts, params = reqs(model.cfg.vocab_size)
    out = {"first": engine.generate(prompts, params)}
    if update:
        new, _ = tw.model_and_contract(dtype, model=model_name)
        new.init_random(NEW_WEIGHTS_SEED)
        engine.update_weights(dict(new.named_parameters()))
        out["second"] = engine.generate(prompts, params)
    out["preemptions"] = engine.scheduler.num_preemptions
    out["lookahead_steps"] = engine.num_ahead_steps
    return out


def cases(group=None) -> dict:
    res = {}
    for dt, dtype in tw.DTYPES.items():
        model, contract = tw.model_and_contract(dtype)
        res[dt] = serve(tp_dense.TensorParallelDense(model, group), contract, dtype)
    if dist.is_initialized():
        # negative control: the same engine with the row-parallel sums all-reduced
        model, contract = tw.model_and_contract(torch.float32)
        real = tp_dense.row_parallel_linear
        tp_dense.row_parallel_linear = tw._stock_row_parallel
        try:
            res["stock_all_reduce"] = serve(tp_dense.TensorParallelDense(model, group), contract, torch.float32,
                                            update=False)
        finally:
            tp_dense.row_parallel_linear = real
    return res


def world_cases(job: dict, rank: int) -> dict:
    """One rank of the world of 4: {2: its pair's results, 4: the world's}."""
    tw._built.update({key: (decode(c), cfg) for key, (c, cfg) in job["built"].items()})
    pairs = [dist.new_group(p) for p in tw.PAIRS]  # every rank creates every group
    return {2: cases(pairs[rank // 2]), 4: cases(None)}
