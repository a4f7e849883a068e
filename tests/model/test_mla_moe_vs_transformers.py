"""The unified mla_moe model matches transformers 5.17 (Glm4MoeLiteForCausalLM, DeepseekV3ForCausalLM)
on the same weights, loads their checkpoints (per-expert tensors, MTP layers skipped), refuses bad
configs in one line, and gives the same bits in every case under the IsoExec composition."""

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeLiteConfig,  # noqa: E402
                          Glm4MoeLiteForCausalLM)

from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.errors import ConfigError  # noqa: E402
from isoexec.model import ForwardBatch, KVCache, build_model, load_checkpoint, load_from_hf_model  # noqa: E402
from isoexec.model.loading import CheckpointError, to_hf_state_dict  # noqa: E402
from isoexec.model_config import MlaMoeConfig  # noqa: E402

TINY = load_model_config("mla_moe_tiny")["hf_config"]
# DeepSeek-V3 style: first_k_dense_replace, 4 groups of 2 experts with 2 kept, top-3, 2 shared experts,
# q/k head 24 (padded to 32 with v 16), tied embeddings
DSV3 = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
            num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
            num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True)
HF = {"glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM),
      "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM)}


def _hf(cfg, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg_cls, model_cls = HF[cfg["model_type"]]
    m = model_cls(cfg_cls(**{k: v for k, v in cfg.items() if k != "model_type"})).to(dtype).eval()
    with torch.no_grad():   # non-trivial norms and correction bias (a skipped norm or bias would show)
        for n, p in m.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.02 * torch.randn_like(b))
    return m


def _ours(hf, cfg, composition="isoexec", dtype=torch.float32):
    m = build_model("mla_moe", cfg, dtype=dtype)
    load_from_hf_model(m, hf)
    m.install(build_contract("mla_moe", composition, "cpu"))
    return m


def _seqs(lens, vocab, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _bits(t):
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _logprobs(hf, ours, seqs):
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        ref = torch.cat([torch.log_softmax(hf(s[None]).logits[0].float(), -1) for s in seqs])
        batch = ForwardBatch.packed(lens, "trainer_score", "cpu")
        got = torch.log_softmax(ours.logits(ours.hidden_states(torch.cat(seqs), batch), "trainer_score").float(), -1)
    return got, ref


@pytest.mark.parametrize("composition", ["isoexec", "native"])
def test_glm4_moe_lite_logprobs_match_transformers_fp32(composition):
    hf = _hf(TINY)
    got, ref = _logprobs(hf, _ours(hf, TINY, composition), _seqs([70, 9], TINY["vocab_size"]))
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_logprobs_match_transformers_fp32(interleave):
    """first_k_dense_replace, several groups, q/k padding, and both rope layouts."""
    cfg = dict(DSV3, rope_interleave=interleave)
    hf = _hf(cfg)
    ours = _ours(hf, cfg)
    assert ours.cfg.mlp_layer_types == ("dense", "sparse", "sparse") and ours.cfg.attn_width == 32
    got, ref = _logprobs(hf, ours, _seqs([40, 17], cfg["vocab_size"]))
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_glm4_moe_lite_logprobs_match_transformers_bf16():
    hf = _hf(TINY, torch.bfloat16)
    got, ref = _logprobs(hf, _ours(hf, TINY, dtype=torch.bfloat16), _seqs([40, 17], TINY["vocab_size"]))
    assert ((got - ref).norm() / ref.norm()).item() < 3e-2


def test_trainer_and_engine_cases_give_the_same_bits():
    """trainer_fwd (autograd) == trainer_score == paged prefill in two chunks + decode, on W-wide pages."""
    hf = _hf(TINY)
    m = _ours(hf, TINY)
    seq = _seqs([37], TINY["vocab_size"])[0]
    score = m.hidden_states(seq, ForwardBatch.packed([37], "trainer_score", "cpu"))
    fwd = m.hidden_states(seq, ForwardBatch.packed([37], "trainer_fwd", "cpu"))
    cfg = m.cfg
    kv = KVCache.allocate(cfg.num_kv_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    assert kv.k[0].shape == (4, 16, cfg.num_heads, cfg.attn_width)
    table = [[2, 0, 3]]
    with torch.no_grad():
        rows = [m.hidden_states(seq[:20], ForwardBatch.paged("engine_prefill", kv, table, [0], [20], "cpu")),
                m.hidden_states(seq[20:36], ForwardBatch.paged("engine_prefill", kv, table, [20], [16], "cpu")),
                m.hidden_states(seq[36:], ForwardBatch.paged("engine_decode", kv, table, [36], [1], "cpu"))]
    engine = torch.cat(rows)
    assert int((_bits(fwd) != _bits(score)).sum()) == 0
    assert int((_bits(engine) != _bits(score)).sum()) == 0


# ------------------------------------------------------------------------------ checkpoints
def test_safetensors_checkpoint_round_trip(tmp_path):
    """save_pretrained writes per-expert tensors (experts.{e}.gate_proj...), sharded here; they load
    into the stacked layout, and the exported state dict loads back into transformers strictly."""
    hf = _hf(TINY)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    a, b = build_model("mla_moe", TINY), build_model("mla_moe", TINY)
    load_checkpoint(a, tmp_path)
    load_from_hf_model(b, hf)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(_bits(p), _bits(q)), n
    fresh = _hf(TINY, seed=1)
    fresh.load_state_dict(to_hf_state_dict(a), strict=True)
    for n, t in hf.state_dict().items():
        assert torch.equal(_bits(fresh.state_dict()[n]), _bits(t)), n


def test_mtp_layers_are_skipped_and_a_missing_expert_is_named(tmp_path):
    from safetensors.torch import save_file

    hf = _hf(TINY)
    sd = {k: v.clone().contiguous() for k, v in hf.state_dict().items()}
    sd["model.layers.3.eh_proj.weight"] = torch.zeros(2, 2)            # GLM/DeepSeek MTP layer
    save_file(sd, str(tmp_path / "model.safetensors"))
    m = build_model("mla_moe", TINY)
    load_checkpoint(m, tmp_path)
    per_expert = {k: v for k, v in sd.items() if "experts.gate_up_proj" not in k and "experts.down_proj" not in k}
    for i in (1, 2):
        gu, dn = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"], sd[f"model.layers.{i}.mlp.experts.down_proj"]
        inter = gu.shape[1] // 2
        for e in range(gu.shape[0] - (1 if i == 2 else 0)):             # layer 2 loses its last expert
            per_expert[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"] = gu[e, :inter].clone()
            per_expert[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"] = gu[e, inter:].clone()
            per_expert[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"] = dn[e].clone()
    save_file(per_expert, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.2.mlp.experts: 21 of 24 per-expert tensors"):
        load_checkpoint(build_model("mla_moe", TINY), tmp_path)


@pytest.mark.parametrize("change, message", [
    (dict(foo=1), "unsupported key.*'foo'"),
    (dict(scoring_func="softmax"), "unsupported key.*scoring_func='softmax'"),
    (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types has 2 entries for 3 layers"),
    (dict(mlp_layer_types=["dense", "sparse", "moe"]), "mlp layer type.*'moe'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "original_max_position_embeddings": 256}), "rope_type 'yarn'"),
    (dict(q_lora_rank=None), "q_lora_rank=None"),
    (dict(qk_nope_head_dim=256), "attention width of 512"),
    (dict(num_key_value_heads=2), "num_key_value_heads 2 != num_attention_heads 4"),
    (dict(n_group=3), "must split into n_group=3"),
])
def test_bad_configs_are_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message) as e:
        MlaMoeConfig.from_hf(dict(TINY, **change))
    assert "\n" not in str(e.value)
