"""What each rank of the tensor-parallel dense model tests runs (test_tp_dense_model.py).

``world_cases(job, rank)`` runs in a world of 4 gloo processes (worlds.py; one start-up for both
sizes). Every rank runs at TP = 4 in the whole world and at TP = 2 in its pair's group ([0, 1] or
[2, 3]); each time it builds the same random ``dense_tp_tiny`` model from a seed, installs the
``isoexec_tp4`` contract (K_LEAVES = 4 on o_proj and down_proj, tp claimed 1/2/4), cuts it with
``TensorParallelDense`` and keeps, per dtype and trainer case, the hidden states, its vocabulary
slice of the logits and the token logprobs, as ``{tp: results}``. The test compares them with the
single-process ``DenseModel`` under the same contract, computed in the test process. The contracts
and model configs come built in the job (``make_job``): reading a model config imports
transformers, seconds per process that four ranks would otherwise spend on two cores.
"""

from __future__ import annotations

import functools
import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dist_workers  # noqa: E402
from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.contract import decode, encode  # noqa: E402
from isoexec.dist import all_reduce_row_parallel_linear  # noqa: E402
from isoexec.errors import TopologyRefused  # noqa: E402
from isoexec.model import FAMILY_MODELS, ForwardBatch  # noqa: E402
from isoexec.model import tp_dense  # noqa: E402

MODEL, COMPOSITION = "dense_tp_tiny", "isoexec_tp4"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = ("trainer_score", "trainer_fwd")
LENGTHS = (6, 2, 5)
SEED = 11


# the (composition, model) pairs the cases build: the one under test, and the two refused ones
BUILDS = ((COMPOSITION, MODEL), ("isoexec", MODEL), ("isoexec", "dense_tiny"))
_built: dict = {}   # (composition, model) -> (contract, the family's config); the hybrid part's too


def _contract_and_config(composition: str, model: str):
    if (composition, model) not in _built:
        data = load_model_config(model)
        _built[composition, model] = (build_contract(data["family"], composition, "cpu", model),
                                      FAMILY_MODELS[data["family"]][1].from_hf(data["hf_config"]))
    return _built[composition, model]


def model_and_contract(dtype, composition=COMPOSITION, model=MODEL, cfg=None):
    """The single-process model every rank (and the test) rebuilds: random weights from SEED, of
    the family of ``model``'s config (or of ``cfg``, a config of that family given instead)."""
    contract, built_cfg = _contract_and_config(composition, model)
    m = FAMILY_MODELS[contract.model.family][0](cfg or built_cfg, dtype=dtype)
    m.init_random(SEED)
    m.install(contract)
    return m, contract


def make_job() -> dict:
    """The contracts (encoded) and model configs of ``BUILDS``, built once in the test process."""
    return {"built": {key: (encode(c), cfg) for key in BUILDS for c, cfg in [_contract_and_config(*key)]}}


def inputs(vocab_size: int, lengths=LENGTHS):
    g = torch.Generator().manual_seed(SEED + 1)
    T = sum(lengths)
    return torch.randint(0, vocab_size, (T,), generator=g), torch.randint(0, vocab_size, (T,), generator=g)


def forward(model, case: str, lengths=LENGTHS) -> dict:
    """Hidden states, logits (a TP model's: its vocabulary slice) and token logprobs for ``case``
    on packed sequences of ``lengths``; trainer_fwd with autograd on and the parameters requiring
    grad, as a trainer runs it."""
    ids, targets = inputs(model.cfg.vocab_size, lengths)
    batch = ForwardBatch.packed(lengths, case, "cpu")
    with torch.set_grad_enabled(case == "trainer_fwd"):
        for p in model.parameters():
            p.requires_grad_(case == "trainer_fwd")
        h = model.hidden_states(ids, batch)
        logits = model.logits(h, case)
        lp = model.token_logprobs(h, targets, case)
    return {"hidden": h.detach(), "logits": logits.detach(), "logprobs": lp.detach()}


#: negative control, the usual row-parallel linear (one K loop over the shard, all-reduced)
_stock_row_parallel = all_reduce_row_parallel_linear


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


def world_cases(job: dict, rank: int) -> dict:
    """One rank of the world of 4: {2: its pair's cases, 4: the world's}."""
    _built.update({key: (decode(c), cfg) for key, (c, cfg) in job["built"].items()})
    pairs = [dist.new_group(p) for p in PAIRS]  # every rank creates every group
    return {2: cases(pairs[rank // 2]), 4: cases(None)}
