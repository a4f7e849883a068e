"""Builders shared by the dense family's transformers-parity tests: a transformers model of a
qwen3 or qwen2 config with non-trivial norm weights and biases (so a skipped one would show), our
model on its weights, and the packed-batch log-softmax error between the two."""

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from isoexec.compose import build_contract  # noqa: E402
from isoexec.model import ForwardBatch, build_model, load_from_hf_model  # noqa: E402

HF_CLASSES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def hf_dense(cfg: dict, dtype=torch.float32):
    torch.manual_seed(0)
    config_cls, model_cls = HF_CLASSES[cfg["model_type"]]
    m = model_cls(config_cls(**{k: v for k, v in cfg.items() if k != "model_type"})).to(dtype).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith("_proj.bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return m


def ours_from_hf(hf, cfg: dict, dtype, composition: str, model: str | None = None):
    """Our dense model with ``hf``'s weights, installed with the contract of model config ``model``."""
    m = build_model("dense", cfg, dtype=dtype)
    load_from_hf_model(m, hf)
    m.install(build_contract("dense", composition, "cpu", model))
    return m


def logprob_rel_error(hf, ours, vocab_size: int, lens=(23, 9, 31), seed: int = 3) -> float:
    """Relative L2 error of our packed-batch log-softmax against transformers, sequence by sequence."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=g) for n in lens]
    with torch.no_grad():
        ref = torch.cat([torch.log_softmax(hf(s[None]).logits[0].float(), -1) for s in seqs])
        batch = ForwardBatch.packed(list(lens), "trainer_score", "cpu")
        got = torch.log_softmax(ours.logits(ours.hidden_states(torch.cat(seqs), batch), "trainer_score").float(), -1)
    return ((got - ref).norm() / ref.norm()).item()
