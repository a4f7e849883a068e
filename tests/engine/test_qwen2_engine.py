"""The dense family on a Qwen2-architecture model (dense_qwen2_tiny: q/k/v bias, no q/k norm): under
the isoexec contract trainer_fwd == trainer_score == engine prefill/decode bit for bit (the
whole-model case-parity gate, and the rollout engine's generate-then-verify with chunked prefill,
preemption and a weight update), while the native contract's logprobs differ on the same model
(so the comparison can fail)."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402

from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from isoexec.gates.compare import merge  # noqa: E402
from isoexec.gates.engine_gates import verify_engine_logprobs  # noqa: E402
from isoexec.gates.model_gates import model_case_parity  # noqa: E402
from isoexec.model import build_model  # noqa: E402

from engine_fixtures import same_results, sampled_params, seeded_prompts  # noqa: E402

NAME = "dense_qwen2_tiny"
CFG = load_model_config(NAME)["hf_config"]


def qwen2(composition: str = "isoexec", seed: int = 0, dtype=torch.float32):
    c = build_contract("dense", composition, "cpu", NAME)
    m = build_model("dense", CFG, dtype=dtype).init_random(seed)
    m.install(c)
    assert m.cfg.qkv_bias and not m.cfg.qk_norm and bool((m.layers[0].qkv_bias != 0).all())
    return m, c


def prompts(seed: int, count: int, max_len: int) -> list[list[int]]:
    return seeded_prompts(seed, count, max_len, CFG["vocab_size"])


def params(n: int, max_tokens: int = 4) -> list[SamplingParams]:
    return sampled_params(n, max_tokens, seed0=2000)


def _parity(composition: str, dtype) -> dict:
    m, _ = qwen2(composition, dtype=dtype)
    reports, info = model_case_parity(m, torch.Generator().manual_seed(1), batch_sizes=(1, 5, 17), max_len=40)
    return merge(reports)


def test_trainer_fwd_trainer_score_and_engine_agree_bitwise_under_isoexec():
    for dtype in (torch.float32, torch.bfloat16):
        counts = _parity("isoexec", dtype)
        assert counts["compared"] > 0 and counts["differing"] == 0, (dtype, counts)


def test_the_native_contract_differs_on_the_same_model():
    counts = _parity("native", torch.float32)
    assert counts["differing"] > 0, counts


def test_generate_then_verify_with_chunked_prefill_and_preemption_and_weight_update():
    m, c = qwen2()
    ps = prompts(3, 4, max_len=24)
    free = Engine(m, c, EngineConfig(max_num_seqs=5, num_pages=64, max_num_batched_tokens=16, chunk_align=8))
    results = free.generate(ps, params(len(ps)))
    rep = verify_engine_logprobs(m, results)
    assert rep.compared == sum(len(r.ids) for r in results) > 0 and rep.differing == 0

    longest = max(len(p) for p in ps) + 4
    tight = Engine(m, c, EngineConfig(max_num_seqs=5, num_pages=-(-longest // 4) + 2, page_size=4, chunk_align=4,
                                      max_num_batched_tokens=16))
    same_results(results, tight.generate(ps, params(len(ps))))
    assert tight.scheduler.num_preemptions > 0

    new, _ = qwen2(seed=7)                    # the trainer after an update (new biases included)
    free.update_weights(new.state_dict(), trainer_contract=c)
    rep = verify_engine_logprobs(new, free.generate(ps, params(len(ps))))
    assert rep.compared > 0 and rep.differing == 0
