"""What each rank of the native tensor-parallel tests runs (test_tp_native.py).

``cases(job, rank)`` runs in the world of 2 gloo processes (worlds.py, part ``tp_native``): TP = 2
over the whole world, under the ``native_tp4`` contract (the stock kernels of ``native.yaml``, the
row-parallel regions with no ``K_LEAVES``, tp claimed ``variant``). For ``dense_tp_tiny``,
``hybrid_tp_tiny``, ``mla_moe_tp_tiny`` and ``hybrid_moe_tp_tiny`` every rank builds the same
random model from a seed, cuts it with the family's tensor-parallel model and keeps:

- what an ``Engine`` on its shards serves (the dense, hybrid and MoE engine tests' requests and
  pools: chunked prefill, preemption, decode lookahead; the MoE layer's rows through the expert
  exchange and native's stock MoE regions), in fp32 and, for the dense family, bf16, with the
  number of calls of each row-parallel sum (the fixed-order leaf gather, ``row_parallel_linear``,
  and the stock all-reduce, ``all_reduce_row_parallel_linear``) that the serving made;
- (dense, fp32) the token logprobs of a packed batch in ``trainer_score``, and in ``trainer_fwd``
  after a backward of their sum the gradients of this rank's o_proj shard and of the (tied)
  embedding's rows of its vocabulary slice, which hold their whole lm_head contribution;
- (dense, fp32) one o_proj call of the model's row-parallel region against the stock arithmetic
  written out here: ``torch_linear`` on the rank's K shard, then ``dist.all_reduce(SUM)``;
- the same requests served under ``isoexec_tp4`` (dense, fp32), whose sums must be the leaf gather;
- a ``variant`` contract made from native.yaml's entries of ``mla_moe_tp_tiny`` (the stock MoE
  regions), which the tensor-parallel MoE layer serves, and a refusal, on every rank before any
  collective: ``native`` (tp pinned to 1) at TP = 2.

The test compares them with the one-process models and engines under the same contracts, computed
in the test process. Contracts and model configs come built in the job.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tp_engine_workers as ew  # noqa: E402
import tp_hybrid_workers as hw  # noqa: E402
import tp_moe_engine_workers as mew  # noqa: E402
import tp_model_workers as tw  # noqa: E402
from isoexec.contract import TopologyClaim, check, decode, encode, with_identities  # noqa: E402
from isoexec.compose import build_contract  # noqa: E402
from isoexec.engine import Engine, EngineConfig  # noqa: E402
from isoexec.model import ForwardBatch, tp_dense  # noqa: E402
from isoexec.model.tensor_parallel import tensor_parallel  # noqa: E402

WORLD = 2
COMPOSITION = "native_tp4"
MODELS = {"dense": "dense_tp_tiny", "hybrid": "hybrid_tp_tiny", "mla_moe": "mla_moe_tp_tiny",
          "hybrid_moe": "hybrid_moe_tp_tiny"}
#: the dense family is served in bf16 too (the all-reduce then sums bf16 partials, as on a GPU)
SERVED = {"dense": ("fp32", "bf16"), "hybrid": ("fp32",), "mla_moe": ("fp32",), "hybrid_moe": ("fp32",)}
#: requests and engine pool per family: the TP engine tests' (tp_engine_workers, tp_hybrid_workers,
#: tp_moe_engine_workers)
TRAFFIC = {"dense": (ew.requests, ew.ENGINE), "hybrid": (hw.requests, hw.ENGINE),
           "mla_moe": (mew.requests, mew.ENGINE), "hybrid_moe": (mew.requests, mew.ENGINE)}
LENGTHS = (6, 2, 5)
MOE_MODEL = "mla_moe_tp_tiny"
BUILDS = tuple((COMPOSITION, m) for m in MODELS.values()) + (("isoexec_tp4", "dense_tp_tiny"),
                                                              ("native", "dense_tp_tiny"))


def variant_native_moe_contract():
    """native.yaml's contract of ``mla_moe_tp_tiny`` with tp claimed ``variant`` over [1, 2]: valid,
    its MoE regions the stock ones (torch_moe_*), which the tensor-parallel MoE layer's expert
    exchange runs on the rows it deals out."""
    c = build_contract("mla_moe", "native", "cpu", MOE_MODEL)
    topology = tuple(TopologyClaim("tp", "variant", (1, 2), "stock-all-reduce") if t.axis == "tp" else t
                     for t in c.claims.topology)
    return check(with_identities(dataclasses.replace(c, claims=dataclasses.replace(c.claims, topology=topology))))


def make_job() -> dict:
    """The contracts (encoded) and model configs of ``BUILDS`` and the MoE refusal's, built once in
    the test process."""
    built = {key: (encode(c), cfg) for key in BUILDS for c, cfg in [tw._contract_and_config(*key)]}
    moe_cfg = tw._contract_and_config("isoexec_tp4", MOE_MODEL)[1]
    built["variant_native", MOE_MODEL] = (encode(variant_native_moe_contract()), moe_cfg)
    return {"built": built}


def model_and_contract(family: str, dtype, composition: str = COMPOSITION):
    return tw.model_and_contract(dtype, composition, MODELS[family])


def counted_calls(fn, targets: dict):
    """``(fn(), {name: calls})``: ``fn`` run with each of ``targets`` (``name: (owner, attribute)``,
    looked up at call time where tp_dense calls it) wrapped to count its calls, then restored as it
    was (a class's own descriptor included)."""
    calls = {name: 0 for name in targets}
    saved = {name: inspect.getattr_static(owner, attr) for name, (owner, attr) in targets.items()}

    def counting(name, f):
        def run(*a, **kw):
            calls[name] += 1
            return f(*a, **kw)
        return run

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, counting(name, getattr(owner, attr)))
    try:
        return fn(), calls
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, saved[name])


