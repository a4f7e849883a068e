"""Model configuration of the unified model, read from a transformers config.

A leaf module (it imports only ``errors`` and ``hf_config_store``, and transformers when a config is
built), so that ``compose`` can check a model YAML before any work starts without importing the
model package."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .hf_config_store import declared_keys, stored_config


def hf_config_from_dict(d: dict) -> Any:
    """The transformers config for ``d`` (by its ``model_type``), as its attributes: built by
    transformers once per machine and read back after that (``hf_config_store``)."""
    return stored_config(dict(d), _build_hf_config)


def _build_hf_config(d: dict) -> Any:
    sys.modules.setdefault("fla", None)  # keep transformers off FLA's GPU kernels (docs/gpu_notes.md)
    from transformers import AutoConfig

    d = dict(d)
    try:
        model_type = d.pop("model_type")
    except KeyError:
        raise ConfigError("model config has no model_type") from None
    try:
        return AutoConfig.for_model(model_type, **d)
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise several types (also
        # huggingface_hub's StrictDataclassClassValidationError wrapping a ValueError): one line
        cause = exc.__cause__ or exc
        raise ConfigError(f"model config ({model_type}): {type(cause).__name__}: "
                          f"{' '.join(str(cause).split())}") from None


class _AttentionSizes:
    """Projection widths of the (GQA) attention layers, shared by the families' configs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


DENSE_MODEL_TYPES = ("qwen3", "qwen2")
"""The transformers ``model_type`` values the dense family reads. ``qwen2`` (Qwen2ForCausalLM) is
the Qwen3 layer with a bias on the q/k/v projections and no q/k RMSNorm; MiMo-7B checkpoints
(``MiMoForCausalLM``, a Qwen2 model with multi-token-prediction layers) load as ``qwen2``, because
transformers 5.17 has no ``mimo`` model type."""

QKV_BIAS_MODEL_TYPES = ("qwen2",)
"""Model types whose q/k/v projections carry a bias (transformers builds it whatever
``attention_bias`` says); the kernel gates draw one for those regions too."""


@dataclass(frozen=True)
class DenseConfig(_AttentionSizes):
    """The dense family: GQA attention, SwiGLU MLP, RMSNorms. ``qwen3``: q/k RMSNorm per head, no
    bias (``qk_norm``). ``qwen2``: a bias on the q, k and v projections (``qkv_bias``; o_proj has
    none), no q/k norm."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, cfg: Any) -> "DenseConfig":
        raw = cfg if isinstance(cfg, dict) else {}
        if raw.get("model_type") == "mimo":
            raise ConfigError("model_type 'mimo' is not a transformers 5.17 model type: write a MiMo config as "
                              "model_type qwen2 (its multi-token-prediction weights, model.mtp_layers.*, are "
                              "skipped when a checkpoint is loaded)")
        if isinstance(cfg, dict):
            cfg = hf_config_from_dict(cfg)
        mt = getattr(cfg, "model_type", None)
        if mt not in DENSE_MODEL_TYPES:
            raise ConfigError(f"the dense family reads {' and '.join(DENSE_MODEL_TYPES)} configs, got {mt!r}")
        qkv_bias = mt in QKV_BIAS_MODEL_TYPES
        if mt == "qwen3" and getattr(cfg, "attention_bias", False):
            raise ConfigError("attention_bias=True (a bias on q/k/v and o_proj in qwen3) is not supported by the "
                              "dense family")
        if qkv_bias and not getattr(cfg, "attention_bias", True):
            raise ConfigError(f"attention_bias={cfg.attention_bias!r}: {mt} models always have a q/k/v bias "
                              "(transformers ignores attention_bias for them)")
        if getattr(cfg, "use_sliding_window", False):
            raise ConfigError(f"use_sliding_window=True is not supported by the dense family (every layer attends "
                              f"to its whole context); {mt} config")
        types = sorted({t for t in (getattr(cfg, "layer_types", None) or ()) if t != "full_attention"})
        if types:
            raise ConfigError(f"layer_types {', '.join(map(repr, types))} are not supported by the dense family "
                              "(only full_attention)")
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        nkv = cfg.num_key_value_heads or cfg.num_attention_heads
        if cfg.num_attention_heads % nkv:
            raise ConfigError(f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {nkv}")
        if cfg.hidden_act != "silu":
            raise ConfigError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        return cls(
            model_type=mt, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads, num_kv_heads=nkv,
            head_dim=head_dim, rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            max_position_embeddings=cfg.max_position_embeddings,
            qkv_bias=qkv_bias, qk_norm=mt == "qwen3",
        )

    @property
    def absent_ops(self) -> tuple[str, ...]:
        """Logical ops of the dense family this model does not run (``registry.FamilySpec.optional_ops``):
        its contract has no region for them."""
        return () if self.qk_norm else ("k_norm", "q_norm")

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep a paged KV cache (every layer of a dense model)."""
        return self.num_layers


LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridConfig(_AttentionSizes):
    """The hybrid family (Qwen3.5 text architecture, ``qwen3_5_text``): per ``layer_types``, Gated
    DeltaNet layers ("linear_attention") or gated GQA attention with zero-centred q/k norm and
    partial rotary ("full_attention"); SwiGLU MLP after both; zero-centred RMSNorms."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @classmethod
    def from_hf(cls, cfg: Any) -> "HybridConfig":
        return cls(**cls._hybrid_fields(cfg, "hybrid", "qwen3_5_text"))

    @staticmethod
    def _hybrid_fields(cfg: Any, family: str, model_type: str) -> dict:
        """The fields every Qwen3.5 text config gives (GDN and gated attention layers)."""
        if isinstance(cfg, dict):
            cfg = hf_config_from_dict(cfg)
        if getattr(cfg, "model_type", None) != model_type:
            raise ConfigError(f"the {family} family reads {model_type} configs, "
                              f"got {getattr(cfg, 'model_type', None)!r}")
        if getattr(cfg, "attention_bias", False):
            raise ConfigError("attention_bias=True is not supported by the hybrid family")
        if cfg.hidden_act != "silu":
            raise ConfigError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
        # mrope_section / mrope_interleaved only matter when the three position axes differ (images,
        # video); for text every axis carries the token position and M-RoPE is plain RoPE.
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        factor = float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * factor)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ConfigError(f"partial_rotary_factor {factor} gives rotary dim {rotary_dim} for head_dim {head_dim}: "
                              "need an even number in [2, head_dim]")
        nkv = cfg.num_key_value_heads or cfg.num_attention_heads
        if cfg.num_attention_heads % nkv:
            raise ConfigError(f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {nkv}")
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads {cfg.linear_num_value_heads} is not a multiple of "
                              f"linear_num_key_heads {cfg.linear_num_key_heads}")
        types = tuple(cfg.layer_types)
        if len(types) != cfg.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(types)} entries for {cfg.num_hidden_layers} layers")
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(f"layer type(s) {', '.join(map(repr, bad))} are not supported "
                              f"(known: {', '.join(LAYER_TYPES)})")
        if cfg.linear_conv_kernel_dim < 2:
            raise ConfigError(f"linear_conv_kernel_dim {cfg.linear_conv_kernel_dim} < 2 is not supported")
        return dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=getattr(cfg, "intermediate_size", 0) or 0,
            num_layers=cfg.num_hidden_layers, layer_types=types, num_heads=cfg.num_attention_heads,
            num_kv_heads=nkv, head_dim=head_dim, rotary_dim=rotary_dim, rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            tie_word_embeddings=bool(cfg.tie_word_embeddings), max_position_embeddings=cfg.max_position_embeddings,
            linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
            linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
            linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        )

    # attention layers
    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep a paged KV cache (the attention layers); KV cache i is the i-th of them."""
        return len(self.attention_layers)

    # Gated DeltaNet layers
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


# ------------------------------------------------------------------------------------------ mla_moe
MLP_LAYER_TYPES = ("dense", "sparse")
MLA_LATENT_NORM_EPS = 1e-6
"""transformers builds the q and kv latent RMSNorms (``q_a_layernorm``, ``kv_a_layernorm``) with
their default eps 1e-6, not ``rms_norm_eps``; so does the unified model."""

