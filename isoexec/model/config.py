"""Model configuration of the unified model, read from a transformers config."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError


def hf_config_from_dict(d: dict) -> Any:
    """A transformers config object for ``d`` (by its ``model_type``)."""
    sys.modules.setdefault("fla", None)  # keep transformers off FLA's GPU kernels (GPU_ENV.md)
    from transformers import AutoConfig

    d = dict(d)
    try:
        model_type = d.pop("model_type")
    except KeyError:
        raise ConfigError("model config has no model_type") from None
    try:
        return AutoConfig.for_model(model_type, **d)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model config ({model_type}): {exc}") from None


@dataclass(frozen=True)
class DenseConfig:
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
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