def counted_sums(fn):
    """``(fn(), {"leaves": calls, "all_reduce": calls})``: ``fn`` run with the two row-parallel sums
    of tp_dense (where every tensor-parallel model calls them, ``_row_parallel``) counted."""
    return counted_calls(fn, {"leaves": (tp_dense, "row_parallel_linear"),
                              "all_reduce": (tp_dense, "all_reduce_row_parallel_linear")})


def serve(family: str, model, contract) -> dict:
    """What an engine on ``model`` serves of the family's requests, with the row-parallel sums it ran."""
    reqs, pool = TRAFFIC[family]

    def generate():
        engine = Engine(model, contract, EngineConfig(**pool), trainer_contract=contract)
        out = engine.generate(*reqs(model.cfg.vocab_size))
        return out, engine.scheduler.num_preemptions

    (results, preemptions), calls = counted_sums(generate)
    return {"results": results, "preemptions": preemptions, "sums": calls}


def trainer(tpm) -> dict:
    """trainer_score token logprobs of a packed batch, and trainer_fwd's gradients of this rank's
    o_proj shard (layer 0) and of the embedding rows of its vocabulary slice (tied to the lm_head)
    after a backward of the token logprobs' sum; and how often the stock vocabulary-parallel logprob
    ran and whole logits rows were gathered meanwhile."""
    res, calls = counted_calls(lambda: _trainer(tpm), {
        "vocab_all_reduce": (tp_dense, "all_reduce_vocab_parallel_token_logprobs"),
        "whole_rows": (tp_dense._WholeRows, "apply")})
    return {**res, "calls": calls}


def _trainer(tpm) -> dict:
    ids, targets = tw.inputs(tpm.cfg.vocab_size, LENGTHS)
    with torch.no_grad():
        batch = ForwardBatch.packed(LENGTHS, "trainer_score", "cpu")
        score = tpm.token_logprobs(tpm.hidden_states(ids, batch), targets, "trainer_score")
    for p in tpm.parameters():
        p.requires_grad_(True)
        p.grad = None
    batch = ForwardBatch.packed(LENGTHS, "trainer_fwd", "cpu")
    tpm.token_logprobs(tpm.hidden_states(ids, batch), targets, "trainer_fwd").sum().backward()
    v0, v1 = tpm.vocab_range
    return {"score": score, "grad_o": tpm.layers[0].o_weight.grad.clone(), "grad_embed_own_rows": tpm.embed.grad[v0:v1],
            "vocab_range": tpm.vocab_range}


def o_proj_written_out(tpm, rank: int) -> dict:
    """The model's o_proj region (``_row_parallel``) on this rank's heads' columns of a random input,
    and the stock row-parallel linear written out: ``F.linear`` on the shard, ``dist.all_reduce``."""
    g = torch.Generator().manual_seed(tw.SEED + 3 + rank)   # each rank its own shard of the input
    a = torch.randn(7, tpm.layers[0].o_weight.shape[1], generator=g)
    plan = tpm.plans["trainer_score"]
    got = tpm._row_parallel(plan, "o_proj", a, tpm.layers[0].o_weight, tpm.cfg.q_size)
    want = F.linear(a, tpm.layers[0].o_weight)
    dist.all_reduce(want, op=dist.ReduceOp.SUM)
    return {"model": got.detach(), "written_out": want}


def cases(job: dict, rank: int) -> dict:
    tw._built.update({key: (decode(c), cfg) for key, (c, cfg) in job["built"].items()})
    res = {}
    for family, dts in SERVED.items():
        for dt in dts:
            model, contract = model_and_contract(family, tw.DTYPES[dt])
            tpm = tensor_parallel(model)
            res[f"{family}/{dt}/engine"] = serve(family, tpm, contract)
            if family == "dense" and dt == "fp32":
                res["dense/fp32/trainer"] = trainer(tpm)
                res["dense/fp32/o_proj"] = o_proj_written_out(tpm, rank)
    model, contract = model_and_contract("dense", torch.float32, "isoexec_tp4")
    res["dense/fp32/isoexec_tp4_engine"] = serve("dense", tensor_parallel(model), contract)
    # refusals inside the group, before any collective: every rank raises, none waits
    f32 = torch.float32
    res["served/stock_moe"] = tw._refusal(lambda: tensor_parallel(
        tw.model_and_contract(f32, "variant_native", MOE_MODEL)[0]))
    res["refuse/native_pinned"] = tw._refusal(lambda: tensor_parallel(
        model_and_contract("dense", f32, "native")[0]))
    return res
