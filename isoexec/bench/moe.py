"""``isoexec bench moe``: one mixture-of-experts layer, IsoExec vs stock, forward and forward + backward,
then the attention of the MoE model with MLA (``mla.py``).

The layer is the models' own ``moe_layer`` (``isoexec/model/mla_moe.py``: router, dispatch, experts,
the shared expert's linear and activation regions, combine), run once with the regions the
isoexec composition binds and once with those the native composition binds (the stock twins of
``isoexec_kernels/moe/native.py``: transformers' router and its ``grouped_mm`` experts path, a
stable sort of the pairs by expert, ``torch._grouped_mm`` for gate_up and down, a weighted sum per
token; no host sync). Both plans come from the shipped compositions through ``build_contract``, so
the benchmark times exactly what the mla_moe and hybrid_moe models run, not a copy of it.

Two layer shapes, at their real per-layer dimensions on a GPU (bf16) and tiny on a CPU or with
``--quick`` (fp32, a format check):

* ``glm47_flash`` (mla_moe; GLM-4.7-Flash, ``configs/models/mla_moe_glm47_flash_dims.yaml``):
  hidden 2048, 64 routed experts of 1536, top-4, sigmoid scores with the correction bias,
  n_group 1, topk_group 1, renormalised, times routed_scaling_factor 1.8; one ungated shared
  expert of 1536.
* ``qwen35_35b_a3b`` (hybrid_moe; Qwen3.5-35B-A3B): the defaults of transformers 5.17's
  ``Qwen3_5MoeTextConfig`` (``models/qwen3_5_moe/configuration_qwen3_5_moe.py``): hidden_size 2048,
  num_experts 256, moe_intermediate_size 512, num_experts_per_tok 8, shared_expert_intermediate_size
  512; its router is a softmax over the experts with the top-k renormalised (the config has no
  norm_topk_prob switch), and the shared expert is scaled by sigmoid(x . w_gate).

Rows (docs/benchmarks.md): ``stage`` ``moe.<shape>.fwd`` for M in {1, 64, 256} (decode) and
{4096, 8192} (prefill / training), ``moe.<shape>.fwd+bwd`` (``torch.autograd.grad`` of the output
w.r.t. the input and every trained weight, a fixed upstream gradient) for the training sizes;
``baseline: "torch"`` is the native composition. Every expert is materialised (``experts`` equals
``experts_model``); a run that had to drop experts for memory would show it there.

Timing (``timing`` in every row): on CUDA the decode sizes (M <= 256) are timed as CUDA-graph
replays of both compositions (``common.graph_time_ms``), since the engine decodes in graphs, with
the eager times beside them (``eager_baseline_ms``, ``eager_ours_ms``); a composition that cannot be
captured leaves the row eager and says why (``graph_error``; ``common.time_compositions``).
Prefill and training rows, and every CPU row, are eager.

After the MoE rows come the ``mla.glm47_flash.*`` rows of ``mla.py``: the mla_moe family's
attention region (``attn_core``: MLA in the expanded form) under both compositions, trainer
varlen forward and forward + backward, engine paged prefill, and paged decode under CUDA graphs,
at the GLM-4.7-Flash attention dimensions (tiny on a CPU or with ``--quick``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from isoexec_kernels.moe import RouterSpec

from ..enforce import ExecutionPlan
from ..envinfo import runtime_arch
from ..model.mla_moe import moe_layer
from .common import COMPOSITIONS, composition_plan, fwd_bwd, leaf, print_rows, rotating, row, time_compositions
from .mla import bench_mla


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer's dimensions and router. ``family`` names the model family whose contract
    binds the regions (the MoE regions are the same entries for both families, but each shape is
    benchmarked under the contract of the model it comes from)."""

    name: str
    family: str
    hidden: int
    experts: int
    inter: int
    shared_inter: int
    spec: RouterSpec
    correction_bias: bool   # sigmoid group routers select with a bias (GLM); softmax routers have none
    shared_gate: bool       # Qwen's shared expert is scaled by a sigmoid gate; GLM's is not


def _shapes(big: bool) -> list[MoeShape]:
    """The two model layers, real dimensions when ``big``, else tiny (hidden 64, 8 experts of 32,
    top-2) with the same routers so the quick run exercises the same code paths."""
    glm = RouterSpec(kind="sigmoid_group_topk", top_k=4 if big else 2, norm_topk_prob=True, n_group=1,
                     topk_group=1, routed_scaling_factor=1.8)
    qwen = RouterSpec(kind="softmax_topk", top_k=8 if big else 2, norm_topk_prob=True)
    if big:
        return [MoeShape("glm47_flash", "mla_moe", 2048, 64, 1536, 1536, glm, True, False),
                MoeShape("qwen35_35b_a3b", "hybrid_moe", 2048, 256, 512, 512, qwen, False, True)]
    return [MoeShape("glm47_flash", "mla_moe", 64, 8, 32, 32, glm, True, False),
            MoeShape("qwen35_35b_a3b", "hybrid_moe", 64, 8, 32, 32, qwen, False, True)]