# Keys of released config.json files that transformers reads, converts or ignores although they are
# not fields of the config class (legacy rope keys, dtype, the MTP layer count, DeepSeek's training
# and parallelism settings). Where a value changes the model, only the value the model implements is
# accepted: None means any value.
_TOLERATED_KEYS: dict[str, tuple | None] = {
    "rope_theta": None, "rope_scaling": None, "partial_rotary_factor": None, "torch_dtype": None, "model_type": None,
    "num_nextn_predict_layers": None, "first_k_dense_replace": None, "auto_map": None, "head_dim": None,
    "ep_size": None, "moe_layer_freq": (1,), "aux_loss_alpha": None, "seq_aux": None,
    "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)}


def _unknown_keys(d: dict, cfg: Any) -> list[str]:
    """hf_config keys that are neither fields of ``cfg``'s class nor attribute aliases (transformers
    keeps them as loose attributes and the model would silently ignore them), and tolerated keys
    with a value the model does not implement (``key=value``)."""
    known = declared_keys(cfg)
    if known is None:
        return []
    bad = []
    for k in sorted(d):
        if k in known:
            continue
        allowed = _TOLERATED_KEYS.get(k, ())
        if allowed == () or (allowed is not None and d[k] not in allowed):
            bad.append(repr(k) if k not in _TOLERATED_KEYS else f"{k}={d[k]!r}")
    return bad


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class MlaMoeConfig:
    """The mla_moe family (transformers ``glm4_moe_lite`` and ``deepseek_v3``): multi-head latent
    attention (q and kv low-rank projections, rope and no-rope head parts) and, per
    ``mlp_layer_types`` (glm4_moe_lite) or ``first_k_dense_replace`` (deepseek_v3), a dense SwiGLU
    MLP or a mixture of experts with a sigmoid group-limited router and shared experts.

    The attention runs in the *expanded* form (isoexec_kernels/mla/): every head's key is
    [k_nope from kv_b_proj(c_kv) ; the shared rotated k_rope], its value comes from kv_b_proj, and
    q, k, v are zero-padded to ``head_dim`` = ``attn_width`` (the attention kernel's head width,
    a power of two <= 256), which is also the width of a row of the engine's KV pages
    (``num_kv_heads`` = ``num_heads`` rows per token)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    mlp_layer_types: tuple[str, ...]
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, cfg: Any) -> "MlaMoeConfig":
        raw = cfg if isinstance(cfg, dict) else None
        if isinstance(cfg, dict):
            cfg = hf_config_from_dict(cfg)
        mt = getattr(cfg, "model_type", None)
        if mt not in ("glm4_moe_lite", "deepseek_v3"):
            raise ConfigError(f"the mla_moe family reads glm4_moe_lite and deepseek_v3 configs, got {mt!r}")
        if raw is not None:
            bad = _unknown_keys(raw, cfg)
            if bad:
                raise ConfigError(f"{mt} config: unsupported key(s) {', '.join(bad)} (not fields of "
                                  f"{type(cfg).__name__}, or a value the model does not implement)")
        if getattr(cfg, "attention_bias", False):
            raise ConfigError("attention_bias=True is not supported by the mla_moe family")
        if cfg.hidden_act != "silu":
            raise ConfigError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        if cfg.q_lora_rank is None:
            raise ConfigError("q_lora_rank=None (a plain q_proj) is not supported by the mla_moe family yet")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_type {rope.get('rope_type')!r} is not supported (only 'default'; YaRN, as "
                              "DeepSeek-V3 checkpoints use, also scales the softmax and is not implemented)")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError("partial_rotary_factor != 1 is not supported by the mla_moe family")
        nh = cfg.num_attention_heads
        if (cfg.num_key_value_heads or nh) != nh:
            raise ConfigError(f"num_key_value_heads {cfg.num_key_value_heads} != num_attention_heads {nh}: MLA "
                              "expands one key and value per query head")
        if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim <= 0:
            raise ConfigError(f"qk_rope_head_dim {cfg.qk_rope_head_dim} must be a positive even number")
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        width = _pow2_at_least(max(16, qk, cfg.v_head_dim))
        if width > 256:
            raise ConfigError(f"q/k head dim {qk} and v head dim {cfg.v_head_dim} need an attention width of {width}; "
                              "the attention kernel supports up to 256")
        n_layers = cfg.num_hidden_layers
        if mt == "deepseek_v3":
            k = cfg.first_k_dense_replace or 0
            types = tuple("dense" if i < k else "sparse" for i in range(n_layers))
        else:
            types = tuple(cfg.mlp_layer_types)
            k = getattr(cfg, "first_k_dense_replace", None)
            if k is not None and types != tuple("dense" if i < k else "sparse" for i in range(len(types))):
                raise ConfigError(f"first_k_dense_replace={k} disagrees with mlp_layer_types {list(types)}: "
                                  "glm4_moe_lite reads mlp_layer_types only")
        if len(types) != n_layers:
            raise ConfigError(f"mlp_layer_types has {len(types)} entries for {n_layers} layers")
        bad_types = sorted({t for t in types if t not in MLP_LAYER_TYPES})
        if bad_types:
            raise ConfigError(f"mlp layer type(s) {', '.join(map(repr, bad_types))} are not supported "
                              f"(known: {', '.join(MLP_LAYER_TYPES)})")
        E, k_top = cfg.n_routed_experts, cfg.num_experts_per_tok
        n_group, topk_group = cfg.n_group or 1, cfg.topk_group or 1
        if "sparse" in types:
            if E < 2 or not 1 <= k_top <= E:
                raise ConfigError(f"num_experts_per_tok {k_top} must be in [1, n_routed_experts={E}]")
            if n_group < 1 or E % n_group or E // n_group < 2:
                raise ConfigError(f"n_routed_experts {E} must split into n_group={n_group} groups of >= 2 experts")
            if not 1 <= topk_group <= n_group or k_top > topk_group * (E // n_group):
                raise ConfigError(f"topk_group {topk_group} (of {n_group} groups) cannot hold num_experts_per_tok "
                                  f"{k_top} experts")
        return cls(
            model_type=mt, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
            num_layers=n_layers, mlp_layer_types=types, num_heads=nh, q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, n_routed_experts=E,
            num_experts_per_tok=k_top, n_shared_experts=cfg.n_shared_experts or 0, n_group=n_group,
            topk_group=topk_group, norm_topk_prob=bool(cfg.norm_topk_prob),
            routed_scaling_factor=float(cfg.routed_scaling_factor), rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            rope_interleave=bool(getattr(cfg, "rope_interleave", True)),
            tie_word_embeddings=bool(cfg.tie_word_embeddings), max_position_embeddings=cfg.max_position_embeddings,
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attn_width(self) -> int:
        """Head width of the attention region and of a KV page row: q/k/v zero-padded to it."""
        return _pow2_at_least(max(16, self.qk_head_dim, self.v_head_dim))

    # the engine's KV geometry (KVCache.allocate reads num_kv_heads and head_dim)
    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.attn_width

    @property
    def num_kv_layers(self) -> int:
        return self.num_layers

    @property
    def shared_intermediate_size(self) -> int:
        """The shared experts as one wider SwiGLU (transformers: moe_intermediate_size * n_shared_experts)."""
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "sparse")


# ------------------------------------------------------------------------------------------ hybrid_moe
@dataclass(frozen=True)
class HybridMoeConfig(HybridConfig):
    """The hybrid_moe family (Qwen3.5-MoE text architecture, ``qwen3_5_moe_text``): the hybrid
    family's Gated DeltaNet and gated attention layers, each followed by a mixture of experts
    (softmax router, top-k renormalised, one shared expert with a sigmoid gate) instead of the
    dense MLP. ``intermediate_size`` is 0 (no dense MLP)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int

    @classmethod
    def from_hf(cls, cfg: Any) -> "HybridMoeConfig":
        raw = cfg if isinstance(cfg, dict) else None
        if isinstance(cfg, dict):
            cfg = hf_config_from_dict(cfg)
        fields = cls._hybrid_fields(cfg, "hybrid_moe", "qwen3_5_moe_text")
        if raw is not None:
            bad = _unknown_keys(raw, cfg)
            if bad:
                raise ConfigError(f"qwen3_5_moe_text config: unsupported key(s) {', '.join(bad)} (not fields of "
                                  f"{type(cfg).__name__}, or a value the model does not implement)")
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        if E < 2 or not 1 <= k <= E:
            raise ConfigError(f"num_experts_per_tok {k} must be in [1, num_experts={E}] (num_experts >= 2)")
        if cfg.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size {cfg.moe_intermediate_size} must be positive")
        fields.update(intermediate_size=0, num_experts=E, num_experts_per_tok=k,
                      moe_intermediate_size=cfg.moe_intermediate_size,
                      shared_expert_intermediate_size=cfg.shared_expert_intermediate_size or 0)
        return cls(**fields)


FAMILY_CONFIGS = {"dense": DenseConfig, "hybrid": HybridConfig, "mla_moe": MlaMoeConfig,
                  "hybrid_moe": HybridMoeConfig}
"""The config class of each model family (``from_hf`` checks a transformers config for it)."""
