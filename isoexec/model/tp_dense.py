"""The dense model's trainer forward under tensor parallelism, with the bits of one process.

``TensorParallelDense(model, group)`` takes a single-process ``DenseModel`` with its contract
installed and keeps, on this rank of the tensor-parallel ``group``, the shards of its weights:

  * q/k/v (one fused weight, or the contract's separate regions) column-parallel by whole heads:
    this rank's ``num_heads / tp`` query heads and ``num_kv_heads / tp`` kv heads (GQA groups stay
    whole: query head h reads kv head ``h // (num_heads / num_kv_heads)``, and both cuts are
    contiguous), the q/k/v bias likewise;
  * gate/up column-parallel in 64-column units (``column_shard_range(I, tp, rank, 64)``), which are
    exactly the K columns of down_proj's K leaves this rank holds (isoexec/dist/partition.py);
  * o_proj and down_proj row-parallel, summed as their contract entry says (``_row_parallel``, the
    one place that decides it): with ``K_LEAVES`` pinned by ``row_parallel_linear``, each rank
    computing its L/tp leaves' fp32 partials, all L gathered and added in leaf order on every rank
    (o_proj's input columns are this rank's heads, which ``DenseModel.tp_problems`` checks fall on
    whole K leaves); without, by ``all_reduce_row_parallel_linear``, the region's own kernel on the
    rank's K shard and the partials all-reduced: the stock path of the native composition
    (``native_tp4``, whose tp claim is ``variant``: its bits depend on tp);
  * the lm_head vocabulary-parallel (``vocab_shard_range``: whole chunks of 4096 logits, or leaves
    of 1024 where the vocabulary has fewer chunks than ranks) and the token logprob by
    ``vocab_parallel_token_logprobs`` (the logprob kernel's reference schedule on CPU, its Triton
    schedule on a GPU);
  * the embedding, the norms, RoPE and the residual stream replicated.

Column-parallel shards run through the contract's bound linear with the K leaf count of the whole
weight (the region's ``K_LEAVES``, else ``k_leaves_for`` of the whole shape), so each output
column is the single-process column; attention, the q/k norms and RoPE run per head, so a rank's
heads are the single-process heads. The row-parallel sum and the logprob keep the one-process
schedule (docs/scale_out.md). So under one contract, TP = 1, 2 and 4 and ``DenseModel`` in one
process give the same hidden states, logits and token logprobs, bit for bit, on every rank
(tests/dist/test_tp_dense_model.py, gloo on CPU).

The size is checked before anything is cut or sent: ``check_topology`` with
``tp_serving_problems`` (the model's own ``DenseModel.tp_problems``, or under a ``variant`` tp claim
its shape checks with the stock kernels allowed) refuses, in one error naming the sizes, a tp the
contract does not claim, a tp that does not divide the row-parallel regions' ``K_LEAVES`` or the
heads, and kernels the tensor-parallel layers do not run. Every rank sees the same sizes, so every
rank refuses and none waits in a collective.

Under the native composition (``native_tp4``) every region runs its stock kernel as in one process,
on the rank's columns or heads: the column-parallel linears are ``torch_linear`` on the rank's rows
of the weight, the row-parallel sums are all-reduced (above), and the trainer cases' token logprob is
the stock vocabulary-parallel one (``all_reduce_vocab_parallel_token_logprobs``: the row max, each
rank's sum-exp and the target's logit all-reduced, as Megatron's vocabulary-parallel cross-entropy;
at tp = 1 the contract's ``torch_log_softmax`` on the whole rows). Its bits are close to one process's, not equal, and depend on tp
(tests/dist/test_tp_native.py).

The engine runs on it too (``engine_prefill``, ``engine_decode``, when the contract declares them):
``Engine(TensorParallelDense(model, group), contract)`` on every rank of the group. A rank's KV
cache holds its own ``num_kv_heads / tp`` kv heads (``kv_cache_heads``, which ``ModelRunner``
allocates), attention over the paged cache runs per head as in one process, and for an engine case
``logits`` returns the whole rows: the vocabulary slices gathered in rank order (a copy), so every
rank's sampler sees the one-process logits, draws the same tokens from the same seeds, and computes
their logprobs by the contract's ``logprob`` region on whole rows, the one-process bits. The ranks
run the same scheduler on the same requests, in step. ``shard_weights`` cuts a full state dict
(the trainer's ``full_parameters()``) into this rank's shards; ``Engine.update_weights`` applies it
(tests/dist/test_tp_engine.py: TP = 2 and 4 engines give the one-process engine's tokens and
logprobs, which the one-process trainer recomputes, bit for bit). The backward is deterministic for a given tp, not tp-invariant
(only forward bits must match): the replicated inputs of column-parallel work get the ranks'
gradients summed in rank order, the row-parallel and logprob backward need no communication. With
tied embeddings the embedding's gradient on a rank holds the lm_head contribution of its own
vocabulary rows only; summing it across ranks is the trainer's job and is not built here.
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec_kernels.gemm import k_leaves_for

from .. import registry
from ..contract import K_LEAVES, ExecutionContract
from ..dist import (all_reduce_row_parallel_linear, all_reduce_vocab_parallel_token_logprobs, column_shard_range,
                    replicated_input, row_parallel_linear, vocab_parallel_token_logprobs, vocab_shard_range)
from ..dist.collectives import gather_columns_in_rank_order, group_size_rank
from ..dist.lazy_parameters import ShardedView
from ..enforce import ExecutionPlan, RuntimeFacts, check_topology
from ..envinfo import runtime_arch
from ..errors import BindingRefused
from .batch import ForwardBatch
from .dense import DenseModel, impl_choices

TRAINER_CASES = ("trainer_fwd", "trainer_score")
ENGINE_CASES = ("engine_prefill", "engine_decode")
UNIT = 64  # gate/up column unit: one K block of down_proj

#: the logprob kernel whose schedules (reference, Triton) ``vocab_parallel_token_logprobs`` reproduces on
#: vocabulary slices; the trainer cases of a contract with another logprob kernel (the stock one)
#: gather whole rows and run that kernel on them
VOCAB_PARALLEL_LOGPROB = "logprob_fixed"

#: {invariant kernel of an op (the model's ``tp_impls``): its stock twin}, the kernels the
#: tensor-parallel layers also run under a tp claim of kind ``variant`` (native_tp4.yaml). Each
#: computes an output column, head or channel from that column's, head's or channel's inputs alone,
#: as its invariant twin does, so a rank runs it on its own shard (the logprob on whole rows):
#: the stock GEMM, log-softmax, depthwise conv, Gated DeltaNet prep, chunked core and gated norm,
#: MLA on SDPA (per head), and the MoE regions, which the expert exchange runs on the rows it is
#: given as one process runs them on its batch (the stock router and combine work per token, the
#: stock dispatch lists a rank's pairs expert-major and token-ascending as the invariant one does,
#: the grouped_mm experts take any rows of their experts). Their bits are the stock kernels', not
#: one process's.
STOCK_TWINS = {"gemm_fixed_k": "torch_linear", "logprob_fixed": "torch_log_softmax",
               "conv_fixed_taps": "torch_conv1d", "gdn_prep_fp32": "torch_gdn_prep",
               "gdn_cpr_chunk": "gdn_chunk_native", "gated_rmsnorm_fixed": "torch_gated_rmsnorm",
               "mla_expanded_walk": "torch_mla_sdpa", "moe_router_fp32": "torch_moe_router",
               "moe_dispatch_stable": "torch_moe_dispatch", "moe_experts_loop": "torch_moe_experts",
               "moe_combine_fp32": "torch_moe_combine"}


def tp_serving_problems(model, contract: ExecutionContract, tp: int) -> list[str]:
    """Why the tensor-parallel model of ``model`` cannot run ``contract`` at size ``tp`` (empty: it
    can), for ``check_topology`` to report beside the contract's own topology problems; what every
    tensor-parallel model's constructor checks before it cuts anything.

    Under a tp claim of kind ``invariant`` (and at tp = 1) it is the model's ``tp_problems``: whole
    heads (and experts) per rank, the row-parallel K leaves on the ranks' head boundaries, a whole
    vocabulary leaf per rank, and the invariant kernels whose schedule the layers reproduce. Under
    a ``variant`` claim the row-parallel sums are all-reduced (such a contract pins no K leaves
    there: validate.py), so there are no leaf boundaries to meet, and each op may run its invariant
    kernel or its stock twin (``STOCK_TWINS``); the shape problems stay."""
    claim = contract.topology_claim("tp")
    if tp == 1 or claim is None or claim.kind != "variant":
        return model.tp_problems(contract, tp)
    out = model.tp_problems(contract, 1)   # what holds at every tp: a pinned K_LEAVES above a region's K blocks
    out += model.tp_head_problems(tp) + model.tp_vocab_problems(tp)
    runs: dict[str, set] = {}
    for e in contract.composition:
        if e.half == "function":
            for o in e.region:
                runs.setdefault(o, set()).add((e.impl.id, e.impl.arch))
    for o, (impl, arch) in model.tp_impls().items():
        allowed = impl_choices(impl)
        twin = STOCK_TWINS.get(allowed[0])   # keyed by the first (preferred) impl of each op
        for got, got_arch in sorted(runs.get(o, ())):
            if got == twin or (got in allowed and arch in (None, got_arch)):
                continue
            want = " or ".join(allowed) + (f" on {arch}" if arch else "") + (f" or the stock {twin}" if twin else "")
            out.append(f"region of {o} runs {got} ({got_arch}); under a variant tp claim at tp > 1 the "
                       f"tensor-parallel layers run {want}")
    return out


def mlp_cut(cfg, tp: int, rank: int, unit: int):
    """How rank ``rank`` cuts the SwiGLU MLP of a layer (dense and hybrid alike): ``cut(name, full)
    -> shard``, None for a tensor that is not the MLP's, and the local gate/up width. gate/up keep
    this rank's 64-column units, down_proj the same columns: its K leaves (module docstring)."""
    inter = cfg.intermediate_size
    i0, i1 = column_shard_range(inter, tp, rank, unit)

    def cut(name: str, full: torch.Tensor) -> torch.Tensor | None:
        if name == "gate_up_weight":
            return torch.cat([full[i0:i1], full[inter + i0:inter + i1]])
        if name == "down_weight":
            return full[:, i0:i1]
        return None

    return cut, i1 - i0


