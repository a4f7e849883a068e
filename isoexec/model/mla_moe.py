"""The mla_moe family of the unified model (transformers ``glm4_moe_lite``, also ``deepseek_v3``).

Every layer: RMSNorm, multi-head latent attention (MLA), residual, RMSNorm, then per
``mlp_layer_types`` (``first_k_dense_replace`` for deepseek_v3) a dense SwiGLU MLP or a mixture
of experts, residual. As in the other families each op's implementation comes from the installed
contract's plan for the case, so native vs IsoExec is one program.

MLA runs in the expanded form in every case (``isoexec_kernels/mla/api.py`` has the schedule and
the argument): latent projections, latent RMSNorms (eps 1e-6, as transformers builds them), the
kv up-projection, RoPE on the rope parts, per-head q/k/v expanded and zero-padded to
``cfg.attn_width``, the batch-invariant attention, o_proj. The engine caches the padded expanded K
and V rows in its pages (``KVCache`` [pages, page_size, num_heads, attn_width]).

The MoE layer runs as regions (``isoexec_kernels/moe/regions.py``): ``router`` (sigmoid scores plus
the correction bias for selection, group-limited top-k, ties to the lower group and expert index,
weights = unbiased scores normalised and times ``routed_scaling_factor``), ``dispatch``
(expert-major, token-ascending), ``experts`` (per-expert SwiGLU), the shared experts through the
``shared_*`` linear and activation regions, and ``combine`` (fp32, ascending expert index, shared
expert last, one rounding). Under expert parallelism (``ExpertParallelMoe``, isoexec/model/ep_moe.py)
the model's ``moe_ep`` names the ep group and the layer holds only its rank's experts; ``moe_layer``
then sends the rows to their experts' owners and back (``isoexec.dist.expert_parallel_moe``), the
same regions on the same rows, so the same bits.

Weights are stored fused where regions may fuse: ``qkv_a_weight`` = [W_q_a; W_kv_a] (ops
``q_a_proj`` + ``kv_a_proj``), ``gate_up_weight`` = [W_gate; W_up] for dense MLPs and
``shared_gate_up`` likewise for the shared experts; routed experts keep transformers' stacked
layout (``experts_gate_up`` [E, 2I, H], ``experts_down`` [E, H, I]). The correction bias is an
fp32 parameter that takes no gradient (transformers keeps it fp32 and outside training).
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec_kernels.mla import expand_qkv, write_mla_kv_pages
from isoexec_kernels.moe import RouterSpec

from ..dist.expert_parallel import ExpertParallelGroup, expert_parallel_moe
from ..model_config import MLA_LATENT_NORM_EPS, MlaMoeConfig
from .batch import ForwardBatch
from .dense import DenseModel


def _params(module: nn.Module, dtype, device, **shapes) -> None:
    for name, shape in shapes.items():
        setattr(module, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))


#: the MoE regions' impls whose arithmetic the expert-parallel exchange reproduces (ep_moe.py, and
#: tp_moe.py, which deals rows out the same way): a router and dispatch that see a token's row
#: alone, an experts region whose output row depends on its input row and the weights only (on CPU
#: the per-expert loop of the invariant GEMM), the fixed-order combine
EP_REGION_IMPLS = {"router": "moe_router_fp32", "dispatch": "moe_dispatch_stable", "experts": "moe_experts_loop",
                   "combine": "moe_combine_fp32"}


def moe_tp_impls() -> dict[str, tuple[str, str | None]]:
    """The MoE regions whose rows the tensor-parallel MoE layer (isoexec/model/tp_moe.py) deals out
    over the group, as expert parallelism does: the same kernels ``ExpertParallelMoe`` requires."""
    return {o: (impl, None) for o, impl in EP_REGION_IMPLS.items()}


def moe_tp_expert_problems(num_experts: int, tp: int) -> list[str]:
    """At tp > 1 each rank owns whole routed experts (``expert_shard_range``): tp must not exceed E."""
    if tp > num_experts:
        return [f"tp={tp} is more than the {num_experts} routed expert(s) of each MoE layer; every rank must own "
                "at least one whole expert"]
    return []


def _shared_rows(plan, L: nn.Module, n: torch.Tensor, shared_size: int) -> torch.Tensor | None:
    """The shared expert's rows on ``n`` (None without one), through its linear and activation regions."""
    if not shared_size:
        return None
    gu = DenseModel._linear(plan, ("shared_gate_proj", "shared_up_proj"), n, L.shared_gate_up,
                            (shared_size, shared_size))
    g, u = gu.split((shared_size, shared_size), dim=-1)
    return plan["shared_down_proj"](plan["shared_act"](g, u), L.shared_down)


