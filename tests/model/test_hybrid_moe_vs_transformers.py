"""The unified hybrid_moe model (Qwen3.5-MoE text) matches transformers 5.17 Qwen3_5MoeForCausalLM on the
same weights, loads its checkpoints (per-expert tensors, the multimodal text prefix), refuses bad
configs in one line."""

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.errors import ConfigError  # noqa: E402
from isoexec.model import ForwardBatch, build_model, load_checkpoint, load_from_hf_model  # noqa: E402
from isoexec.model.loading import to_hf_state_dict  # noqa: E402
from isoexec.model_config import HybridMoeConfig  # noqa: E402

TINY = load_model_config("hybrid_moe_tiny")["hf_config"]


def _hf(cfg, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    m = m.to(dtype).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            if n.endswith("conv1d.weight"):
                p.mul_(3.0)
    return m


def _ours(hf, cfg, composition="isoexec", dtype=torch.float32):
    m = build_model("hybrid_moe", cfg, dtype=dtype)
    load_from_hf_model(m, hf)
    m.install(build_contract("hybrid_moe", composition, "cpu"))
    return m


def _bits(t):
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def test_logprobs_match_transformers_fp32():
    """(The engine's bits against the trainer's: tests/engine/test_hybrid_moe_engine.py; the stock MoE
    regions against the stock layer: tests/kernels/test_moe_regions.py.)"""
    cfg = dict(TINY, tie_word_embeddings=False)
    hf = _hf(cfg)
    ours = _ours(hf, cfg)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, cfg["vocab_size"], (n,), generator=g) for n in (70, 9)]
    with torch.no_grad():
        ref = torch.cat([torch.log_softmax(hf(s[None]).logits[0].float(), -1) for s in seqs])
        batch = ForwardBatch.packed([70, 9], "trainer_score", "cpu")
        got = torch.log_softmax(ours.logits(ours.hidden_states(torch.cat(seqs), batch), "trainer_score").float(), -1)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_safetensors_round_trip_with_per_expert_and_multimodal_names(tmp_path):
    from safetensors.torch import save_file

    cfg = dict(TINY, tie_word_embeddings=False)
    hf = _hf(cfg)
    hf.save_pretrained(tmp_path / "plain")          # per-expert tensors, as checkpoints store them
    a, b = build_model("hybrid_moe", cfg), build_model("hybrid_moe", cfg)
    load_checkpoint(a, tmp_path / "plain")
    load_from_hf_model(b, hf)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(_bits(p), _bits(q)), n
    fresh = _hf(cfg, seed=1)
    fresh.load_state_dict(to_hf_state_dict(a), strict=True)
    for n, t in hf.state_dict().items():
        assert torch.equal(_bits(fresh.state_dict()[n]), _bits(t)), n
    # Qwen3.5-MoE releases are multimodal: the text model under model.language_model.*, plus mtp.*
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.clone().contiguous()
          for k, v in hf.state_dict().items()}
    sd["mtp.fc.weight"] = torch.zeros(2, 2)
    (tmp_path / "mm").mkdir()
    save_file(sd, str(tmp_path / "mm" / "model.safetensors"))
    c = build_model("hybrid_moe", cfg)
    load_checkpoint(c, tmp_path / "mm")
    for (n, p), (_, q) in zip(a.named_parameters(), c.named_parameters()):
        assert torch.equal(_bits(p), _bits(q)), n


@pytest.mark.parametrize("change, message", [
    (dict(foo=1), "unsupported key.*'foo'"),
    (dict(layer_types=["linear_attention", "full_attention"]),
     r"num_hidden_layers. \(4\) must be equal to the number of .layer_types. \(2\)"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 must be in"),
    (dict(model_type="qwen3_5_text"), "reads qwen3_5_moe_text configs"),
])
def test_bad_configs_are_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message) as e:
        HybridMoeConfig.from_hf(dict(TINY, **change))
    assert "\n" not in str(e.value)