def _layer_cut(cfg, tp: int, rank: int, unit: int):
    """How rank ``rank`` cuts a full ``DenseLayer`` tensor: ``cut(name, full) -> shard`` (the
    replicated norms unchanged), and the local (q, k, v) and gate/up widths."""
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q0, q1 = rank * nh // tp * hd, (rank + 1) * nh // tp * hd
    k0, k1 = rank * nkv // tp * hd, (rank + 1) * nkv // tp * hd
    qs, ks = cfg.q_size, cfg.kv_size
    rows = torch.cat([torch.arange(q0, q1), qs + torch.arange(k0, k1), qs + ks + torch.arange(k0, k1)])
    mlp, inter = mlp_cut(cfg, tp, rank, unit)

    def cut(name: str, full: torch.Tensor) -> torch.Tensor:
        if name in ("qkv_weight", "qkv_bias"):
            return full[rows.to(full.device)]
        if name == "o_weight":
            return full[:, q0:q1]
        shard = mlp(name, full)
        return full if shard is None else shard   # attn_norm, q_norm, k_norm, mlp_norm: replicated

    return cut, (q1 - q0, k1 - k0, k1 - k0), inter


def cut_parameter(cfg, tp: int, rank: int, name: str, full: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s shard of the full ``DenseModel`` parameter ``name`` (works on the ``meta``
    device: the memory plan counts a rank's engine weights with it)."""
    if name == "lm_head":
        v0, v1 = vocab_shard_range(cfg.vocab_size, tp, rank)
        return full[v0:v1]
    if name.startswith("layers."):
        return _layer_cut(cfg, tp, rank, UNIT)[0](name.rsplit(".", 1)[1], full)
    return full    # embed, final_norm: replicated


class _LayerShard(nn.Module):
    NAMES = ("attn_norm", "qkv_weight", "qkv_bias", "q_norm", "k_norm", "o_weight", "mlp_norm",
             "gate_up_weight", "down_weight")

    def __init__(self, layer, cfg, tp: int, rank: int, unit: int):
        super().__init__()
        cut, self.sizes, self.inter = _layer_cut(cfg, tp, rank, unit)
        for name in self.NAMES:
            full = getattr(layer, name)
            setattr(self, name, None if full is None else nn.Parameter(cut(name, full.detach()).clone()))


class _WholeRows(torch.autograd.Function):
    """Forward: every rank's vocabulary slice [T, v1 - v0] of the logits rows gathered in rank order
    into whole rows [T, V] (slices differ by up to one vocabulary unit: padded to the widest to
    travel, cut back). Backward: this rank's columns of the rows' gradient, which is the same on
    every rank (every rank computes the same loss from the same rows)."""

    @staticmethod
    def forward(ctx, part, ranges, group, rank):
        ctx.cols = ranges[rank]
        return gather_columns_in_rank_order(part, [b - a for a, b in ranges], group, len(ranges))

    @staticmethod
    def backward(ctx, grad):
        v0, v1 = ctx.cols
        return grad[:, v0:v1], None, None, None


class TensorParallelDense(nn.Module):
    """This rank's shards of ``model`` (a ``DenseModel`` with a contract installed) on ``group``
    (None: the default group, or one process if none is initialised). Module docstring.

    ``TensorParallelHybrid`` (tp_hybrid.py) extends it as ``HybridModel`` extends ``DenseModel``:
    its own layers (``shard_layers``, ``cut_parameter``, ``hidden_states``), the rest shared."""

    FAMILY = "dense"      # the family of the model it cuts
    WHAT = "tensor-parallel dense model"   # how its errors name it

    def __init__(self, model: DenseModel, group=None):
        super().__init__()
        if model.contract is None:
            raise BindingRefused(f"{self.WHAT}: install a contract on the model first")
        if model.family != self.FAMILY:
            raise BindingRefused(f"{self.WHAT}: the model is of the {model.family} family")
        tp, rank = group_size_rank(group)
        contract, cfg = model.contract, model.cfg
        arch = "cpu" if model.embed.device.type == "cpu" else runtime_arch()
        # every rank refuses here, before any weight is cut or any collective is entered
        check_topology(contract, RuntimeFacts(arch=arch, tp=tp), tp_serving_problems(model, contract, tp))
        self.cfg, self.contract, self.group, self.tp, self.rank = cfg, contract, group, tp, rank
        self.plans: dict[str, ExecutionPlan] = {c: model.plans[c] for c in TRAINER_CASES + ENGINE_CASES
                                                if c in model.plans}
        self.family = model.family
        self.kv_cache_heads = cfg.num_kv_heads // tp   # the kv heads this rank's engine caches
        self.vocab_range = vocab_shard_range(cfg.vocab_size, tp, rank)
        v0, v1 = self.vocab_range
        self.embed = nn.Parameter(model.embed.detach().clone())
        self.layers = nn.ModuleList(self.shard_layers(model))
        self.final_norm = nn.Parameter(model.final_norm.detach().clone())
        self.lm_head = None if model.lm_head is None else nn.Parameter(model.lm_head[v0:v1].detach().clone())
        self._rope = model.rope_table().detach()

    # the one-process attention step, per head: packed, or the paged cache of this rank's kv heads
    _attention = DenseModel._attention

    def shard_layers(self, model) -> list[nn.Module]:
        """This rank's shards of ``model``'s decoder layers (the hybrid model overrides it)."""
        return [_LayerShard(L, self.cfg, self.tp, self.rank, UNIT) for L in model.layers]

    def cut_parameter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full parameter ``name`` (the hybrid model overrides it)."""
        return cut_parameter(self.cfg, self.tp, self.rank, name, full)

    # ------------------------------------------------------------------------------ schedule
    def _plan(self, case: str) -> ExecutionPlan:
        if case not in self.plans:
            raise BindingRefused(f"{self.WHAT}: case {case!r} is not served (the contract "
                                 f"declares {', '.join(sorted(self.plans)) or 'no case'})")
        return self.plans[case]

    def shard_weights(self, full) -> ShardedView:
        """This rank's shards of a full state dict (``DenseModel`` names, e.g. the trainer's
        ``full_parameters()`` or ``gathered_parameters()``), under this model's names, each cut
        when it is read (``ShardedView``: a lazily gathered source stays lazy); names this model
        does not hold pass through unchanged (so ``Engine.update_weights`` reports them)."""
        return ShardedView(full, self.cut_parameter, dict(self.named_parameters()))

    @staticmethod
    def _leaves(plan: ExecutionPlan, op: str, n_full: int, k: int) -> int | None:
        """The K leaves of the region of ``op`` for the whole weight [n_full, k]: its pinned
        ``K_LEAVES``, else the shape table's count for the whole shape (never the shard's); None for
        a kernel that has no K leaves to pass (the stock ``torch_linear``)."""
        rec = plan[op].record
        if K_LEAVES not in registry.impl(rec.impl_id, rec.impl_arch).constants:
            return None
        pinned = rec.constants.get(K_LEAVES)
        return k_leaves_for(n_full, k) if pinned is None else pinned

    def _column(self, plan, ops, x, weight, full_sizes, local_sizes, bias=None):
        """Column-parallel shard of ``ops`` (fused or not, as the contract says): this rank's
        output columns of each op, side by side, by the bound linear with the whole weight's K
        leaves."""
        bound = [plan[o] for o in ops]
        K = x.shape[-1]
        if all(b is bound[0] for b in bound):
            groups = [(ops, sum(full_sizes), sum(local_sizes), 0)]
        else:
            starts = [sum(local_sizes[:i]) for i in range(len(ops))]
            groups = [((o,), n, m, s) for o, n, m, s in zip(ops, full_sizes, local_sizes, starts)]
        outs = []
        for g_ops, n_full, m, s in groups:
            leaves = self._leaves(plan, g_ops[0], n_full, K)
            kw = {} if leaves is None else {"leaves": leaves}
            w = weight[s:s + m]
            b = None if bias is None else bias[s:s + m]
            outs.append(plan[g_ops[0]](x, w, b, **kw) if b is not None else plan[g_ops[0]](x, w, **kw))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _row_parallel(self, plan: ExecutionPlan, op: str, x: torch.Tensor, weight: torch.Tensor,
                      in_features: int) -> torch.Tensor:
        """The row-parallel region of ``op`` on this rank's K shard (``x`` and the same columns of
        the whole ``in_features``-wide weight), summed over the group as its contract entry says;
        the one place that decides it. ``K_LEAVES`` pinned: ``row_parallel_linear``, the L leaves
        gathered and added in leaf order, the bits of one process at every tp. Not pinned:
        ``all_reduce_row_parallel_linear``, the region's own bound kernel on the shard and the
        partials all-reduced, the stock sum, whose bits depend on tp; a contract leaves it unpinned
        at tp > 1 only under a tp claim of kind ``variant`` (validate.py), and at tp = 1 it is the
        region's kernel on the whole K, the one-process bits."""
        leaves = plan[op].record.constants.get(K_LEAVES)
        if leaves is not None:
            return row_parallel_linear(x, weight, None, in_features=in_features, leaves=leaves, group=self.group)
        return all_reduce_row_parallel_linear(x, weight, None, in_features=in_features, group=self.group,
                                              linear=plan[op])

    # ------------------------------------------------------------------------------ forward
    def hidden_states(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] of the tokens ``ids`` [T], replicated on every rank:
        the bits of ``DenseModel.hidden_states`` under the same contract (under the native
        composition, the stock kernels' bits at this tp). An engine batch's KV cache holds this
        rank's kv heads."""
        cfg, plan, tp = self.cfg, self._plan(batch.case), self.tp
        T = ids.shape[0]
        hd, eps = cfg.head_dim, cfg.rms_norm_eps
        nh, nkv = cfg.num_heads // tp, cfg.num_kv_heads // tp
        full_qkv = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        x = plan["embed"](ids, self.embed)
        for i, L in enumerate(self.layers):
            n = replicated_input(plan["attn_norm"](x, L.attn_norm, eps), self.group)
            qkv = self._column(plan, ("q_proj", "k_proj", "v_proj"), n, L.qkv_weight, full_qkv, L.sizes, L.qkv_bias)
            q, k, v = qkv.split(L.sizes, dim=-1)
            q, k = q.reshape(T, nh, hd), k.reshape(T, nkv, hd)
            if cfg.qk_norm:
                q = plan["q_norm"](q, L.q_norm, eps)
                k = plan["k_norm"](k, L.k_norm, eps)
            q = plan["rope"](q, batch.positions, self._rope, theta=cfg.rope_theta)
            k = plan["rope"](k, batch.positions, self._rope, theta=cfg.rope_theta)
            v = v.reshape(T, nkv, hd)
            a = self._attention(plan, i, q, k, v, batch)
            x = x + self._row_parallel(plan, "o_proj", a.reshape(T, nh * hd), L.o_weight, cfg.q_size)
            x = x + self._mlp(plan, L, plan["mlp_norm"](x, L.mlp_norm, eps))
        return plan["final_norm"](x, self.final_norm, eps)

    def _mlp(self, plan: ExecutionPlan, L, n: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP of layer shard ``L`` on its normed input ``n`` (replicated): gate/up on
        this rank's 64-column units, down_proj row-parallel (``_row_parallel``)."""
        inter = self.cfg.intermediate_size
        n = replicated_input(n, self.group)
        gu = self._column(plan, ("gate_proj", "up_proj"), n, L.gate_up_weight, (inter, inter), (L.inter, L.inter))
        g, u = gu.split((L.inter, L.inter), dim=-1)
        return self._row_parallel(plan, "down_proj", plan["act"](g, u), L.down_weight, inter)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """This rank's vocabulary rows of the lm_head (of the embedding, when tied)."""
        v0, v1 = self.vocab_range
        return self.embed[v0:v1] if self.lm_head is None else self.lm_head

    def logits(self, hidden: torch.Tensor, case: str) -> torch.Tensor:
        """Trainer cases: this rank's logits [T, v1 - v0] (``self.vocab_range``), those columns of
        the single-process logits. Engine cases: the whole rows [T, V], every rank's slice gathered
        in rank order (a copy), for the sampler."""
        plan = self._plan(case)
        leaves = self._leaves(plan, "lm_head", self.cfg.vocab_size, hidden.shape[-1])
        kw = {} if leaves is None else {"leaves": leaves}
        part = plan["lm_head"](replicated_input(hidden, self.group), self.lm_head_weight, **kw)
        if case not in ENGINE_CASES:
            return part
        return self._whole_rows(part)

    def _whole_rows(self, part: torch.Tensor) -> torch.Tensor:
        """[T, V]: every rank's vocabulary slice of the logits rows gathered in rank order (a copy);
        differentiable (``_WholeRows``)."""
        if self.tp == 1:
            return part
        ranges = [vocab_shard_range(self.cfg.vocab_size, self.tp, r) for r in range(self.tp)]
        return _WholeRows.apply(part, ranges, self.group, self.rank)

    def logprobs_from_logits(self, logits: torch.Tensor, targets: torch.Tensor, case: str) -> torch.Tensor:
        """fp32 token logprobs of ``logits`` as :meth:`logits` returns them for ``case``: whole
        rows (engine cases) through the contract's ``logprob`` region, as one process computes them;
        vocabulary slices (trainer cases) through ``vocab_parallel_token_logprobs``; under the stock
        ``torch_log_softmax`` (native_tp4) at tp > 1 through its stock vocabulary-parallel form,
        ``all_reduce_vocab_parallel_token_logprobs`` (max, sum-exp and target logit all-reduced, as
        Megatron's vocabulary-parallel cross-entropy: no rank holds whole rows); under another
        kernel gathered into whole rows for it."""
        logprob = self._plan(case)["logprob"]
        if case in ENGINE_CASES:
            return logprob(logits, targets)
        impl = logprob.record.impl_id
        if impl == STOCK_TWINS[VOCAB_PARALLEL_LOGPROB] and self.tp > 1:
            return all_reduce_vocab_parallel_token_logprobs(logits, targets, vocab_size=self.cfg.vocab_size,
                                                            group=self.group)
        if impl != VOCAB_PARALLEL_LOGPROB:
            # a kernel without a vocabulary-parallel form runs on whole rows, as in one process
            return logprob(self._whole_rows(logits), targets)
        return vocab_parallel_token_logprobs(logits, targets, vocab_size=self.cfg.vocab_size, group=self.group)

    def log_softmax_from_logits(self, logits: torch.Tensor, case: str) -> torch.Tensor:
        """fp32 log-softmax of whole rows (an engine case's :meth:`logits`), as one process."""
        if case not in ENGINE_CASES:
            raise BindingRefused(f"{self.WHAT}: whole log-softmax rows are served for engine "
                                 f"cases only, not {case!r}")
        return DenseModel.log_softmax_from_logits(self, logits, case)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, case: str) -> torch.Tensor:
        """fp32 log p(targets[t] | row t) [T], the same on every rank: the bits of
        ``DenseModel.token_logprobs`` (the logprob region's reference schedule on the CPU, its
        Triton schedule on a GPU)."""
        return self.logprobs_from_logits(self.logits(hidden, case), targets, case)


__all__ = ["TensorParallelDense", "TRAINER_CASES", "ENGINE_CASES", "STOCK_TWINS", "UNIT", "VOCAB_PARALLEL_LOGPROB",
           "cut_parameter", "mlp_cut", "tp_serving_problems"]
