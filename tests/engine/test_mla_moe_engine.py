"""The rollout engine on the mla_moe family (tiny random GLM-4.7-Flash-style MLA + MoE): the KV pages
hold the padded expanded K and V of every layer, and every sampled token's engine logprob equals
the trainer's score_logprobs bit for bit, with chunked prefill, preemption and a weight update."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402

from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from isoexec.gates.engine_gates import verify_engine_logprobs  # noqa: E402
from isoexec.model import build_model  # noqa: E402

from engine_fixtures import same_results, sampled_params, seeded_prompts  # noqa: E402

CFG = load_model_config("mla_moe_tiny")["hf_config"]


def mla_moe(seed: int = 0):
    c = build_contract("mla_moe", "isoexec", "cpu", "mla_moe_tiny")
    m = build_model("mla_moe", CFG, dtype=torch.float32).init_random(seed)
    m.install(c)
    return m, c


def prompts(seed: int, count: int, max_len: int) -> list[list[int]]:
    return seeded_prompts(seed, count, max_len, CFG["vocab_size"])


def params(n: int, max_tokens: int = 4) -> list[SamplingParams]:
    return sampled_params(n, max_tokens, seed0=2000)


def test_generate_then_verify_with_chunked_prefill_and_preemption_and_weight_update():
    m, c = mla_moe()
    cfg = m.cfg
    ps = prompts(3, 4, max_len=24)
    free = Engine(m, c, EngineConfig(max_num_seqs=5, num_pages=64, max_num_batched_tokens=16, chunk_align=8))
    assert len(free.runner.kv.k) == cfg.num_layers
    assert free.runner.kv.k[0].shape[1:] == (16, cfg.num_heads, cfg.attn_width) == free.runner.kv.v[0].shape[1:]
    results = free.generate(ps, params(len(ps)))
    rep = verify_engine_logprobs(m, results)
    assert rep.compared == sum(len(r.ids) for r in results) > 0 and rep.differing == 0

    longest = max(len(p) for p in ps) + 4
    tight = Engine(m, c, EngineConfig(max_num_seqs=5, num_pages=-(-longest // 4) + 2, page_size=4, chunk_align=4,
                                      max_num_batched_tokens=16))
    same_results(results, tight.generate(ps, params(len(ps))))
    assert tight.scheduler.num_preemptions > 0

    new, _ = mla_moe(seed=7)                 # the trainer after an update (its correction bias included)
    free.update_weights(new.state_dict(), trainer_contract=c)
    rep = verify_engine_logprobs(new, free.generate(ps, params(len(ps))))
    assert rep.compared > 0 and rep.differing == 0
