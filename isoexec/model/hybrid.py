"""The hybrid family of the unified model (Qwen3.5 text architecture, ``qwen3_5_text``).

Layers follow ``layer_types``: "linear_attention" layers are Gated DeltaNet token mixers,
"full_attention" layers are gated GQA attention (the dense attention path: varlen in the trainer,
paged KV in the engine); both are followed by the SwiGLU MLP. Every RMSNorm except the GDN output
norm is zero-centred (``x_normed * (1 + w)``). As in the dense model, each op's implementation
comes from the installed contract's plan for the case, so native vs IsoExec is one program.

Weights are stored fused where regions may fuse: attention ``qkv_weight`` = [Wq+gate; Wk; Wv]
(transformers' q_proj rows keep their per-head [query | gate] layout), GDN ``in_proj_weight`` =
[W_qkv; W_z; W_b; W_a] (ops ``gdn_in_proj`` = qkv+z and ``gdn_ba_proj`` = b+a).

Engine state: paged KV for the attention layers (KV cache i = i-th attention layer) and, per GDN
layer, a gated-delta-rule state (``GDNState``) and a conv window, indexed by the sequence's state
slot (``ForwardBatch.state_slots``); see :meth:`HybridModel.allocate_recurrent_state`.
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec_kernels.gdn_core import CHUNK, GDNState

from ..errors import BindingRefused
from ..model_config import HybridConfig
from .batch import ForwardBatch
from .dense import DenseModel


def _params(module: nn.Module, dtype, device, **shapes) -> None:
    for name, shape in shapes.items():
        setattr(module, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))


def contract_gdn_chunk(contract) -> int:
    """The gated-delta-rule chunk ``contract`` pins on its ``gdn_core`` region (the kernel's default
    when it pins none): the length of the open-chunk buffers of an engine state slot. The memory
    plan (isoexec/plan/) sizes the state with it too."""
    for e in contract.composition:
        if "gdn_core" in e.region and "CHUNK" in e.constants:
            return int(e.constants["CHUNK"])
    return CHUNK


CHUNK_FORM_IMPLS = ("gdn_cpr_chunk",)
"""``gdn_core`` impls whose engine state keeps the open chunk's queries and rows of Vn and T (CPR
version 4: ``GDNState.allocate(..., with_q=True)``)."""


def contract_gdn_chunk_form(contract) -> bool:
    """Whether ``contract`` binds its ``gdn_core`` region to a chunk-form impl (``CHUNK_FORM_IMPLS``),
    whose state slots need the open chunk's queries and rows of Vn and T besides the version-3 buffers."""
    return any("gdn_core" in e.region and e.impl.id in CHUNK_FORM_IMPLS for e in contract.composition)


class GatedAttentionLayer(nn.Module):
    kind = "full_attention"

    def __init__(self, cfg: HybridConfig, dtype, device):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        _params(self, dtype, device, attn_norm=(h,), qkv_weight=(2 * cfg.q_size + 2 * cfg.kv_size, h),
                q_norm=(hd,), k_norm=(hd,), o_weight=(h, cfg.q_size), mlp_norm=(h,),
                gate_up_weight=(2 * cfg.intermediate_size, h), down_weight=(h, cfg.intermediate_size))


class GatedDeltaNetLayer(nn.Module):
    kind = "linear_attention"

    def __init__(self, cfg: HybridConfig, dtype, device):
        super().__init__()
        h, hv = cfg.hidden_size, cfg.linear_num_value_heads
        _params(self, dtype, device, attn_norm=(h,), in_proj_weight=(cfg.conv_dim + cfg.value_dim + 2 * hv, h),
                conv_weight=(cfg.conv_dim, cfg.linear_conv_kernel_dim), A_log=(hv,), dt_bias=(hv,),
                out_norm=(cfg.linear_value_head_dim,), out_weight=(h, cfg.value_dim), mlp_norm=(h,),
                gate_up_weight=(2 * cfg.intermediate_size, h), down_weight=(h, cfg.intermediate_size))


