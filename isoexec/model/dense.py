"""The dense family of the unified model (Qwen3 and Qwen2 architectures).

One model class serves the trainer and the engine; what differs between them is only the case
(``trainer_fwd``, ``trainer_score``, ``engine_prefill``, ``engine_decode``), the batch layout and
the KV state. Every piece of arithmetic is a logical op whose implementation comes from the
installed contract's execution plan for that case, so native vs IsoExec is the same code under a
different contract.

Weights are stored fused where regions may fuse (``qkv_weight`` = [Wq; Wk; Wv], ``gate_up_weight``
= [Wg; Wu]); a contract that keeps the ops in separate regions runs one GEMM per row slice.

Qwen3 and Qwen2 differ in two places, set by the config (``DenseConfig``): Qwen2's q/k/v
projections carry a bias (``qkv_bias`` = [bq; bk; bv], handed to the linear region's kernel, which
adds it inside its rounding schedule: fp32, after the K sum, before the one rounding), and Qwen2 has
no q/k RMSNorm (``qk_norm`` False: no ``q_norm``/``k_norm`` parameters, and its contract has no
region for those ops; ``install`` refuses a contract whose ops are not the model's).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.utils.checkpoint
from torch import nn

from isoexec_kernels.attention import write_kv_pages
from isoexec_kernels.gemm.reference import num_k_blocks
from isoexec_kernels.logprob import BLOCK_V, REF_LEAF_V
from isoexec_kernels.rope import rope_cache

from .. import registry
from ..contract import K_LEAVES, ExecutionContract
from ..dist.partition import column_shard_range, row_shard_range
from ..enforce import Bound, BoundRecord, ExecutionPlan, RuntimeFacts, check_topology
from ..envinfo import runtime_arch
from ..errors import BindingRefused
from ..model_config import DenseConfig
from .batch import ForwardBatch


def impl_choices(impl: str | tuple[str, ...]) -> tuple[str, ...]:
    """The impls a ``tp_impls`` entry accepts: one impl id, or a tuple of them (preferred first)."""
    return (impl,) if isinstance(impl, str) else tuple(impl)


@functools.lru_cache(maxsize=64)
def _takes(fn, parameter: str) -> bool:
    """Whether a bound kernel (or a partial of one) accepts the keyword ``parameter``."""
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _qk_norms_in_one_call(plan: ExecutionPlan) -> bool:
    """Whether the q and k norms can run as one call: both regions bound to the same kernel with
    the same constants, one that takes a second weight for a range of heads
    (``isoexec_kernels.rmsnorm``, with and without autograd)."""
    q, k = plan["q_norm"], plan["k_norm"]
    if not (isinstance(q, Bound) and isinstance(k, Bound)):
        return False   # wrapped (the divergence locator records each region's own output)
    same = all(getattr(q.record, f) == getattr(k.record, f)
               for f in ("module", "qualname", "impl_id", "impl_version", "constants"))
    return same and _takes(q.fn, "weight2")


class DenseLayer(nn.Module):
    def __init__(self, cfg: DenseConfig, dtype, device):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        p = lambda *shape: nn.Parameter(torch.empty(shape, dtype=dtype, device=device))  # noqa: E731
        self.attn_norm = p(h)
        self.qkv_weight = p(cfg.q_size + 2 * cfg.kv_size, h)
        self.qkv_bias = p(cfg.q_size + 2 * cfg.kv_size) if cfg.qkv_bias else None
        self.q_norm = p(hd) if cfg.qk_norm else None
        self.k_norm = p(hd) if cfg.qk_norm else None
        self.o_weight = p(h, cfg.q_size)
        self.mlp_norm = p(h)
        self.gate_up_weight = p(2 * cfg.intermediate_size, h)
        self.down_weight = p(h, cfg.intermediate_size)


class DenseModel(nn.Module):
    family = "dense"

    def __init__(self, cfg: DenseConfig, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList(self.make_layers(cfg, dtype, device))
        self.final_norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype, device=device))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device))
        self.plans: dict[str, ExecutionPlan] = {}
        self.contract: ExecutionContract | None = None
        self._rope_tables: dict[str, torch.Tensor] = {}

    def make_layers(self, cfg, dtype, device) -> list[nn.Module]:
        """The decoder layers (the other families override this, and :meth:`rope_dim`)."""
        return [DenseLayer(cfg, dtype, device) for _ in range(cfg.num_layers)]

    def rope_dim(self) -> int:
        """Channels of a head that RoPE rotates."""
        return self.cfg.head_dim

    # ------------------------------------------------------------------------------ contract
    def install(self, contract: ExecutionContract, facts: RuntimeFacts | None = None) -> list[BoundRecord]:
        """Bind every (region, case) of ``contract`` to this model; refuse before any compute if
        the contract's ops are not the model's, or the topology or the bound callables differ from
        the contract."""
        if contract.model.family != self.family:
            raise BindingRefused(f"contract is for the {contract.model.family} family, model is {self.family}")

        self.check_ops(contract)
        facts = facts or RuntimeFacts(arch="cpu" if self.embed.device.type == "cpu" else runtime_arch())
        check_topology(contract, facts, self.tp_problems(contract, facts.tp))
        self.plans = {case: ExecutionPlan.build(contract, case) for case in contract.case_ids}
        self.contract = contract
        return [r for p in self.plans.values() for r in p.records()]

    def linear_k(self) -> dict[str, int]:
        """{linear op: its K (input features)}: what a region's pinned ``K_LEAVES`` must fit."""
        cfg = self.cfg
        h = cfg.hidden_size
        return {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": cfg.q_size, "gate_proj": h, "up_proj": h,
                "down_proj": cfg.intermediate_size, "lm_head": h}

    # the families with a tensor-parallel model (isoexec/model/tp_dense.py, tp_hybrid.py, tp_moe.py)
    TP_FAMILIES = ("dense", "hybrid", "mla_moe", "hybrid_moe")

    def tp_head_problems(self, tp: int) -> list[str]:
        """Heads ``tp`` cannot deal out whole (the hybrid family adds its Gated DeltaNet heads)."""
        nh, nkv = self.cfg.num_heads, self.cfg.num_kv_heads
        if nh % tp or nkv % tp:
            return [f"tp={tp} does not divide the {nh} query heads and {nkv} kv heads (each rank holds "
                    "whole heads of both)"]
        return []

    def tp_row_parallel(self) -> dict[str, tuple[int, int | None]]:
        """{row-parallel op: (K, the heads whose outputs its K columns are, or None for down_proj,
        whose K columns are gate/up's 64-column units)} of the tensor-parallel model."""
        cfg = self.cfg
        return {"o_proj": (cfg.q_size, cfg.num_heads), "down_proj": (cfg.intermediate_size, None)}

    def tp_impls(self) -> dict[str, tuple[str | tuple[str, ...], str | None]]:
        """{op: (impl or impls, arch or None for any)}: the kernels whose schedule the tensor-parallel
        layers reproduce (a linear's columns, the vocabulary-parallel logprob)."""
        want: dict[str, tuple[str, str | None]] = {o: ("gemm_fixed_k", None) for o in self.linear_k()}
        # logprob_fixed on any arch: its reference schedule (CPU) and its Triton one (GPU) both have
        # a vocabulary-parallel form (isoexec/dist/vocab_parallel_logprob.py)
        want["logprob"] = ("logprob_fixed", None)
        return want

    def tp_vocab_problems(self, tp: int, arch: str = "cpu") -> list[str]:
        """The lm_head is cut in whole vocabulary units (``vocab_shard_range``): a leaf of the
        reference schedule per rank at least, and on a GPU arch, where ``logprob_fixed`` runs its
        Triton schedule, a whole chunk of ``BLOCK_V`` logits per rank."""
        V = self.cfg.vocab_size
        vocab_leaves = -(-V // REF_LEAF_V)
        if vocab_leaves < tp:
            return [f"tp={tp} is more than the {vocab_leaves} vocabulary leaves of {REF_LEAF_V} logits "
                    f"(vocab_size={V}); each rank needs a whole leaf"]
        chunks = -(-V // BLOCK_V)
        if arch != "cpu" and chunks < tp:
            return [f"tp={tp} is more than the {chunks} vocabulary chunks of {BLOCK_V} logits (vocab_size={V}); "
                    f"on {arch} each rank needs a whole chunk of the Triton logprob schedule"]
        return []

    def tp_problems(self, contract: ExecutionContract, tp: int) -> list[str]:
        """Why this model cannot run ``contract`` at tensor-parallel size ``tp`` (empty: it can),
        from its own shape: a pinned ``K_LEAVES`` larger than a region's K blocks (at any tp), and
        at tp > 1 the cuts of the tensor-parallel model (``TensorParallelDense``,
        isoexec/model/tp_dense.py; ``TensorParallelHybrid``, tp_hybrid.py; the MoE families',
        tp_moe.py): whole heads (and routed experts) per rank
        (``tp_head_problems``), each row-parallel layer's K leaves on the ranks' head boundaries
        (``tp_row_parallel``), gate/up 64-column units on down_proj's leaves, a whole vocabulary
        leaf (on a GPU arch chunk) per rank, and kernels whose schedule the tensor-parallel layers reproduce
        (``tp_impls``). ``check_topology`` reports them with its own."""
        if self.family not in self.TP_FAMILIES:  # a family without a tensor-parallel model
            return [] if tp == 1 else [f"the {self.family} family has no tensor-parallel model (tp={tp})"]
        out = []
        ks = self.linear_k()
        leaves: dict[str, set] = {}
        impls: dict[str, set] = {}
        for e in contract.composition:
            if e.half != "function":
                continue
            for o in e.region:
                impls.setdefault(o, set()).add((e.impl.id, e.impl.arch))
                if o in ks:
                    L = e.constants.get(K_LEAVES)
                    leaves.setdefault(o, set()).add(L)
                    if L is not None and L > num_k_blocks(ks[o]):
                        out.append(f"region {e.region_name!r} pins {K_LEAVES}={L}, more than the "
                                   f"{num_k_blocks(ks[o])} K block(s) of {o} (K={ks[o]})")
        if tp == 1:
            return out
        out += self.tp_head_problems(tp)
        rows = self.tp_row_parallel()
        for o in rows:
            if len(leaves.get(o, ())) > 1:
                out.append(f"{o} pins different {K_LEAVES} in different cases ({sorted(map(str, leaves[o]))})")
        for o, (K, heads) in rows.items():
            L = next(iter(leaves.get(o) or {None}))
            if L is None or L % tp or L > num_k_blocks(K):
                continue   # reported above, or by the contract's own tp check
            leafs = [row_shard_range(K, L, tp, r) for r in range(tp)]
            if heads is None:   # K columns from gate/up, cut in 64-column units
                if [column_shard_range(K, tp, r, 64) for r in range(tp)] != leafs:
                    out.append(f"gate/up's 64-column units do not meet {o}'s {K_LEAVES}={L} leaves at tp={tp}")
            elif heads % tp == 0:
                mine = [(r * K // tp, (r + 1) * K // tp) for r in range(tp)]
                if mine != leafs:
                    out.append(f"{o}'s K leaves ({K_LEAVES}={L} over K={K}) give the ranks input columns "
                               f"{leafs}, not their heads' {mine}: each rank's heads must span whole K leaves")
        logprob_archs = sorted({a for i, a in impls.get("logprob", ()) if i == "logprob_fixed"} - {"cpu"})
        out += self.tp_vocab_problems(tp, logprob_archs[0] if logprob_archs else "cpu")
        for o, (impl, arch) in self.tp_impls().items():
            allowed = impl_choices(impl)
            for got_impl, got_arch in sorted(impls.get(o, ())):
                if got_impl not in allowed or (arch is not None and got_arch != arch):
                    out.append(f"region of {o} runs {got_impl} ({got_arch}); at tp > 1 it must be "
                               f"{' or '.join(allowed)}" + (f" on {arch}" if arch else "")
                               + ", the schedule the tensor-parallel layers reproduce")
        return out

    def ops(self) -> tuple[str, ...]:
        """The logical ops this model runs: its family's, less those its config has none of."""
        return registry.model_ops(self.family, getattr(self.cfg, "absent_ops", ()))

    def check_ops(self, contract: ExecutionContract) -> None:
        """Refuse a contract whose regions cover other ops than the model runs (a qwen3 contract,
        with q/k norm regions, on a qwen2 model, or the other way round)."""
        want = set(self.ops())
        have = {o for e in contract.composition if e.half == "function" for o in e.region}
        problems = []
        if want - have:
            problems.append(f"no region for op(s) {', '.join(sorted(want - have))}, which this model runs")
        if have - want:
            problems.append(f"region(s) for op(s) {', '.join(sorted(have - want))}, which this model does not run")
        if problems:
            raise BindingRefused(f"the contract does not fit this {self.family} model "
                                 f"({getattr(self.cfg, 'model_type', self.family)}): " + "; ".join(problems))

    def _plan(self, case: str) -> ExecutionPlan:
        try:
            return self.plans[case]
        except KeyError:
            raise BindingRefused(f"no contract installed for case {case!r}; call model.install(contract)") from None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    # ------------------------------------------------------------------------------ init
    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> "DenseModel":
        g = torch.Generator().manual_seed(seed)
        for name, prm in self.named_parameters():
            if name.endswith(".qkv_bias"):       # a bias, not a norm weight: centred on 0
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.1)
            elif prm.dim() == 1:
                prm.copy_(1.0 + 0.05 * torch.randn(prm.shape, generator=g))
            else:
                prm.copy_(torch.randn(prm.shape, generator=g) * std)
        return self

    def rope_table(self) -> torch.Tensor:
        """fp32 (cos | sin) rows for every position, built once per device. Passing it to the rope
        region keeps the forward free of host round trips (needed for CUDA-graph capture); a row
        is bitwise the same as one computed on the fly for that position."""
        dev = str(self.embed.device)
        if dev not in self._rope_tables:
            self._rope_tables[dev] = rope_cache(self.cfg.max_position_embeddings, self.rope_dim(),
                                                self.cfg.rope_theta, self.embed.device)
        return self._rope_tables[dev]

    # ------------------------------------------------------------------------------ forward
    @staticmethod
    def _linear(plan: ExecutionPlan, ops: tuple[str, ...], x: torch.Tensor, weight: torch.Tensor,
                sizes: tuple[int, ...], bias: torch.Tensor | None = None) -> torch.Tensor:
        """One GEMM if the contract fuses ``ops`` into one region, else one GEMM per row slice.
        ``bias`` (rows as ``weight``'s) goes to the region's kernel, which adds it itself."""
        bound = [plan[o] for o in ops]
        if all(b is bound[0] for b in bound):
            return bound[0](x, weight) if bias is None else bound[0](x, weight, bias)
        outs, start = [], 0
        for b, n in zip(bound, sizes):
            w = weight[start:start + n]
            outs.append(b(x, w) if bias is None else b(x, w, bias[start:start + n]))
            start += n
        return torch.cat(outs, dim=-1)

    @staticmethod
    def _add_linear(plan: ExecutionPlan, op: str, residual: torch.Tensor, x: torch.Tensor,
                    weight: torch.Tensor) -> torch.Tensor:
        """``residual + plan[op](x, weight)``: the residual stream's add. A kernel that takes a
        ``residual`` does it in its epilogue (one launch fewer per call; the bits of the add:
        ``isoexec_kernels.gemm`` rounds its output first, then adds as torch does); else torch."""
        bound = plan[op]
        # a wrapped entry (the divergence locator records each region's own output) adds apart
        if isinstance(bound, Bound) and _takes(bound.fn, "residual"):
            return bound(x, weight, residual=residual)
        return residual + bound(x, weight)

    def _attention(self, plan: ExecutionPlan, layer: int, q, k, v, batch: ForwardBatch) -> torch.Tensor:
        scale = self.cfg.head_dim ** -0.5
        attn = plan["attn_core"]
        if not batch.is_engine:
            return attn(q, k, v, batch.cu_seqlens, batch.max_seqlen, scale)

        kc, vc = batch.kv.k[layer], batch.kv.v[layer]
        write_kv_pages(k, v, kc, vc, batch.slot_mapping)  # a copy: no arithmetic, part of attn_core
        if batch.case == "engine_decode":
            return attn(q, kc, vc, batch.block_table, batch.context_lens, scale)
        return attn(q, kc, vc, batch.block_table, batch.cu_seqlens_q, batch.context_lens, scale,
                    max_seqlen_q=batch.max_seqlen_q)

    #: recompute each layer's activations in the backward instead of keeping them (the trainer
    #: sets it from ``TrainConfig.activation_checkpointing``); only where autograd records
    activation_checkpointing = False

    def checkpointed(self, layer_fn, x: torch.Tensor) -> torch.Tensor:
        """``layer_fn(x)``, through ``torch.utils.checkpoint`` when activation checkpointing is on
        and autograd records (trainer_fwd). The recompute runs the same kernels on the same inputs,
        so the forward bits, and with them the gradients, are those of the run without it."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(layer_fn, x, use_reentrant=False)
        return layer_fn(x)

    def run_layer(self, L: nn.Module, layer_fn, x: torch.Tensor) -> torch.Tensor:
        """``layer_fn(x)``: decoder layer ``L`` (a module of ``self.layers``, whose tensors
        ``layer_fn`` reads) on the residual stream ``x``, through ``checkpointed``. Every family's
        layer loop calls each layer through here, so this is the one call per layer that names the
        layer's module: the FSDP2 trainer replaces it on its model with a call of the layer's FSDP2
        unit (``isoexec.dist.fsdp.shard``), which gathers L's parameters for this call and frees
        them after it; the checkpoint stays inside that call, so a recompute in the backward runs
        within the unit gathered again."""
        return self.checkpointed(layer_fn, x)

    def hidden_states(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] of the tokens ``ids`` [T] under ``batch.case``."""
        cfg, plan = self.cfg, self._plan(batch.case)
        x = plan["embed"](ids, self.embed)
        rope = self.rope_table()
        qk_pair = cfg.qk_norm and _qk_norms_in_one_call(plan)   # a property of the plan: once
        for i, L in enumerate(self.layers):
            x = self.run_layer(L, lambda x, i=i, L=L: self._layer(plan, i, L, x, batch, rope, qk_pair), x)
        return plan["final_norm"](x, self.final_norm, cfg.rms_norm_eps)

    def _layer(self, plan, i: int, L, x: torch.Tensor, batch: ForwardBatch, rope, qk_pair: bool) -> torch.Tensor:
        """Decoder layer ``i`` on the residual stream ``x``: attention, then the MLP; ``qk_pair``:
        the q and k norms as one call (:func:`_qk_norms_in_one_call`)."""
        cfg = self.cfg
        T = x.shape[0]
        nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        n = plan["attn_norm"](x, L.attn_norm, eps)
        qkv = self._linear(plan, ("q_proj", "k_proj", "v_proj"), n, L.qkv_weight,
                           (cfg.q_size, cfg.kv_size, cfg.kv_size), L.qkv_bias)
        if qk_pair:
            # q and k heads side by side: both norms in one launch, then one RoPE launch over
            # all their heads (row-wise and element-wise ops: each row's bits are the separate
            # calls' below). Splits, not slices, so that autograd joins the gradients with one
            # cat each (a slice's backward writes into a zeroed copy).
            qk, v = qkv.split((cfg.q_size + cfg.kv_size, cfg.kv_size), dim=-1)
            qk = plan["q_norm"](qk.view(T, nh + nkv, hd), L.q_norm, eps, weight2=L.k_norm, heads1=nh)
            qk = plan["rope"](qk, batch.positions, rope, theta=cfg.rope_theta)
            q, k = qk.split((nh, nkv), dim=1)
        else:
            q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
            q, k = q.reshape(T, nh, hd), k.reshape(T, nkv, hd)
            if cfg.qk_norm:
                q = plan["q_norm"](q, L.q_norm, eps)
                k = plan["k_norm"](k, L.k_norm, eps)
            q = plan["rope"](q, batch.positions, rope, theta=cfg.rope_theta)
            k = plan["rope"](k, batch.positions, rope, theta=cfg.rope_theta)
        v = v.reshape(T, nkv, hd)
        a = self._attention(plan, i, q, k, v, batch)
        x = self._add_linear(plan, "o_proj", x, a.reshape(T, cfg.q_size), L.o_weight)
        n = plan["mlp_norm"](x, L.mlp_norm, eps)
        gu = self._linear(plan, ("gate_proj", "up_proj"), n, L.gate_up_weight,
                          (cfg.intermediate_size, cfg.intermediate_size))
        g, u = gu.split((cfg.intermediate_size, cfg.intermediate_size), dim=-1)
        x = self._add_linear(plan, "down_proj", x, plan["act"](g, u), L.down_weight)
        return x

    def logits(self, hidden: torch.Tensor, case: str) -> torch.Tensor:
        return self._plan(case)["lm_head"](hidden, self.lm_head_weight)

    def logprobs_from_logits(self, logits: torch.Tensor, targets: torch.Tensor, case: str) -> torch.Tensor:
        """fp32 log-softmax of ``logits`` rows gathered at ``targets`` (the logprob region)."""
        return self._plan(case)["logprob"](logits, targets)

    def log_softmax_from_logits(self, logits: torch.Tensor, case: str) -> torch.Tensor:
        """fp32 log-softmax rows [R, V] of ``logits`` by the full-row twin of the impl the contract
        binds to the logprob region for ``case`` (``isoexec_kernels.logprob.FULL_ROWS``: the same
        rounding schedule, so row[t] is the bits ``logprobs_from_logits`` gives for target t). For
        users whose loss needs the whole distribution (KL, entropy) and for ``engine_full_vocab``."""
        from isoexec_kernels.logprob import FULL_ROWS

        impl = self._plan(case)["logprob"].record.impl_id
        if impl not in FULL_ROWS:
            raise BindingRefused(f"logprob impl {impl!r} (case {case!r}) has no full-row twin in "
                                 "isoexec_kernels.logprob.FULL_ROWS")
        return FULL_ROWS[impl](logits)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, case: str) -> torch.Tensor:
        """fp32 log p(targets[t] | row t) for hidden rows [T, H] (lm_head then the logprob region)."""
        return self.logprobs_from_logits(self.logits(hidden, case), targets, case)
