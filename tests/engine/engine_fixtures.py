"""Tiny dense models and the generate-then-verify check shared by the engine tests."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402

from isoexec.compose import build_contract  # noqa: E402
from isoexec.engine import SamplingParams  # noqa: E402
from isoexec.gates.compare import BitReport, compare_bits  # noqa: E402
from isoexec.gates.engine_gates import verify_engine_logprobs  # noqa: E402
from isoexec.model import build_model  # noqa: E402

TINY = dict(model_type="qwen3", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
            max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)

_CONTRACTS: dict = {}


def contract(composition: str = "isoexec"):
    if composition not in _CONTRACTS:
        _CONTRACTS[composition] = build_contract("dense", composition, "cpu")
    return _CONTRACTS[composition]


def tiny_model(composition: str = "isoexec", dtype=torch.float32, seed: int = 1):
    m = build_model("dense", TINY, dtype=dtype).init_random(seed)
    m.install(contract(composition))
    return m


def cuda_tiny_model(seed: int = 1):
    """The tiny dense model in bf16 on the GPU, installed with this GPU's IsoExec contract:
    (model, contract). For the tests marked gpu."""
    from isoexec.envinfo import runtime_arch

    c = build_contract("dense", "isoexec", runtime_arch())
    m = build_model("dense", TINY, dtype=torch.bfloat16, device="cuda").init_random(seed)
    m.install(c)
    return m, c


def random_prompts(gen: torch.Generator, count: int, min_len: int = 1, max_len: int = 40,
                   vocab: int = TINY["vocab_size"]) -> list[list[int]]:
    out = []
    for _ in range(count):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        out.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    return out


def seeded_prompts(seed: int, count: int, max_len: int, vocab: int) -> list[list[int]]:
    """``count`` prompts of 1 .. max_len - 1 random tokens (the family engine tests' traffic)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, max_len, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def sampled_params(n: int, max_tokens: int, seed0: int) -> list[SamplingParams]:
    """Temperature 0.9, top-k 40, one seed per request from ``seed0``."""
    return [SamplingParams(temperature=0.9, top_k=40, seed=seed0 + i, max_tokens=max_tokens) for i in range(n)]


def verify(model, results) -> BitReport:
    """Engine logprobs of every generated token vs score_logprobs over prompt + generated."""
    assert all(r.logprobs.dtype == torch.float32 for r in results)
    return verify_engine_logprobs(model, results)


def same_results(a, b) -> None:
    """Identical tokens, finish reasons and bitwise-identical logprobs, request by request."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.request_id == y.request_id
        assert x.ids == y.ids, (x.request_id, x.ids, y.ids)
        assert x.finish_reason == y.finish_reason
        rep = compare_bits(x.logprobs, y.logprobs)
        assert rep.differing == 0, (x.request_id, rep)
