"""What each rank of the expert-parallel model tests runs (test_ep_model.py).

``world_cases(job, rank)`` runs in the world of 4 gloo processes (worlds.py, part ``ep_model``;
one start-up for every size). Every rank runs every case at EP = 2 in its pair's group ([0, 1] or
[2, 3]) and at EP = 4 in the whole world; rank 0 also at EP = 1 in a group of its own. Each time
it rebuilds the same random tiny model of each MoE family (``mla_moe_tiny``, GLM style;
``hybrid_moe_tiny``, Qwen3.5-MoE style) from a seed, installs the ``isoexec_ep4`` contract (the
isoexec entries, ep claimed 1, 2, 4), cuts it with ``ExpertParallelMoe`` and runs its own
sequences of the batch (``SEQUENCES``, dealt out whole and contiguous over the group's ranks)
through ``trainer_score``: its tokens' final hidden states, logits and token logprobs. The
``BACKWARD`` cases also run ``trainer_fwd`` (autograd on) and the backward of the rank's part of a
weighted logprob loss, twice: the logprobs, every parameter's gradient (a rank's expert slices
hold the gradient of every rank's rows they received) and whether the two runs gave the same bits.
The test concatenates a group's ranks in rank order and compares them with the one-process model
on the whole batch, computed in the test process.

Variants (``VARIANTS``): ``model``, the model's own routing (top-2 of 8); ``skewed``, routing
pushed onto experts 0-2 in every MoE layer (so at EP = 2 rank 1 and at EP = 4 ranks 2 and 3
receive no rows) and the group's last rank holding no sequence (T = 0); ``top4``, the router at
top-4 (a token's four expert rows, where a grouping by owner rank can show); and the model's own
routing with the whole batch on every rank (``whole_batch``). The negative control
runs the ``top4`` model with the whole batch on every rank and each MoE layer's combine replaced
by the stock all-reduce of per-owner partial sums (``ep_workers.stock_all_reduce_moe``).

The contracts and model configs come built in the job (``make_job``): reading a model config
imports transformers, seconds per process on a small CPU.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from dataclasses import replace

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dist_workers  # noqa: E402
import ep_workers  # noqa: E402
from isoexec.bits import int_view  # noqa: E402
from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.contract import decode, encode  # noqa: E402
from isoexec.errors import BindingRefused, TopologyRefused  # noqa: E402
from isoexec.model import ForwardBatch, HybridMoeConfig, HybridMoeModel, MlaMoeConfig, MlaMoeModel  # noqa: E402
from isoexec.model import ep_moe, mla_moe  # noqa: E402

COMPOSITION = "isoexec_ep4"
FAMILIES = {"glm": ("mla_moe", "mla_moe_tiny", MlaMoeModel, MlaMoeConfig),
            "qwen": ("hybrid_moe", "hybrid_moe_tiny", HybridMoeModel, HybridMoeConfig)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = {"model": ("fp32", "bf16"), "skewed": ("fp32", "bf16"), "top4": ("fp32",)}
#: the cases that also run trainer_fwd with its backward
BACKWARD = (("model", "bf16"), ("skewed", "fp32"))
SEQUENCES = (5, 3, 7, 2, 4, 6)   # lengths; at EP = 4 the ranks hold 1, 2, 1, 2 sequences
SEED = 21
SKEW_CHANNEL = 0   # the hidden channel the skewed variant makes large and routes on
EP_SIZES = (1, 2, 4)
WORLD = 4

# the (family, composition, experts) builds: the one under test, the unclaimed isoexec one, and a
# three-expert hybrid_moe (E < 4) for the refusal
BUILDS = tuple((fam, comp, None) for fam in FAMILIES for comp in (COMPOSITION, "isoexec")) + (("qwen", COMPOSITION, 3),)
_built: dict = {}   # (family, composition, experts) -> (contract, config)


def _contract_and_config(fam: str, composition: str, experts):
    key = (fam, composition, experts)
    if key not in _built:
        family, model, _, cfg_cls = FAMILIES[fam]
        hf = dict(load_model_config(model)["hf_config"])
        if experts is not None:
            hf["num_experts"] = experts
        _built[key] = (build_contract(family, composition, "cpu", model), cfg_cls.from_hf(hf))
    return _built[key]


def make_job() -> dict:
    """The contracts (encoded) and model configs of ``BUILDS``, built once in the test process."""
    return {"built": {key: (encode(c), cfg) for key in BUILDS for c, cfg in [_contract_and_config(*key)]}}


def _skew(model) -> None:
    """Route every token of every MoE layer to experts 0-2: one hidden channel made large in the
    embedding (it stays the largest of the residual stream, so of every normed MoE input), read by
    the router with +1 for experts 0-2 and -1 for experts 3-7."""
    with torch.no_grad():
        model.embed[:, SKEW_CHANNEL] = 1.0
        for L in model.layers:
            if hasattr(L, "router_weight"):
                L.router_weight[:3, SKEW_CHANNEL] = 1.0
                L.router_weight[3:, SKEW_CHANNEL] = -1.0


def build(fam: str, dt: str, variant: str = "model", composition: str = COMPOSITION, experts=None):
    """The single-process model every rank (and the test) rebuilds: random weights from SEED, the
    variant's changes, the contract installed."""
    contract, cfg = _contract_and_config(fam, composition, experts)
    model = FAMILIES[fam][2](cfg, dtype=DTYPES[dt])
    model.init_random(SEED)
    if variant == "skewed":
        _skew(model)
    if variant == "top4":
        s = model.router_spec
        model.router_spec = replace(s, top_k=4, topk_group=s.n_group)
    model.install(contract)
    return model


