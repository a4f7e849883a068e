"""Parameter count of a unified model, from its config alone (no weights, no model built).

Why count from the config rather than build the model and sum ``numel``: the plan runs before a
submission, on a laptop, for models of tens of billions of parameters; the counts below are the
shapes ``isoexec/model/`` gives each parameter, written once per family with the config classes'
own widths (``q_size``, ``conv_dim``, ``qk_head_dim``, ...). ``tests/plan/test_params.py`` builds
the repo's model from every config in ``configs/models/`` and checks that the sums agree, so a
change to a model's parameters that is not made here too fails there.

The parts: ``embed``; ``attention`` (each layer's token mixer: GQA projections, MLA's latent and
up projections, or a Gated DeltaNet's projections, conv taps, ``A_log`` and ``dt_bias``);
``mlp`` (dense SwiGLU MLPs); ``experts`` (routers, routed and shared experts, the shared expert's
gate); ``norms`` (every RMSNorm weight: pre-norms, q/k norms, MLA's latent norms, the GDN output
norm, the final norm); ``lm_head`` (0 when tied to the embedding); ``frozen``, the part of the
above that takes no gradient (mla_moe's fp32 router correction bias), which the optimizer does
not hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model_config import DenseConfig, HybridConfig, HybridMoeConfig, MlaMoeConfig


@dataclass(frozen=True)
class ParamCount:
    embed: int
    attention: int
    mlp: int
    experts: int
    norms: int
    lm_head: int
    frozen: int = 0

    @property
    def total(self) -> int:
        return self.embed + self.attention + self.mlp + self.experts + self.norms + self.lm_head

    @property
    def trainable(self) -> int:
        return self.total - self.frozen


def _swiglu(hidden: int, inter: int) -> int:
    """gate, up ([2I, H] fused) and down ([H, I])."""
    return 3 * inter * hidden


def count_parameters(cfg) -> ParamCount:
    """The parameters of the unified model built from ``cfg`` (a ``model_config`` family config)."""
    if not isinstance(cfg, (DenseConfig, HybridConfig, MlaMoeConfig)):
        raise TypeError(f"count_parameters: no parameter layout for {type(cfg).__name__}")
    h, V = cfg.hidden_size, cfg.vocab_size
    embed, lm_head = V * h, (0 if cfg.tie_word_embeddings else V * h)
    attention = mlp = experts = frozen = 0
    norms = h                                   # final norm
    if isinstance(cfg, DenseConfig):
        qkv = cfg.q_size + 2 * cfg.kv_size
        attention = cfg.num_layers * (qkv * h + (qkv if cfg.qkv_bias else 0) + h * cfg.q_size)
        norms += cfg.num_layers * (2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0))
        mlp = cfg.num_layers * _swiglu(h, cfg.intermediate_size)
    elif isinstance(cfg, HybridConfig):         # and HybridMoeConfig, its subclass
        hv = cfg.linear_num_value_heads
        n_attn, n_gdn = len(cfg.attention_layers), len(cfg.gdn_layers)
        # gated attention: q_proj holds [query | gate] per head, so 2 * q_size rows
        attention += n_attn * ((2 * cfg.q_size + 2 * cfg.kv_size) * h + h * cfg.q_size)
        norms += n_attn * (2 * h + 2 * cfg.head_dim)
        # GDN: in_proj = [qkv; z; b; a], the conv taps, A_log and dt_bias per value head, out_proj
        attention += n_gdn * ((cfg.conv_dim + cfg.value_dim + 2 * hv) * h + cfg.conv_dim * cfg.linear_conv_kernel_dim
                              + 2 * hv + h * cfg.value_dim)
        norms += n_gdn * (2 * h + cfg.linear_value_head_dim)
        if isinstance(cfg, HybridMoeConfig):
            E, si = cfg.num_experts, cfg.shared_expert_intermediate_size
            per_layer = E * h + E * _swiglu(h, cfg.moe_intermediate_size)
            if si:
                per_layer += _swiglu(h, si) + h            # the shared expert and its sigmoid gate [1, H]
            experts = cfg.num_layers * per_layer
        else:
            mlp = cfg.num_layers * _swiglu(h, cfg.intermediate_size)
    else:                                       # MlaMoeConfig
        nh, ql, kl = cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        attention = cfg.num_layers * ((ql + kl + cfg.qk_rope_head_dim) * h + nh * cfg.qk_head_dim * ql
                                      + nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) * kl + h * nh * cfg.v_head_dim)
        norms += cfg.num_layers * (2 * h + ql + kl)
        n_sparse = len(cfg.sparse_layers)
        mlp = (cfg.num_layers - n_sparse) * _swiglu(h, cfg.intermediate_size)
        E = cfg.n_routed_experts
        per_layer = E * h + E * _swiglu(h, cfg.moe_intermediate_size) + E   # router, experts, correction bias
        if cfg.shared_intermediate_size:
            per_layer += _swiglu(h, cfg.shared_intermediate_size)
        experts = n_sparse * per_layer
        frozen = n_sparse * E
    return ParamCount(embed=embed, attention=attention, mlp=mlp, experts=experts, norms=norms, lm_head=lm_head,
                      frozen=frozen)
