"""Model configuration of the unified model, read from a transformers config.

A leaf module (it imports only ``errors``, and transformers when a config is read), so that
``compose`` can check a model YAML before any work starts without importing the model package."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


def hf_config_from_dict(d: dict) -> Any:
    """A transformers config object for ``d`` (by its ``model_type``)."""
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


@dataclass(frozen=True)
class DenseConfig(_AttentionSizes):
    """The dense family (Qwen3 architecture): GQA attention with q/k RMSNorm, SwiGLU MLP."""

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

    @classmethod
    def from_hf(cls, cfg: Any) -> "DenseConfig":
        if isinstance(cfg, dict):
            cfg = hf_config_from_dict(cfg)
        if getattr(cfg, "model_type", None) != "qwen3":
            raise ConfigError(f"the dense family reads qwen3 configs, got {getattr(cfg, 'model_type', None)!r}")
        if getattr(cfg, "attention_bias", False):
            raise ConfigError("attention_bias=True is not supported by the dense family yet")
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
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads, num_kv_heads=nkv,
            head_dim=head_dim, rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            max_position_embeddings=cfg.max_position_embeddings,
        )

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
        if isinstance(cfg, dict):
            cfg = hf_config_from_dict(cfg)
        if getattr(cfg, "model_type", None) != "qwen3_5_text":
            raise ConfigError(f"the hybrid family reads qwen3_5_text configs, got {getattr(cfg, 'model_type', None)!r}")
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
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
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


FAMILY_CONFIGS = {"dense": DenseConfig, "hybrid": HybridConfig}
"""The config class of each model family (``from_hf`` checks a transformers config for it)."""