def batch_inputs(vocab_size: int):
    """(ids, targets) of the whole batch of ``SEQUENCES``."""
    g = torch.Generator().manual_seed(SEED + 1)
    T = sum(SEQUENCES)
    return torch.randint(0, vocab_size, (T,), generator=g), torch.randint(0, vocab_size, (T,), generator=g)


def sequence_share(ep: int, rank: int, empty_last: bool) -> tuple[int, int]:
    """Sequences ``[s0, s1)`` of rank ``rank``: contiguous runs; with ``empty_last`` (ep > 1) the
    last rank holds none and the others share the batch."""
    n = len(SEQUENCES)
    if empty_last and ep > 1:
        if rank == ep - 1:
            return n, n
        return rank * n // (ep - 1), (rank + 1) * n // (ep - 1)
    return rank * n // ep, (rank + 1) * n // ep


def forward(model, s0: int, s1: int, case: str = "trainer_score") -> dict:
    """Hidden states, logits and token logprobs of sequences ``[s0, s1)`` of the batch."""
    ids, targets = batch_inputs(model.cfg.vocab_size)
    t0, t1 = sum(SEQUENCES[:s0]), sum(SEQUENCES[:s1])
    batch = ForwardBatch.packed(SEQUENCES[s0:s1], case, "cpu")
    with torch.no_grad():
        h = model.hidden_states(ids[t0:t1], batch)
        logits = model.logits(h, case)
        lp = model.token_logprobs(h, targets[t0:t1], case)
    return {"hidden": h, "logits": logits, "logprobs": lp, "tokens": (t0, t1)}


def loss_weights() -> torch.Tensor:
    """Per-token weights of the test loss ``sum(w * logprob)`` over the whole batch (signs mixed, so
    no gradient is a plain sum of positives); a rank's loss is its tokens' part."""
    return torch.linspace(-1.0, 1.0, sum(SEQUENCES))


def gradients(model, s0: int, s1: int) -> dict:
    """``trainer_fwd`` on sequences ``[s0, s1)`` with autograd on (the parameters requiring grad,
    as a trainer runs it), then the backward of this rank's part of the loss: its token logprobs
    and every parameter's gradient (None where autograd left none)."""
    ids, targets = batch_inputs(model.cfg.vocab_size)
    t0, t1 = sum(SEQUENCES[:s0]), sum(SEQUENCES[:s1])
    batch = ForwardBatch.packed(SEQUENCES[s0:s1], "trainer_fwd", "cpu")
    for p in model.parameters():
        p.grad = None
    h = model.hidden_states(ids[t0:t1], batch)
    lp = model.token_logprobs(h, targets[t0:t1], "trainer_fwd")
    (lp * loss_weights()[t0:t1]).sum().backward()
    return {"logprobs": lp.detach(), "grads": {n: None if p.grad is None else p.grad.clone()
                                               for n, p in model.named_parameters()}}


def _same_bits(a: dict, b: dict) -> bool:
    same = lambda x, y: (x is None and y is None) or (x is not None and y is not None and  # noqa: E731
                                                      torch.equal(int_view(x), int_view(y)))
    return same(a["logprobs"], b["logprobs"]) and all(same(a["grads"][n], b["grads"][n]) for n in a["grads"])


@contextlib.contextmanager
def _moe_layer_replaced(fn):
    """Every MoE layer of an expert-parallel model calls ``fn`` instead of ``expert_parallel_moe``."""
    real = mla_moe.expert_parallel_moe
    mla_moe.expert_parallel_moe = fn
    try:
        yield
    finally:
        mla_moe.expert_parallel_moe = real


