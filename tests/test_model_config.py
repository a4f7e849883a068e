"""DenseConfig reads qwen3 and qwen2 transformers configs (the flags qkv_bias and qk_norm) and refuses,
naming the key, what the dense family does not implement: a sliding window, a qwen3 attention
bias (it would put one on o_proj too), a qwen2 config that denies its q/k/v bias, the unknown
model type mimo."""

import pytest

from isoexec.compose import load_model_config
from isoexec.errors import ConfigError
from isoexec.model_config import DenseConfig

QWEN2 = load_model_config("dense_qwen2_tiny")["hf_config"]
QWEN3 = load_model_config("dense_tiny")["hf_config"]


def test_qwen3_has_qk_norm_and_no_bias_qwen2_the_other_way_round():
    q3, q2 = DenseConfig.from_hf(QWEN3), DenseConfig.from_hf(QWEN2)
    assert (q3.model_type, q3.qkv_bias, q3.qk_norm, q3.absent_ops) == ("qwen3", False, True, ())
    assert (q2.model_type, q2.qkv_bias, q2.qk_norm, q2.absent_ops) == ("qwen2", True, False, ("k_norm", "q_norm"))
    assert q2.head_dim == QWEN2["hidden_size"] // QWEN2["num_attention_heads"]


def test_qwen2_legacy_rope_theta_and_attention_bias_true_are_read():
    cfg = {k: v for k, v in QWEN2.items() if k != "rope_parameters"}
    c = DenseConfig.from_hf(dict(cfg, rope_theta=640000.0, attention_bias=True))
    assert c.rope_theta == 640000.0 and c.qkv_bias


@pytest.mark.parametrize("base", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
def test_a_sliding_window_is_refused_naming_it(base):
    with pytest.raises(ConfigError, match="use_sliding_window=True is not supported by the dense family"):
        DenseConfig.from_hf(dict(base, use_sliding_window=True, sliding_window=64, max_window_layers=1))
    with pytest.raises(ConfigError, match="layer_types 'sliding_attention' are not supported"):
        DenseConfig.from_hf(dict(base, layer_types=["full_attention", "sliding_attention"]))


def test_attention_bias_refusals():
    with pytest.raises(ConfigError, match="attention_bias=True .* qwen3"):
        DenseConfig.from_hf(dict(QWEN3, attention_bias=True))
    with pytest.raises(ConfigError, match="attention_bias=False: qwen2 models always have a q/k/v bias"):
        DenseConfig.from_hf(dict(QWEN2, attention_bias=False))


def test_mimo_model_type_is_refused_with_the_way_to_load_it():
    with pytest.raises(ConfigError, match="model_type 'mimo' .* write a MiMo config as model_type qwen2"):
        DenseConfig.from_hf(dict(QWEN2, model_type="mimo"))
    with pytest.raises(ConfigError, match="the dense family reads qwen3 and qwen2 configs, got 'llama'"):
        DenseConfig.from_hf(dict(QWEN2, model_type="llama"))


def test_the_mimo_7b_model_config_has_its_dimensions():
    c = DenseConfig.from_hf(load_model_config("dense_mimo_7b")["hf_config"])
    assert (c.model_type, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size, c.tie_word_embeddings, c.rope_theta, c.rms_norm_eps, c.qkv_bias, c.qk_norm) == (
        "qwen2", 4096, 36, 32, 8, 128, 11008, 151680, False, 640000.0, 1e-5, True, False)
