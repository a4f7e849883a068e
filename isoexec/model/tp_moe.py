"""The MoE models (mla_moe, hybrid_moe) under tensor parallelism, trainer forward and engine, with
the bits of one process.

``TensorParallelMoe(model, group)`` takes a single-process ``MlaMoeModel`` or ``HybridMoeModel``
with its contract installed and returns this rank's model of the tensor-parallel ``group``
(``TensorParallelMlaMoe`` or ``TensorParallelHybridMoe``). The token mixers are cut by heads as in
the dense and hybrid models, and every MoE layer deals its routed experts over the same group:

hybrid_moe (Qwen3.5-MoE): ``TensorParallelHybridMoe`` extends ``TensorParallelHybrid``; its gated
attention and Gated DeltaNet layers are exactly that model's (column-parallel projections by whole
heads, per-head attention, conv, prep, CPR core and gated norm, o_proj and out_proj row-parallel
with the contract's ``K_LEAVES``). Only the MLP step differs: the MoE layer below.

mla_moe (GLM-4.7-Flash, DeepSeek-V3): ``TensorParallelMlaMoe`` extends ``TensorParallelDense`` (the
size checks, the vocabulary-parallel lm_head and logprob, the column-parallel helper, the dense MLP
of the first layers with down_proj row-parallel over its ``K_LEAVES``), with MLA cut by query heads:

  * the latent path replicated: q_a_proj and kv_a_proj (one fused weight, or the contract's two
    regions) with the latent norms, and the shared rope key (the last ``qk_rope_head_dim`` columns of
    kv_a_proj): every rank computes the one-process latents, the same bits;
  * q_b_proj and kv_b_proj column-parallel by whole heads: the rank's ``num_heads / tp`` heads' rows
    (a head's [no-rope | rope] query rows and [k_nope | v] rows are contiguous in transformers'
    layout), through the contract's bound linear with the whole weight's K leaf count, so each
    output column is the one-process column;
  * RoPE, the expansion to per-head q/k/v (copies and zero padding) and the attention run per head:
    ``mla_expanded_walk`` pads each head to the attention width and runs the fixed-walk attention,
    whose every head is computed from its own q, k and v rows alone, as in the dense model;
  * o_proj row-parallel with the contract's ``K_LEAVES``: its K columns are the heads' values, which
    ``tp_problems`` checks fall on whole K leaves.

The MoE layer (both families): every rank holds the same normed rows [T, H]. Rank r routes and
dispatches only the contiguous slice of rows ``[r T / tp, (r + 1) T / tp)`` through
``expert_parallel_moe`` with its own experts ``expert_shard_range(E, tp, rank)``: the rows go to
their experts' owners and back (``all_to_all``, copies), the shared expert (and hybrid_moe's sigmoid
gate) runs on the slice with its replicated weights, and the one-process combine adds each token's
rows; then the slices are gathered in rank order (``all_gather``, a copy), so every rank holds every
combined row. Why a slice and not the whole replicated batch: each row is then routed, sent and
computed once, not tp times, and the bits are the same either way. Every MoE region works per row
(the router and the shared gate see a token's row alone; the dispatch lists a rank's rows; the
experts region's output row is a fixed function of its input row and the expert's weights; the
combine sums one token's rows in ascending expert index in fp32, the shared expert last; the shared
expert's linears are the invariant GEMM, per row), so which rows share a rank, a call or an expert
does not change any row's bits (isoexec/dist/expert_parallel.py). Nothing is added across ranks in
the MoE layer; the router, the correction bias and the shared expert with its gate are replicated.

So under one contract (``isoexec_tp4``: o_proj, down_proj and the Gated DeltaNet out_proj pinned to
``K_LEAVES = 4``), TP = 1, 2 and 4 and the one-process model give the same hidden states, logits
(each rank's vocabulary slice) and token logprobs, bit for bit, on every rank
(tests/dist/test_tp_moe_model.py, gloo on CPU, fp32 and bf16).

Refused before anything is cut or sent, on every rank, in the one ``TopologyRefused`` of
``check_topology`` (the model's ``tp_problems``): a tp the contract does not claim, a tp that does
not divide the query (and kv, and Gated DeltaNet) heads or the row-parallel regions' ``K_LEAVES``,
K leaves off the heads' boundaries, more ranks than routed experts, and regions run by kernels
other than those read above (the invariant GEMM for every linear, ``mla_expanded_walk``, the Gated
DeltaNet regions of the hybrid model, and the MoE regions ``ExpertParallelMoe`` requires), or, under
a tp claim of kind ``variant`` (``native_tp4``), their stock twins (``tp_dense.STOCK_TWINS``: the
layer then runs native.yaml's MoE regions on the rows it deals out, with bits that depend on tp).

The engine runs on it as on the dense and hybrid models (``engine_prefill``, ``engine_decode``):
``Engine(TensorParallelMoe(model, group), contract)`` on every rank of the group, each rank's
engine stepping the same requests with the same scheduler, in lock step, so every rank reaches
each MoE layer's collectives (the row slice's gathers, the exchange's counts and two
``all_to_all``) together, rows of its own or not. An engine step's rows are dealt out like a
trainer batch's: a decode step of fewer rows than ranks leaves some ranks an empty slice (T = 0
there), which still sends its counts, its (no) rows and takes part in the gather, and a row's bits
do not depend on the slice it fell in (above). A rank's KV cache holds its own heads
(``kv_cache_heads`` = ``num_kv_heads / tp``): for mla_moe the expanded, padded per-head K and V
rows the one-process engine caches (``num_kv_heads`` = ``num_heads`` rows of ``attn_width``), so
a rank writes and reads its ``num_heads / tp`` heads' rows exactly as one process does those
heads'; for hybrid_moe the gated attention's kv heads and the Gated DeltaNet state of its value
heads, as ``TensorParallelHybrid``. The sampler sees the whole logits rows (the dense model's
gather), so every rank draws the same tokens and computes their logprobs as one process.
``shard_weights`` (and ``cut_parameter_mla_moe`` / ``cut_parameter_hybrid_moe``, the rows of
``isoexec.model.tensor_parallel.TENSOR_PARALLEL``) cuts full weights into a rank's shards, the
routed experts included, for ``Engine.update_weights`` (the RL run's weight sync) and the memory
plan's per-rank count. So TP = 1, 2 and 4 engines serve the one-process engine's tokens and
logprobs, which the one-process trainer recomputes, bit for bit (tests/dist/test_tp_moe_engine.py,
gloo on CPU, fp32 and bf16, with a weight update in fp32). CUDA graphs: the expert exchange reads
its split sizes on the host, which a captured decode step cannot replay; a capture is refused in
one line (``BindingRefused``, ``EngineConfig(cuda_graphs=False)``). No GPU has run this model.

The backward runs
(the slice and the gather are autograd nodes: a rank's slice gets its rows' gradients, the gather's
backward gathers the slices' input gradients back into whole rows) but only the forward bits are
checked. What a rank's gradients then hold: its experts' weights, the gradient of every rank's rows
(complete); the router, correction bias and shared expert, the gradient of its own slice of rows
only, which a trainer would add over the group (not built here); the rest as in the dense model.
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec_kernels.mla import expand_qkv

from ..dist import replicated_input, vocab_shard_range
from ..dist.collectives import gather_in_rank_order
from ..dist.expert_parallel import ExpertParallelGroup
from ..dist.partition import expert_shard_range
from ..enforce import ExecutionPlan
from ..errors import BindingRefused
from ..model_config import MLA_LATENT_NORM_EPS
from . import ep_moe, tp_hybrid
from .batch import ForwardBatch
from .dense import DenseModel
from .hybrid_moe import HybridMoeModel
from .mla_moe import MlaMoeModel, moe_layer
from .tp_dense import UNIT, TensorParallelDense, mlp_cut
from .tp_hybrid import TensorParallelHybrid


# ---------------------------------------------------------------------------------- the MoE layer
def _row_slice(T: int, tp: int, rank: int) -> tuple[int, int]:
    """The rows ``[t0, t1)`` of T that rank ``rank`` routes (contiguous, in rank order; may be empty)."""
    return rank * T // tp, (rank + 1) * T // tp


class _TakeRows(torch.autograd.Function):
    """Forward: this rank's slice of the replicated rows. Backward: the slices' gradients gathered
    in rank order, so every rank's replicated input gets whole rows' gradients."""

    @staticmethod
    def forward(ctx, x, group, tp, rank):
        ctx.info = (x.shape[0], group, tp)
        t0, t1 = _row_slice(x.shape[0], tp, rank)
        return x[t0:t1].clone()

    @staticmethod
    def backward(ctx, grad):
        T, group, tp = ctx.info
        return _gather_rows(grad.contiguous(), T, group, tp), None, None, None


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's slice of rows gathered in rank order (a copy). Backward: the whole rows'
    gradient (the same on every rank) cut back to this rank's slice."""

    @staticmethod
    def forward(ctx, part, T, group, tp, rank):
        ctx.rows = _row_slice(T, tp, rank)
        return _gather_rows(part, T, group, tp)

    @staticmethod
    def backward(ctx, grad):
        t0, t1 = ctx.rows
        return grad[t0:t1], None, None, None, None