def moe_layer(plan, L: nn.Module, n: torch.Tensor, spec, num_experts: int, shared_size: int,
              ep: ExpertParallelGroup | None = None) -> torch.Tensor:
    """One MoE layer through the contract's regions (router, dispatch, experts, the shared expert's
    linear and activation regions, combine). ``L`` holds ``router_weight``, ``experts_gate_up``,
    ``experts_down`` and, when present, ``correction_bias`` (group routers), ``shared_gate_up`` /
    ``shared_down`` (the shared expert, ``shared_size`` wide) and ``shared_gate`` (its Qwen-style
    sigmoid gate, computed by the router region).

    ``ep``: None, every expert here (``L`` holds all E). Otherwise the expert-parallel group: ``L``
    holds only this rank's experts ``expert_shard_range(E, ep, rank)`` and the routed rows travel
    to their owners and back (``expert_parallel_moe``: the same regions on the same rows, nothing
    added across ranks, so the bits of the line below for these tokens)."""
    if ep is not None:
        return expert_parallel_moe(n, plan, spec, num_experts=num_experts, router_weight=L.router_weight,
                                   gate_up=L.experts_gate_up, down=L.experts_down,
                                   correction_bias=getattr(L, "correction_bias", None),
                                   shared_gate=getattr(L, "shared_gate", None),
                                   shared=_shared_rows(plan, L, n, shared_size), group=ep.group)
    routing = plan["router"](n, L.router_weight, spec, getattr(L, "correction_bias", None),
                             getattr(L, "shared_gate", None))
    disp = plan["dispatch"](routing.ids, num_experts)
    rows = plan["experts"](n, disp, L.experts_gate_up, L.experts_down)
    shared = _shared_rows(plan, L, n, shared_size)
    return plan["combine"](rows, disp, routing, shared, out_dtype=n.dtype)


class MlaLayer(nn.Module):
    def __init__(self, cfg: MlaMoeConfig, kind: str, dtype, device):
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_heads
        self.kind = kind
        _params(self, dtype, device, attn_norm=(h,),
                qkv_a_weight=(cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
                q_a_norm=(cfg.q_lora_rank,), q_b_weight=(nh * cfg.qk_head_dim, cfg.q_lora_rank),
                kv_a_norm=(cfg.kv_lora_rank,), kv_b_weight=(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                                            cfg.kv_lora_rank),
                o_weight=(h, nh * cfg.v_head_dim), mlp_norm=(h,))
        if kind == "dense":
            _params(self, dtype, device, gate_up_weight=(2 * cfg.intermediate_size, h),
                    down_weight=(h, cfg.intermediate_size))
        else:
            E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
            _params(self, dtype, device, router_weight=(E, h), experts_gate_up=(E, 2 * inter, h),
                    experts_down=(E, h, inter))
            self.correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32, device=device),
                                                requires_grad=False)
            if cfg.shared_intermediate_size:
                _params(self, dtype, device, shared_gate_up=(2 * cfg.shared_intermediate_size, h),
                        shared_down=(h, cfg.shared_intermediate_size))