class HybridModel(DenseModel):
    """Same public interface as :class:`DenseModel` (install, init_random, hidden_states, logits,
    token_logprobs, logprobs_from_logits, rope_table, lm_head_weight)."""

    family = "hybrid"

    @staticmethod
    def layer_classes() -> dict:
        """The layer class of each ``layer_types`` entry (the MoE variant overrides it)."""
        return {"full_attention": GatedAttentionLayer, "linear_attention": GatedDeltaNetLayer}

    def make_layers(self, cfg: HybridConfig, dtype, device) -> list[nn.Module]:
        layer_cls = self.layer_classes()
        return [layer_cls[t](cfg, dtype, device) for t in cfg.layer_types]

    def rope_dim(self) -> int:
        """The first ``rotary_dim`` channels (partial rotary)."""
        return self.cfg.rotary_dim

    # ------------------------------------------------------------------------------ tensor parallelism
    def linear_k(self) -> dict[str, int]:
        """{linear op: its K}: the dense ops' (o_proj reads the gated attention's q_size) and the
        Gated DeltaNet projections'."""
        h = self.cfg.hidden_size
        return {**super().linear_k(), "gdn_in_proj": h, "gdn_ba_proj": h, "gdn_out_proj": self.cfg.value_dim}

    def tp_head_problems(self, tp: int) -> list[str]:
        """The attention heads' problems and the Gated DeltaNet heads': a rank holds whole key heads
        with their groups of value heads (``TensorParallelHybrid``), so tp must divide the key heads
        (and with them the value heads, a multiple of them)."""
        cfg = self.cfg
        out = super().tp_head_problems(tp)
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if hk % tp or hv % tp:
            out.append(f"tp={tp} does not divide the {hk} Gated DeltaNet key heads and {hv} value heads (each "
                       "rank holds whole key heads with their value heads)")
        return out

    def tp_row_parallel(self) -> dict[str, tuple[int, int | None]]:
        """o_proj, down_proj and the Gated DeltaNet out_proj, whose K columns are the value heads."""
        cfg = self.cfg
        return {**super().tp_row_parallel(), "gdn_out_proj": (cfg.value_dim, cfg.linear_num_value_heads)}

    def tp_impls(self) -> dict[str, tuple[str | tuple[str, ...], str | None]]:
        """The linear and logprob kernels of the dense model, and the Gated DeltaNet regions whose
        per-head (per-channel) schedule the tensor-parallel layers rely on (tp_hybrid.py says why
        each holds): the short conv, the prep, the CPR core (version 4 or 3) and the gated norm."""
        return {**super().tp_impls(), "gdn_conv": ("conv_fixed_taps", None), "gdn_prep": ("gdn_prep_fp32", None),
                "gdn_core": (("gdn_cpr_chunk", "gdn_cpr"), None), "gdn_out_norm": ("gated_rmsnorm_fixed", None)}

    # ------------------------------------------------------------------------------ init
    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> "HybridModel":
        """Random weights with the shapes' roles respected: zero-centred norm weights near 0, the
        gated norm near 1, A_log = log(U(1, 16)), dt_bias near 1, conv taps ~ N(0, 0.2^2)."""
        g = torch.Generator().manual_seed(seed)
        for name, prm in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "out_norm":
                v = 1.0 + 0.05 * torch.randn(prm.shape, generator=g)
            elif leaf == "A_log":
                v = torch.log(1.0 + 15.0 * torch.rand(prm.shape, generator=g))
            elif leaf == "dt_bias":
                v = 1.0 + 0.1 * torch.randn(prm.shape, generator=g)
            elif leaf == "conv_weight":
                v = 0.2 * torch.randn(prm.shape, generator=g)
            elif prm.dim() == 1:  # zero-centred RMSNorm weights
                v = 0.05 * torch.randn(prm.shape, generator=g)
            else:
                v = torch.randn(prm.shape, generator=g) * std
            prm.copy_(v)
        return self

    # ------------------------------------------------------------------------------ engine state
    def _chunk(self) -> int:
        """The gated-delta-rule chunk pinned by the installed contract (its state layout)."""
        if self.contract is None:
            raise BindingRefused("no contract installed; call model.install(contract) before allocating state")
        return contract_gdn_chunk(self.contract)

    def allocate_recurrent_state(self, num_slots: int, device=None) -> tuple[list, list[torch.Tensor]]:
        """(gdn_states, conv_states) for ``num_slots`` sequences: one GDNState ([S, Hv, Dk, Dv] fp32
        plus its partial-chunk buffers, with the queries and rows of Vn and T for a chunk-form core) and one
        conv window [S, conv_dim, W-1] (model dtype) per GDN layer, all zero."""
        cfg = self.cfg
        device = device or self.embed.device
        chunk = self._chunk()
        with_q = contract_gdn_chunk_form(self.contract)
        # v arrives in the model dtype (the conv's output); a chunk-form state keeps it so
        gdn = [GDNState.allocate(num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim, device, chunk=chunk, with_q=with_q,
                                 value_dtype=self.embed.dtype) for _ in cfg.gdn_layers]
        conv = [torch.zeros((num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), dtype=self.embed.dtype,
                            device=device) for _ in cfg.gdn_layers]
        return gdn, conv

    @staticmethod
    def reset_recurrent_state(gdn_states: list, conv_states: list[torch.Tensor], slots: torch.Tensor) -> None:
        """Zero the recurrent state of ``slots`` (a sequence newly given a slot, or recomputed
        after preemption)."""
        idx = torch.as_tensor(slots, dtype=torch.long, device=conv_states[0].device if conv_states else None)
        for st in gdn_states:
            st.reset_(idx)
        for c in conv_states:
            c[idx] = 0

    # ------------------------------------------------------------------------------ forward
    def _gated_attention(self, plan, kv_layer: int, L: GatedAttentionLayer, n, batch: ForwardBatch, rope):
        cfg = self.cfg
        qkv = self._linear(plan, ("q_proj", "k_proj", "v_proj"), n, L.qkv_weight,
                           (2 * cfg.q_size, cfg.kv_size, cfg.kv_size))
        a = self._gated_attention_heads(plan, kv_layer, L, qkv, cfg.num_heads, cfg.num_kv_heads, batch, rope)
        return plan["o_proj"](a, L.o_weight)

    def _gated_attention_heads(self, plan, kv_layer: int, L, qkv, nh: int, nkv: int, batch: ForwardBatch, rope):
        """The gated attention of ``nh`` query and ``nkv`` kv heads from their projections ``qkv``
        [T, nh * 2 * head_dim + 2 * nkv * head_dim] (each query head's [query | gate], then k, v):
        the gated outputs [T, nh * head_dim] before o_proj. Per-head arithmetic only, so the
        tensor-parallel model (tp_hybrid.py) runs it on a rank's heads."""
        cfg = self.cfg
        T = qkv.shape[0]
        hd, eps = cfg.head_dim, cfg.rms_norm_eps
        qg, k, v = qkv.split((nh * 2 * hd, nkv * hd, nkv * hd), dim=-1)
        qg = qg.reshape(T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
        q = plan["q_norm"](q, L.q_norm, eps, zero_centred=True)
        k = plan["k_norm"](k.reshape(T, nkv, hd), L.k_norm, eps, zero_centred=True)
        q = plan["rope"](q, batch.positions, rope, theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim)
        k = plan["rope"](k, batch.positions, rope, theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim)
        a = self._attention(plan, kv_layer, q, k, v.reshape(T, nkv, hd), batch)
        return plan["attn_gate"](a.reshape(T, nh * hd), gate)

    def _gated_deltanet(self, plan, gdn_layer: int, L: GatedDeltaNetLayer, n, batch: ForwardBatch):
        cfg = self.cfg
        hv = cfg.linear_num_value_heads
        proj = self._linear(plan, ("gdn_in_proj", "gdn_ba_proj"), n, L.in_proj_weight,
                            (cfg.conv_dim + cfg.value_dim, 2 * hv))
        o = self._gated_deltanet_heads(plan, gdn_layer, L, proj, cfg.linear_num_key_heads, hv, batch)
        return plan["gdn_out_proj"](o, L.out_weight)

    def _gated_deltanet_heads(self, plan, gdn_layer: int, L, proj, hk: int, hv: int, batch: ForwardBatch):
        """The Gated DeltaNet mixer of ``hk`` key heads and their ``hv`` value heads from their
        projections ``proj`` [T, (2 hk Dk + hv Dv) + hv Dv + 2 hv] (the conv channels q, k, v, then
        z, b, a): the normed, gated outputs [T, hv * Dv] before out_proj. The conv is per channel,
        the rest per head (tp_hybrid.py says why), so the tensor-parallel model runs it on a rank's
        heads; ``L`` holds the matching conv taps, A_log and dt_bias."""
        cfg = self.cfg
        T = proj.shape[0]
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv, z, b, a = proj.split((2 * hk * dk + hv * dv, hv * dv, hv, hv), dim=-1)
        conv, core = plan["gdn_conv"], plan["gdn_core"]
        if not batch.is_engine:
            qkv = conv(qkv, L.conv_weight, batch.cu_seqlens)
        else:
            if batch.state_slots is None or batch.gdn_states is None or batch.conv_states is None:
                raise BindingRefused("engine batch for a hybrid model needs state_slots, gdn_states and conv_states "
                                     "(see HybridModel.allocate_recurrent_state)")
            if batch.case == "engine_decode":
                qkv = conv(qkv, L.conv_weight, batch.state_slots, batch.conv_states[gdn_layer])
            else:
                qkv = conv(qkv, L.conv_weight, batch.cu_seqlens_q, batch.state_slots, batch.conv_states[gdn_layer])
        q, k, v = qkv.split((hk * dk, hk * dk, hv * dv), dim=-1)
        q, k, g, beta = plan["gdn_prep"](q.reshape(T, hk, dk), k.reshape(T, hk, dk), a, b, L.A_log, L.dt_bias)
        v = v.reshape(T, hv, dv)
        if not batch.is_engine:
            o = core(q, k, v, g, beta, batch.cu_seqlens)
        elif batch.case == "engine_decode":
            o = core(q, k, v, g, beta, batch.state_slots, batch.gdn_states[gdn_layer])
        else:
            o = core(q, k, v, g, beta, batch.cu_seqlens_q, batch.state_slots, batch.gdn_states[gdn_layer],
                     host=batch.gdn_host)
        # the core's fp32 output is rounded to the model dtype before the norm, as transformers does
        o = plan["gdn_out_norm"](o.to(proj.dtype), z.reshape(T, hv, dv), L.out_norm, cfg.rms_norm_eps)
        return o.reshape(T, hv * dv)

    def hidden_states(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] of the tokens ``ids`` [T] under ``batch.case``."""
        cfg, plan = self.cfg, self._plan(batch.case)
        eps = cfg.rms_norm_eps
        x = plan["embed"](ids, self.embed)
        rope = self.rope_table()
        kv_layer = gdn_layer = 0
        for L in self.layers:
            # j: the layer's index among the attention (KV cache) or the Gated DeltaNet (state) layers
            j = kv_layer if L.kind == "full_attention" else gdn_layer
            x = self.run_layer(L, lambda x, L=L, j=j: self._layer(plan, L, j, x, batch, rope), x)
            kv_layer, gdn_layer = kv_layer + (L.kind == "full_attention"), gdn_layer + (L.kind != "full_attention")
        return plan["final_norm"](x, self.final_norm, eps, zero_centred=True)

    def _layer(self, plan, L, j: int, x: torch.Tensor, batch: ForwardBatch, rope) -> torch.Tensor:
        """One layer on the residual stream ``x``: its mixer (gated attention or Gated DeltaNet,
        ``j`` its index among the layers of its kind), then the MLP (or the MoE)."""
        eps = self.cfg.rms_norm_eps
        n = plan["attn_norm"](x, L.attn_norm, eps, zero_centred=True)
        if L.kind == "full_attention":
            x = x + self._gated_attention(plan, j, L, n, batch, rope)
        else:
            x = x + self._gated_deltanet(plan, j, L, n, batch)
        return x + self._mlp(plan, L, plan["mlp_norm"](x, L.mlp_norm, eps, zero_centred=True))

    def _mlp(self, plan, L, n: torch.Tensor) -> torch.Tensor:
        """The layer's SwiGLU MLP on its normed input ``n`` (the MoE variant overrides it)."""
        inter = self.cfg.intermediate_size
        gu = self._linear(plan, ("gate_proj", "up_proj"), n, L.gate_up_weight, (inter, inter))
        g, u = gu.split((inter, inter), dim=-1)
        return plan["down_proj"](plan["act"](g, u), L.down_weight)
