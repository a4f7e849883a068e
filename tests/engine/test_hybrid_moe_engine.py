"""The rollout engine on the hybrid_moe family (tiny random Qwen3.5-MoE: GDN state slots, KV pages for
the attention layer, MoE blocks): every sampled token's engine logprob equals the trainer's
score_logprobs bit for bit, with chunked prefill cutting GDN chunks and mixed prefill/decode steps."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402

from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from isoexec.gates.engine_gates import verify_engine_logprobs  # noqa: E402
from isoexec.model import build_model  # noqa: E402

CFG = load_model_config("hybrid_moe_tiny")["hf_config"]


def test_generate_then_verify_hybrid_moe_bitwise():
    c = build_contract("hybrid_moe", "isoexec", "cpu", "hybrid_moe_tiny")
    m = build_model("hybrid_moe", CFG, dtype=torch.float32).init_random(0)
    m.install(c)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist() for n in (23, 5, 14)]
    engine = Engine(m, c, EngineConfig(max_num_seqs=3, num_pages=32, max_num_batched_tokens=16, chunk_align=8))
    assert engine.block_manager.num_state_slots == 3 and len(engine.runner.kv.k) == m.cfg.num_kv_layers == 1
    results = engine.generate(ps, [SamplingParams(temperature=0.8, seed=10 + i, max_tokens=4) for i in range(3)])
    rep = verify_engine_logprobs(m, results)
    assert rep.compared == sum(len(r.ids) for r in results) > 0 and rep.differing == 0
