"""The dense family on a Qwen2-architecture config (q/k/v bias, no q/k norm): the bias is in the
model (the logprob match with transformers 5.17 Qwen2ForCausalLM is test_dense_vs_transformers.py's
qwen2 cases); it loads Qwen2 safetensors checkpoints (MiMo's multi-token-prediction tensors
skipped, any other unknown tensor and a missing bias refused), and refuses a qwen3 contract (and a
qwen2 contract on a qwen3 model)."""

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from hf_dense import hf_dense, ours_from_hf  # noqa: E402
from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.errors import BindingRefused  # noqa: E402
from isoexec.model import ForwardBatch, build_model, load_dense_checkpoint, load_from_hf_model  # noqa: E402
from isoexec.model.loading import CheckpointError, dense_name_map, to_hf_state_dict  # noqa: E402

TINY = load_model_config("dense_qwen2_tiny")["hf_config"]


def _hf(cfg, dtype=torch.float32):
    return hf_dense(cfg, dtype)


def _ours(hf, cfg, dtype, composition):
    return ours_from_hf(hf, cfg, dtype, composition, "dense_qwen2_tiny")


def test_a_qwen2_config_builds_a_model_with_qkv_bias_and_no_qk_norm():
    m = build_model("dense", TINY)
    assert m.cfg.qkv_bias and not m.cfg.qk_norm
    assert m.cfg.head_dim == TINY["hidden_size"] // TINY["num_attention_heads"]
    names = {n for n, _ in m.named_parameters()}
    assert "layers.0.qkv_bias" in names and not any("q_norm" in n or "k_norm" in n for n in names)
    assert m.layers[0].qkv_bias.shape == (m.cfg.q_size + 2 * m.cfg.kv_size,)


def test_the_bias_changes_the_logprobs():
    """The comparison above is not blind to the bias: without it the model is far from transformers."""
    hf = _hf(TINY)
    ours = _ours(hf, TINY, torch.float32, "isoexec")
    ids = torch.arange(20) % TINY["vocab_size"]
    batch = ForwardBatch.packed([20], "trainer_score", "cpu")
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids[None]).logits[0], -1)
        for L in ours.layers:
            L.qkv_bias.zero_()
        got = torch.log_softmax(ours.logits(ours.hidden_states(ids, batch), "trainer_score"), -1)
    assert ((got - ref).norm() / ref.norm()).item() > 1e-3


def test_qwen2_safetensors_checkpoint_loads_bit_for_bit(tmp_path):
    hf = _hf(TINY)
    hf.save_pretrained(tmp_path)   # what transformers writes for a Qwen2 model
    a = build_model("dense", TINY)
    load_dense_checkpoint(a, tmp_path)
    b = build_model("dense", TINY)
    load_from_hf_model(b, hf)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32)), n
    sd = hf.state_dict()
    q, kv = a.cfg.q_size, a.cfg.kv_size
    assert torch.equal(a.layers[1].qkv_bias[q:q + kv], sd["model.layers.1.self_attn.k_proj.bias"])
    back = to_hf_state_dict(a)   # and back under Qwen2's names
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_a_missing_bias_tensor_is_one_clear_error(tmp_path):
    sd = {k: v.contiguous() for k, v in _hf(TINY).state_dict().items()
          if k not in ("model.layers.1.self_attn.v_proj.bias", "lm_head.weight")}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) missing, first 'model.layers.1.self_attn.v_proj.bias'"):
        load_dense_checkpoint(build_model("dense", TINY), tmp_path)


def test_mimo_mtp_tensors_are_skipped_and_no_other_unknown_tensor(tmp_path):
    hf = _hf(TINY)
    hf.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    h = TINY["hidden_size"]
    mtp = {"model.mtp_layers.0.token_layernorm.weight": torch.ones(h),
           "model.mtp_layers.0.input_proj.weight": torch.zeros(h, 2 * h),
           "model.mtp_layers.0.self_attn.q_proj.bias": torch.zeros(h)}
    save_file({**sd, **mtp}, str(tmp_path / "model.safetensors"))
    m = build_model("dense", TINY)
    load_dense_checkpoint(m, tmp_path)          # a MiMo checkpoint: the MTP layer is not the model's
    assert torch.equal(m.layers[0].qkv_bias[:m.cfg.q_size], sd["model.layers.0.self_attn.q_proj.bias"])
    for extra in ("model.layers.0.self_attn.o_proj.bias", "model.mtp_head.weight"):
        save_file({**sd, extra: torch.zeros(h)}, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=f"1 tensor\\(s\\) the model does not know, first '{extra}'"):
            load_dense_checkpoint(build_model("dense", TINY), tmp_path)


def test_qwen2_name_map_has_biases_and_no_qk_norm():
    names = set(dense_name_map(build_model("dense", TINY).cfg))
    assert "model.layers.0.self_attn.q_proj.bias" in names and "model.layers.0.self_attn.o_proj.bias" not in names
    assert not any("q_norm" in n or "k_norm" in n for n in names)


def test_a_contract_of_the_other_architecture_is_refused():
    qwen2 = build_model("dense", TINY)
    with pytest.raises(BindingRefused,
                       match="region\\(s\\) for op\\(s\\) k_norm, q_norm, which this model does not run"):
        qwen2.install(build_contract("dense", "isoexec", "cpu", "dense_tiny"))
    qwen3 = build_model("dense", load_model_config("dense_tiny")["hf_config"])
    with pytest.raises(BindingRefused, match="no region for op\\(s\\) k_norm, q_norm, which this model runs"):
        qwen3.install(build_contract("dense", "isoexec", "cpu", "dense_qwen2_tiny"))
