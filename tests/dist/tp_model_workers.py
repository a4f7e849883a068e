"""What each rank of the tensor-parallel dense model tests runs (test_tp_dense_model.py).

``run_world(out_dir)`` starts one world of 4 gloo processes (one start-up for both sizes: each
process's imports and first contract build take most of the time on a small CPU). Every rank runs
at TP = 4 in the whole world and at TP = 2 in its pair's group ([0, 1] or [2, 3]); each time it
builds the same random ``dense_tp_tiny`` model from a seed, installs the ``isoexec_tp4`` contract
(K_LEAVES = 4 on o_proj and down_proj, tp claimed 1/2/4), cuts it with ``TensorParallelDense`` and
keeps, per dtype and trainer case, the hidden states, its vocabulary slice of the logits and the
token logprobs, saved to ``out_dir/rank{rank}.pt`` as ``{tp: results}``. The test compares them
with the single-process ``DenseModel`` under the same contract, computed in the test process.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import traceback
from pathlib import Path

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import dist_workers  # noqa: E402
from dist_workers import _free_port  # noqa: E402
from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.errors import TopologyRefused  # noqa: E402
from isoexec.model import ForwardBatch, build_model  # noqa: E402
from isoexec.model import tp_dense  # noqa: E402
from isoexec_kernels.gemm import linear  # noqa: E402

MODEL, COMPOSITION = "dense_tp_tiny", "isoexec_tp4"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = ("trainer_score", "trainer_fwd")
LENGTHS = (6, 2, 5)
SEED = 11


@functools.lru_cache(maxsize=None)
def _contract(composition: str, model: str):
    return build_contract("dense", composition, "cpu", model)


def model_and_contract(dtype, composition=COMPOSITION, model=MODEL):
    """The single-process model every rank (and the test) rebuilds: random weights from SEED."""
    contract = _contract(composition, model)
    m = build_model("dense", load_model_config(model)["hf_config"], dtype=dtype)
    m.init_random(SEED)
    m.install(contract)
    return m, contract


def inputs(vocab_size: int):
    g = torch.Generator().manual_seed(SEED + 1)
    T = sum(LENGTHS)
    return torch.randint(0, vocab_size, (T,), generator=g), torch.randint(0, vocab_size, (T,), generator=g)


def forward(model, case: str) -> dict:
    """Hidden states, logits (a TP model's: its vocabulary slice) and token logprobs for ``case``;
    trainer_fwd with autograd on and the parameters requiring grad, as a trainer runs it."""
    ids, targets = inputs(model.cfg.vocab_size)
    batch = ForwardBatch.packed(LENGTHS, case, "cpu")
    with torch.set_grad_enabled(case == "trainer_fwd"):
        for p in model.parameters():
            p.requires_grad_(case == "trainer_fwd")
        h = model.hidden_states(ids, batch)
        logits = model.logits(h, case)
        lp = model.token_logprobs(h, targets, case)
    return {"hidden": h.detach(), "logits": logits.detach(), "logprobs": lp.detach()}


def _stock_row_parallel(x, weight, bias, *, in_features, leaves, group=None):
    """Negative control, the usual row-parallel linear: this rank's K shard as one fp32 partial
    (one K loop over the shard), ``all_reduce(SUM)``, one rounding."""
    part = linear(x.reshape(-1, x.shape[-1]), weight, None, out_dtype=torch.float32)
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
    out = part if bias is None else part + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


_refusal = functools.partial(dist_workers._refusal, errors=(TopologyRefused,))


def cases(group=None) -> dict:
    """Everything one rank computes on the tensor-parallel ``group`` (None: one process, or the
    default group)."""
    res = {}
    for dt, dtype in DTYPES.items():
        model, _ = model_and_contract(dtype)
        tpm = tp_dense.TensorParallelDense(model, group)
        res[f"{dt}/vocab_range"] = tpm.vocab_range
        for case in CASES:
            res[f"{dt}/{case}"] = forward(tpm, case)
        if dist.is_initialized() and dtype == torch.float32:
            # negative control: the same cut with the row-parallel sums all-reduced
            real = tp_dense.row_parallel_linear
            tp_dense.row_parallel_linear = _stock_row_parallel
            try:
                res[f"{dt}/stock_all_reduce"] = forward(tpm, "trainer_score")
            finally:
                tp_dense.row_parallel_linear = real
    # refusals inside a real group, before any collective: every rank raises, none waits
    f32 = DTYPES["fp32"]
    res["refuse/unclaimed_tp"] = _refusal(lambda: tp_dense.TensorParallelDense(
        model_and_contract(f32, "isoexec", MODEL)[0], group))
    res["refuse/dense_tiny"] = _refusal(lambda: tp_dense.TensorParallelDense(
        model_and_contract(f32, "isoexec", "dense_tiny")[0], group))
    return res


WORLD = 4
PAIRS = ([0, 1], [2, 3])


def _entry(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        pairs = [dist.new_group(p) for p in PAIRS]  # every rank creates every group
        res = {2: cases(pairs[rank // 2]), 4: cases(None)}
    except Exception:
        res = {"__error__": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def run_world(out_dir: Path) -> dict[int, list[dict]]:
    """{tp: [results of each rank of one group of that size]}: TP = 2 from both pairs (4 ranks),
    TP = 4 from the world."""
    mp.spawn(_entry, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True)
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    errors = [r["__error__"] for r in ranks if "__error__" in r]
    if errors:
        raise AssertionError(f"a rank failed:\n{errors[0]}")
    return {tp: [r[tp] for r in ranks] for tp in (2, 4)}