class MlaMoeModel(DenseModel):
    """Same public interface as :class:`DenseModel` (install, init_random, hidden_states, logits,
    token_logprobs, logprobs_from_logits, rope_table, lm_head_weight)."""

    family = "mla_moe"
    #: the expert-parallel group of the MoE layers; None: every expert in this process (ep_moe.py sets it)
    moe_ep: ExpertParallelGroup | None = None

    def __init__(self, cfg: MlaMoeConfig, dtype=torch.float32, device="cpu"):
        super().__init__(cfg, dtype, device)
        self.router_spec = RouterSpec(kind="sigmoid_group_topk", top_k=cfg.num_experts_per_tok,
                                      norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group,
                                      topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor)

    # ------------------------------------------------------------------------------ tensor parallelism
    def linear_k(self) -> dict[str, int]:
        """{linear op: its K}: MLA's projections (o_proj reads the heads' values), the dense MLP's,
        the shared expert's and the lm_head."""
        cfg = self.cfg
        h = cfg.hidden_size
        return {"q_a_proj": h, "kv_a_proj": h, "q_b_proj": cfg.q_lora_rank, "kv_b_proj": cfg.kv_lora_rank,
                "o_proj": cfg.num_heads * cfg.v_head_dim, "gate_proj": h, "up_proj": h,
                "down_proj": cfg.intermediate_size, "shared_gate_proj": h, "shared_up_proj": h,
                "shared_down_proj": cfg.shared_intermediate_size, "lm_head": h}

    def tp_head_problems(self, tp: int) -> list[str]:
        """Whole query heads per rank (MLA has as many kv heads) and whole routed experts."""
        return super().tp_head_problems(tp) + moe_tp_expert_problems(self.cfg.n_routed_experts, tp)

    def tp_row_parallel(self) -> dict[str, tuple[int, int | None]]:
        """o_proj, whose K columns are the heads' values, and the dense MLP's down_proj."""
        cfg = self.cfg
        return {"o_proj": (cfg.num_heads * cfg.v_head_dim, cfg.num_heads), "down_proj": (cfg.intermediate_size, None)}

    def tp_impls(self) -> dict[str, tuple[str | tuple[str, ...], str | None]]:
        """The linear and logprob kernels of the dense model, the expanded MLA attention (per head:
        each head zero-padded and run through the fixed-walk attention alone) and the MoE regions."""
        return {**super().tp_impls(), "attn_core": ("mla_expanded_walk", None), **moe_tp_impls()}

    # ------------------------------------------------------------------------------ init
    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> "MlaMoeModel":
        """Random weights: norm weights near 1, the correction bias ~ N(0, 0.01^2) (so that selection
        and weights really use different scores), matrices ~ N(0, std^2)."""
        g = torch.Generator().manual_seed(seed)
        for name, prm in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "correction_bias":
                v = 0.01 * torch.randn(prm.shape, generator=g)
            elif prm.dim() == 1:
                v = 1.0 + 0.05 * torch.randn(prm.shape, generator=g)
            else:
                v = torch.randn(prm.shape, generator=g) * std
            prm.copy_(v)
        return self

    def make_layers(self, cfg: MlaMoeConfig, dtype, device) -> list[nn.Module]:
        return [MlaLayer(cfg, t, dtype, device) for t in cfg.mlp_layer_types]

    def rope_dim(self) -> int:
        """The ``qk_rope_head_dim`` rope channels."""
        return self.cfg.qk_rope_head_dim

    # ------------------------------------------------------------------------------ forward
    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' interleaved rope pairs (x0, x1), (x2, x3)... de-interleaved to
        (x0, x2, ..., x1, x3, ...): a permutation (view, transpose, copy), after which the neox
        rotate-half rotation equals transformers' interleaved rotation, output layout included."""
        if not self.cfg.rope_interleave:
            return x.contiguous()
        d = x.shape[-1]
        return x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).reshape(*x.shape[:-1], d)

    def _mla(self, plan, layer: int, L: MlaLayer, n: torch.Tensor, batch: ForwardBatch, rope) -> torch.Tensor:
        cfg = self.cfg
        T = n.shape[0]
        nh, nope, rd, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qr, kvr = cfg.q_lora_rank, cfg.kv_lora_rank
        a = self._linear(plan, ("q_a_proj", "kv_a_proj"), n, L.qkv_a_weight, (qr, kvr + rd))
        qa, ckv, k_rope = a.split((qr, kvr, rd), dim=-1)
        q = plan["q_b_proj"](plan["q_a_norm"](qa, L.q_a_norm, MLA_LATENT_NORM_EPS), L.q_b_weight)
        kv = plan["kv_b_proj"](plan["kv_a_norm"](ckv, L.kv_a_norm, MLA_LATENT_NORM_EPS), L.kv_b_weight)
        q_nope, q_rope = q.reshape(T, nh, nope + rd).split((nope, rd), dim=-1)
        q_rope = plan["rope"](self._rope_layout(q_rope), batch.positions, rope, theta=cfg.rope_theta)
        k_rope = plan["rope"](self._rope_layout(k_rope.reshape(T, 1, rd)), batch.positions, rope,
                              theta=cfg.rope_theta)
        q, k, v = expand_qkv(q_nope, q_rope, kv.reshape(T, nh, nope + dv), k_rope, nope, dv)
        o = self._mla_attention(plan, layer, q, k, v, batch)
        return plan["o_proj"](o.reshape(T, nh * dv), L.o_weight)

    def _mla_attention(self, plan, layer: int, q, k, v, batch: ForwardBatch) -> torch.Tensor:
        scale = self.cfg.qk_head_dim ** -0.5
        attn = plan["attn_core"]
        if not batch.is_engine:
            return attn(q, k, v, batch.cu_seqlens, batch.max_seqlen, scale)
        kc, vc = batch.kv.k[layer], batch.kv.v[layer]
        write_mla_kv_pages(k, v, kc, vc, batch.slot_mapping)  # pad + copy: no arithmetic, part of attn_core
        dv = self.cfg.v_head_dim
        if batch.case == "engine_decode":
            return attn(q, kc, vc, batch.block_table, batch.context_lens, scale, v_dim=dv)
        return attn(q, kc, vc, batch.block_table, batch.cu_seqlens_q, batch.context_lens, scale,
                    max_seqlen_q=batch.max_seqlen_q, v_dim=dv)

    def _dense_mlp(self, plan, L: MlaLayer, n: torch.Tensor) -> torch.Tensor:
        inter = self.cfg.intermediate_size
        gu = self._linear(plan, ("gate_proj", "up_proj"), n, L.gate_up_weight, (inter, inter))
        g, u = gu.split((inter, inter), dim=-1)
        return plan["down_proj"](plan["act"](g, u), L.down_weight)

    def _moe(self, plan, L: MlaLayer, n: torch.Tensor) -> torch.Tensor:
        return moe_layer(plan, L, n, self.router_spec, self.cfg.n_routed_experts, self.cfg.shared_intermediate_size,
                         self.moe_ep)

    def hidden_states(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] of the tokens ``ids`` [T] under ``batch.case``."""
        cfg, plan = self.cfg, self._plan(batch.case)
        eps = cfg.rms_norm_eps
        x = plan["embed"](ids, self.embed)
        rope = self.rope_table()
        for i, L in enumerate(self.layers):
            x = self.run_layer(L, lambda x, i=i, L=L: self._layer(plan, i, L, x, batch, rope), x)
        return plan["final_norm"](x, self.final_norm, eps)

    def _layer(self, plan, i: int, L, x: torch.Tensor, batch: ForwardBatch, rope) -> torch.Tensor:
        """Layer ``i`` on the residual stream ``x``: MLA, then the dense MLP or the MoE."""
        eps = self.cfg.rms_norm_eps
        x = x + self._mla(plan, i, L, plan["attn_norm"](x, L.attn_norm, eps), batch, rope)
        n = plan["mlp_norm"](x, L.mlp_norm, eps)
        return x + (self._dense_mlp(plan, L, n) if L.kind == "dense" else self._moe(plan, L, n))