# full expert counts of the real models, recorded next to the benchmarked count in every row
_MODEL_EXPERTS = {s.name: s.experts for s in _shapes(big=True)}
DECODE_M, TRAIN_M = (1, 64, 256), (4096, 8192)
QUICK_DECODE_M, QUICK_TRAIN_M = (1, 16), (64,)


def moe_plan(family: str, composition: str, arch: str, case: str) -> ExecutionPlan:
    """The regions ``composition`` binds for ``family`` on ``arch`` in ``case`` (the model's plan)."""
    return composition_plan(family, composition, arch, case)


def moe_weights(shape: MoeShape, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random layer weights (matrices ~ N(0, 0.02^2), as the models' ``init_random``; the random
    router spreads tokens over the experts). Drawn on the CPU from ``seed`` and moved, so a CPU and a
    GPU run see the same weights; the correction bias stays fp32, as the models keep it."""
    g = torch.Generator().manual_seed(seed)
    h, E, i, si = shape.hidden, shape.experts, shape.inter, shape.shared_inter

    def rnd(*s, scale=0.02):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    w = {"router_weight": rnd(E, h), "experts_gate_up": rnd(E, 2 * i, h), "experts_down": rnd(E, h, i)}
    if shape.correction_bias:
        w["correction_bias"] = (0.01 * torch.randn(E, generator=g)).to(device=device, dtype=torch.float32)
    if si:
        w["shared_gate_up"], w["shared_down"] = rnd(2 * si, h), rnd(h, si)
        if shape.shared_gate:
            w["shared_gate"] = rnd(1, h)
    return w


# the weights autograd differentiates (the correction bias takes no gradient, as in the models)
TRAINED = ("router_weight", "experts_gate_up", "experts_down", "shared_gate_up", "shared_down", "shared_gate")


def moe_fn(plan: ExecutionPlan, shape: MoeShape, weights: dict):
    """``fn(x, *trained weights) -> [M, H]``: the model's ``moe_layer`` under ``plan``, the trained
    weights passed as arguments so that ``fwd_bwd`` differentiates with respect to them."""
    names = [n for n in TRAINED if n in weights]
    fixed = {k: v for k, v in weights.items() if k not in names}

    def fn(x, *ws):
        layer = SimpleNamespace(**fixed, **dict(zip(names, ws)))
        return moe_layer(plan, layer, x, shape.spec, shape.experts, shape.shared_inter)

    return fn, [weights[n] for n in names]


def bench_moe(device: str, quick: bool = False, log=print) -> list[dict]:
    big = device == "cuda" and not quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    arch = "cpu" if device == "cpu" else runtime_arch()
    decode_m, train_m = (DECODE_M, TRAIN_M) if big else (QUICK_DECODE_M, QUICK_TRAIN_M)
    # quick and CPU runs are format checks: one timed call after one warm-up (the CPU reference loops are slow)
    reps = dict(rep_ms=0, min_reps=1) if not big else {}
    rows = []
    for shape in _shapes(big):
        weights = moe_weights(shape, device, dtype)
        fields = {"H": shape.hidden, "experts": shape.experts, "experts_model": _MODEL_EXPERTS[shape.name],
                  "inter": shape.inter, "top_k": shape.spec.top_k, "shared_inter": shape.shared_inter,
                  "router": shape.spec.kind, "dtype": str(dtype).replace("torch.", "")}

        def timed(stage_pass: str, m: int, make_run, graphs: bool = False) -> None:
            t, extra = time_compositions(make_run, device, graphs, **reps)
            r = row({"stage": f"moe.{shape.name}.{stage_pass}", "M": m, "pass": stage_pass, **fields, **extra},
                    "torch", t["native"], t["isoexec"])
            rows.append(r)
            print_rows([r], ["stage", "M", "H", "experts", "inter", "top_k"], log)

        # the engine's case for each size (decode steps for small M, prefill chunks for large M) and
        # the trainer's for fwd+bwd; the MoE regions are the same in every case, but each side runs
        # the plan its model would run there
        plans = {(c, case): moe_plan(shape.family, c, arch, case) for c in COMPOSITIONS
                 for case in ("engine_decode", "engine_prefill", "trainer_fwd")}
        for m in decode_m + train_m:
            case = "engine_decode" if m in decode_m else "engine_prefill"
            fns = {c: moe_fn(plans[c, case], shape, weights) for c in COMPOSITIONS}
            nxt = rotating(lambda: (torch.randn(m, shape.hidden, device=device, dtype=dtype),), 3)

            def fwd(c, fns=fns, nxt=nxt):
                fn, ws = fns[c]

                def run():
                    with torch.no_grad():
                        return fn(nxt()[0], *ws)
                return run

            timed("fwd", m, fwd, graphs=device == "cuda" and m in decode_m)
        for m in train_m:
            x = leaf(torch.randn(m, shape.hidden, device=device, dtype=dtype))
            g = torch.randn(m, shape.hidden, device=device, dtype=dtype)
            runs = {}
            for c in COMPOSITIONS:
                fn, ws = moe_fn(plans[c, "trainer_fwd"], shape, weights)
                runs[c] = fwd_bwd(fn, (x, *[leaf(w) for w in ws]), g)
            timed("fwd+bwd", m, runs.__getitem__)
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows + bench_mla(device, quick, log)