def _recording(experts_used: list):
    """``expert_parallel_moe`` that also records, per MoE layer call, the experts this rank's
    tokens were routed to (the router region on its own tokens, as the layer runs it)."""
    real = mla_moe.expert_parallel_moe

    def fn(x, regions, spec, **kw):
        r = regions["router"](x, kw["router_weight"], spec, kw.get("correction_bias"), kw.get("shared_gate"))
        experts_used.append(sorted(set(r.ids.flatten().tolist())))
        return real(x, regions, spec, **kw)

    return fn


_refusal = functools.partial(dist_workers._refusal, errors=(TopologyRefused, BindingRefused))


def cases(group=None) -> dict:
    """Everything one rank computes on the expert-parallel ``group`` (None: one process, or the
    default group)."""
    from isoexec.dist.collectives import group_size_rank

    ep, rank = group_size_rank(group)
    res = {}
    # refusals first, before any collective: if a rank refused and another did not, the next
    # case's collectives would hang and the world would time out
    for fam in FAMILIES:
        res[f"refuse/{fam}/unclaimed_ep"] = _refusal(lambda: ep_moe.ExpertParallelMoe(
            build(fam, "fp32", composition="isoexec"), group))
    res["refuse/qwen/three_experts"] = _refusal(lambda: ep_moe.ExpertParallelMoe(
        build("qwen", "fp32", experts=3), group))
    for fam in FAMILIES:
        for variant, dts in VARIANTS.items():
            for dt in dts:
                epm = ep_moe.ExpertParallelMoe(build(fam, dt, variant), group)
                s0, s1 = sequence_share(ep, rank, variant == "skewed")
                out = {"sequences": (s0, s1), "expert_range": epm.expert_range,
                       "expert_rows": [L.experts_gate_up.shape[0] for L in epm.layers if hasattr(L, "experts_gate_up")]}
                if variant == "skewed":
                    used: list = []
                    with _moe_layer_replaced(_recording(used)):
                        out.update(forward(epm, s0, s1))
                    out["experts_used"] = used
                else:
                    out.update(forward(epm, s0, s1))
                if (variant, dt) in BACKWARD:   # trainer_fwd and its backward, twice
                    first, again = gradients(epm, s0, s1), gradients(epm, s0, s1)
                    out["train"] = {**first, "deterministic": _same_bits(first, again)}
                res[f"{fam}/{variant}/{dt}"] = out
        # every rank holding the whole batch (each expert computes each row ep times)
        res[f"{fam}/whole_batch"] = forward(ep_moe.ExpertParallelMoe(build(fam, "fp32"), group), 0, len(SEQUENCES))
        # negative control: every rank holds the whole batch, each MoE layer's partials all-reduced
        epm = ep_moe.ExpertParallelMoe(build(fam, "fp32", "top4"), group)
        with _moe_layer_replaced(ep_workers.stock_all_reduce_moe):
            res[f"{fam}/stock_all_reduce"] = forward(epm, 0, len(SEQUENCES))
    return res


def ep_groups(world: int = WORLD) -> dict[int, list[list[int]]]:
    """{ep: the groups of that size that run the cases}: consecutive ranks; at EP = 1 rank 0 alone
    (the other ranks would repeat its arithmetic on the two cores of a small CPU; EP = 1 without
    any process group runs in the test process too)."""
    return {ep: [list(range(g, g + ep)) for g in range(0, world, ep)] if ep > 1 else [[0]] for ep in EP_SIZES}


def world_cases(job: dict, rank: int) -> dict:
    """One rank of the world of 4: {ep: the cases of its group of that size} (no EP = 1 entry on
    ranks 1-3), and the seconds they took."""
    t0 = time.monotonic()
    _built.update({key: (decode(c), cfg) for key, (c, cfg) in job["built"].items()})
    res, seconds = {}, {}
    for ep, groups in ep_groups(dist.get_world_size()).items():
        mine = None
        for members in groups:   # every rank creates every group, in the same order
            g = dist.new_group(members) if ep < dist.get_world_size() else dist.group.WORLD
            if rank in members:
                mine = g
        if mine is None:
            continue
        t1 = time.monotonic()
        res[ep] = cases(mine)
        seconds[ep] = round(time.monotonic() - t1, 2)
    res["seconds"] = {"total": round(time.monotonic() - t0, 2), "cpu": round(time.process_time(), 2), **seconds}
    return res