def _gather_rows(part: torch.Tensor, T: int, group, tp: int) -> torch.Tensor:
    """[T, ...]: every rank's ``_row_slice`` rows in rank order (slices padded to the widest to
    travel, then cut back)."""
    if tp == 1:
        return part
    width = -(-T // tp)
    padded = part.new_zeros((width, *part.shape[1:]))
    padded[:part.shape[0]] = part
    parts = gather_in_rank_order(padded, group, tp)
    return torch.cat([parts[r, :b - a] for r, (a, b) in enumerate(_row_slice(T, tp, q) for q in range(tp))])


def tp_moe_layer(plan: ExecutionPlan, L: nn.Module, n: torch.Tensor, spec, num_experts: int, shared_size: int,
                 group, tp: int, rank: int) -> torch.Tensor:
    """One MoE layer on the replicated normed rows ``n`` [T, H] under tensor parallelism: this rank's
    slice of rows through ``moe_layer`` with its experts over ``group`` (``expert_parallel_moe``),
    the combined slices gathered in rank order. The bits of the one-process layer for every row
    (module docstring); every rank of the group must call it together, rows or not (an engine
    step of fewer rows than ranks leaves some ranks an empty slice; they still enter every
    collective)."""
    if n.is_cuda and torch.cuda.is_current_stream_capturing():
        # the exchange reads its split sizes on the host (``expert_parallel_moe``), which a graph
        # cannot replay: refuse in one line rather than capture a step with frozen sizes
        raise BindingRefused("tensor-parallel MoE layer: a decode step cannot be captured in a CUDA graph (the "
                             "expert exchange reads its split sizes on the host); run the engine with "
                             "EngineConfig(cuda_graphs=False)")
    T = n.shape[0]
    part = _TakeRows.apply(n, group, tp, rank) if tp > 1 else n
    out = moe_layer(plan, L, part, spec, num_experts, shared_size, ExpertParallelGroup(group))
    return _GatherRows.apply(out, T, group, tp, rank) if tp > 1 else out


# ---------------------------------------------------------------------------------- cuts
def _expert_cut(cfg, tp: int, rank: int, name: str, full: torch.Tensor) -> torch.Tensor | None:
    """Rank ``rank``'s experts of a stacked expert weight (ep_moe's cut), None for another tensor."""
    if name.rsplit(".", 1)[-1] in ep_moe.EXPERT_WEIGHTS:
        return ep_moe.cut_parameter(cfg, tp, rank, name, full)
    return None


def _mla_layer_cut(cfg, tp: int, rank: int):
    """How rank ``rank`` cuts a full ``MlaLayer`` tensor (``cut(name, full) -> shard``) and its
    local dense gate/up width (0 without a dense MLP)."""
    h0, h1 = rank * cfg.num_heads // tp, (rank + 1) * cfg.num_heads // tp
    qk, kv, dv = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    mlp, inter = mlp_cut(cfg, tp, rank, UNIT) if cfg.intermediate_size else ((lambda name, full: None), 0)
    own = {"q_b_weight": lambda full: full[h0 * qk:h1 * qk], "kv_b_weight": lambda full: full[h0 * kv:h1 * kv],
           "o_weight": lambda full: full[:, h0 * dv:h1 * dv]}

    def cut(name: str, full: torch.Tensor) -> torch.Tensor:
        if name in own:
            return own[name](full)
        shard = _expert_cut(cfg, tp, rank, name, full)
        if shard is None:
            shard = mlp(name, full)
        # qkv_a, the latent norms, attn/mlp norms, router, correction bias, shared expert: replicated
        return full if shard is None else shard

    return cut, inter


def cut_parameter_mla_moe(cfg, tp: int, rank: int, name: str, full: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s shard of the full ``MlaMoeModel`` parameter ``name`` (works on ``meta``)."""
    if name == "lm_head":
        v0, v1 = vocab_shard_range(cfg.vocab_size, tp, rank)
        return full[v0:v1]
    if name.startswith("layers."):
        return _mla_layer_cut(cfg, tp, rank)[0](name.split(".", 2)[2], full)
    return full    # embed, final_norm: replicated


def cut_parameter_hybrid_moe(cfg, tp: int, rank: int, name: str, full: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s shard of the full ``HybridMoeModel`` parameter ``name``: the hybrid model's
    cut of the token mixers, the rank's experts, the rest replicated (works on ``meta``)."""
    shard = _expert_cut(cfg, tp, rank, name, full)
    return tp_hybrid.cut_parameter(cfg, tp, rank, name, full) if shard is None else shard


class _LayerShard(nn.Module):
    """One layer's shards under the full layer's parameter names, by ``cut(name, full)``."""

    def __init__(self, layer, cut, **info):
        super().__init__()
        self.kind = layer.kind
        for k, v in info.items():
            setattr(self, k, v)
        for name, full in layer.named_parameters(recurse=False):
            setattr(self, name, nn.Parameter(cut(name, full.detach()).clone(), requires_grad=full.requires_grad))


# ---------------------------------------------------------------------------------- the models
class _MoeMixin:
    """What both tensor-parallel MoE models add to the dense and hybrid ones: the MoE layer over the
    group (trainer and engine cases alike)."""

    def _moe_init(self, model):
        self.router_spec = model.router_spec
        self.expert_range = expert_shard_range(ep_moe.num_routed_experts(self.cfg), self.tp, self.rank)

    def _moe(self, plan: ExecutionPlan, L, n: torch.Tensor, shared_size: int) -> torch.Tensor:
        return tp_moe_layer(plan, L, n, self.router_spec, ep_moe.num_routed_experts(self.cfg), shared_size,
                            self.group, self.tp, self.rank)


class TensorParallelHybridMoe(_MoeMixin, TensorParallelHybrid):
    """This rank's shards of a ``HybridMoeModel`` (contract installed) on ``group``. Module docstring."""

    FAMILY = "hybrid_moe"
    WHAT = "tensor-parallel hybrid_moe model"

    def __init__(self, model: HybridMoeModel, group=None):
        super().__init__(model, group)
        self._moe_init(model)

    def shard_layers(self, model) -> list[nn.Module]:
        cfg, tp, rank = self.cfg, self.tp, self.rank
        out = []
        for L in model.layers:
            mixer_cut, sizes, _ = tp_hybrid._layer_cut(cfg, L.kind, tp, rank, UNIT)

            def cut(name, full, mixer_cut=mixer_cut):
                shard = _expert_cut(cfg, tp, rank, name, full)
                return mixer_cut(name, full) if shard is None else shard

            out.append(_LayerShard(L, cut, sizes=sizes))
        return out

    def cut_parameter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return cut_parameter_hybrid_moe(self.cfg, self.tp, self.rank, name, full)

    def _mlp(self, plan: ExecutionPlan, L, n: torch.Tensor) -> torch.Tensor:
        """The layer's MoE block (router, experts over the group, gated shared expert) on ``n``: no
        dense MLP, so no down_proj; the MoE layer sums nothing across ranks."""
        return self._moe(plan, L, n, self.cfg.shared_expert_intermediate_size)


class TensorParallelMlaMoe(_MoeMixin, TensorParallelDense):
    """This rank's shards of an ``MlaMoeModel`` (contract installed) on ``group``. Module docstring."""

    FAMILY = "mla_moe"
    WHAT = "tensor-parallel mla_moe model"

    def __init__(self, model: MlaMoeModel, group=None):
        super().__init__(model, group)
        self._moe_init(model)

    def shard_layers(self, model) -> list[nn.Module]:
        cut, inter = _mla_layer_cut(self.cfg, self.tp, self.rank)
        return [_LayerShard(L, cut, inter=inter) for L in model.layers]

    def cut_parameter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return cut_parameter_mla_moe(self.cfg, self.tp, self.rank, name, full)

    # the one-process permutation of the rope pairs and trainer attention, on the rank's heads
    _rope_layout = MlaMoeModel._rope_layout
    _mla_attention = MlaMoeModel._mla_attention

    def _mla(self, plan: ExecutionPlan, layer: int, L, n: torch.Tensor, batch: ForwardBatch):
        """The rank's heads of an MLA layer (module docstring); o_proj row-parallel (``_row_parallel``)."""
        cfg, tp = self.cfg, self.tp
        T = n.shape[0]
        nh, nope, rd, dv = cfg.num_heads // tp, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qr, kvr = cfg.q_lora_rank, cfg.kv_lora_rank
        # the replicated latent path: the one-process latents on every rank; its gradient is the sum
        # of the ranks' heads' (replicated_input), as for the dense model's normed input
        a = replicated_input(DenseModel._linear(plan, ("q_a_proj", "kv_a_proj"), n, L.qkv_a_weight, (qr, kvr + rd)),
                             self.group)
        qa, ckv, k_rope = a.split((qr, kvr, rd), dim=-1)
        q = self._column(plan, ("q_b_proj",), plan["q_a_norm"](qa, L.q_a_norm, MLA_LATENT_NORM_EPS), L.q_b_weight,
                         (cfg.num_heads * cfg.qk_head_dim,), (nh * cfg.qk_head_dim,))
        kv = self._column(plan, ("kv_b_proj",), plan["kv_a_norm"](ckv, L.kv_a_norm, MLA_LATENT_NORM_EPS),
                          L.kv_b_weight, (cfg.num_heads * (nope + dv),), (nh * (nope + dv),))
        q_nope, q_rope = q.reshape(T, nh, nope + rd).split((nope, rd), dim=-1)
        q_rope = plan["rope"](self._rope_layout(q_rope), batch.positions, self._rope, theta=cfg.rope_theta)
        k_rope = plan["rope"](self._rope_layout(k_rope.reshape(T, 1, rd)), batch.positions, self._rope,
                              theta=cfg.rope_theta)
        q, k, v = expand_qkv(q_nope, q_rope, kv.reshape(T, nh, nope + dv), k_rope, nope, dv)
        o = self._mla_attention(plan, layer, q, k, v, batch)
        return self._row_parallel(plan, "o_proj", o.reshape(T, nh * dv), L.o_weight, cfg.num_heads * dv)

    def hidden_states(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] of the tokens ``ids`` [T], replicated on every rank: the
        bits of ``MlaMoeModel.hidden_states`` under the same contract. An engine batch's KV cache
        holds this rank's heads' expanded K and V rows (``kv_cache_heads``)."""
        cfg, plan = self.cfg, self._plan(batch.case)
        eps = cfg.rms_norm_eps
        x = plan["embed"](ids, self.embed)
        for i, L in enumerate(self.layers):
            x = x + self._mla(plan, i, L, plan["attn_norm"](x, L.attn_norm, eps), batch)
            n = plan["mlp_norm"](x, L.mlp_norm, eps)
            x = x + (self._mlp(plan, L, n) if L.kind == "dense" else
                     self._moe(plan, L, n, cfg.shared_intermediate_size))
        return plan["final_norm"](x, self.final_norm, eps)


_TP_CLASSES = {"mla_moe": TensorParallelMlaMoe, "hybrid_moe": TensorParallelHybridMoe}


def TensorParallelMoe(model, group=None):
    """This rank's tensor-parallel model of ``model`` (an ``MlaMoeModel`` or ``HybridMoeModel`` with
    a contract installed) on ``group`` (None: the default group, or one process if none is
    initialised): ``TensorParallelMlaMoe`` or ``TensorParallelHybridMoe``."""
    family = getattr(model, "family", type(model).__name__)
    if family not in _TP_CLASSES:
        raise BindingRefused(f"tensor-parallel MoE model: the {family} family has no routed experts "
                             f"(this serves {', '.join(_TP_CLASSES)})")
    return _TP_CLASSES[family](model, group)


__all__ = ["TensorParallelHybridMoe", "TensorParallelMlaMoe", "TensorParallelMoe", "cut_parameter_hybrid_moe",
           "cut_parameter_mla_moe", "tp_moe_layer"]
