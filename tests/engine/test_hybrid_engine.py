"""The rollout engine on the hybrid family (Gated DeltaNet + gated attention, tiny random Qwen3.5):
recurrent-state slots, chunked prefill at any split, preemption and weight updates, bitwise
against the trainer's score_logprobs under the IsoExec composition (CPU reference kernels)."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from isoexec.gates.engine_gates import verify_engine_logprobs  # noqa: E402
from isoexec.model import build_model  # noqa: E402

from engine_fixtures import same_results, sampled_params, seeded_prompts  # noqa: E402

CFG = load_model_config("hybrid_tiny")["hf_config"]


def hybrid(composition: str = "isoexec", seed: int = 0):
    c = build_contract("hybrid", composition, "cpu", "hybrid_tiny")
    m = build_model("hybrid", CFG, dtype=torch.float32).init_random(seed)
    m.install(c)
    return m, c


def prompts(seed: int, count: int, max_len: int = 150) -> list[list[int]]:
    return seeded_prompts(seed, count, max_len, CFG["vocab_size"])


def params(n: int, max_tokens: int = 12) -> list[SamplingParams]:
    return sampled_params(n, max_tokens, seed0=1000)


def test_engine_gives_each_running_sequence_a_state_slot_by_default():
    m, c = hybrid()
    engine = Engine(m, c, EngineConfig(max_num_seqs=5, num_pages=64))
    assert engine.block_manager.num_state_slots == 5
    assert engine.runner.kv.k.__len__() == m.cfg.num_kv_layers < m.cfg.num_layers   # KV only for attention layers


@pytest.mark.parametrize("budget,align", [(64, 64), (40, 8)])
def test_generate_then_verify_hybrid_bitwise_with_chunked_prefill(budget, align):
    """Prompts longer than the token budget are prefilled in chunks (aligned to CHUNK, or cut at
    arbitrary multiples of 8 that fall inside GDN chunks); every sampled token's engine logprob
    equals score_logprobs over prompt + response, bit for bit."""
    m, c = hybrid()
    ps = prompts(3, 9)
    assert max(len(p) for p in ps) > budget
    engine = Engine(m, c, EngineConfig(max_num_seqs=4, num_pages=256, max_num_batched_tokens=budget,
                                       chunk_align=align))
    results = engine.generate(ps, params(len(ps)))
    rep = verify_engine_logprobs(m, results)
    assert rep.compared == sum(len(r.ids) for r in results) > 0
    assert rep.differing == 0


def test_hybrid_preemption_by_recompute_is_bitwise():
    """Too few pages force preemption; the recomputed sequence starts from a zeroed state slot and
    produces the same tokens and logprobs as an unconstrained run."""
    m, c = hybrid()
    ps = prompts(5, 6, max_len=60)
    free = Engine(m, c, EngineConfig(max_num_seqs=6, num_pages=256)).generate(ps, params(len(ps), 16))
    longest = max(len(p) for p in ps) + 16
    tight = Engine(m, c, EngineConfig(max_num_seqs=6, num_pages=-(-longest // 4) + 2, page_size=4, chunk_align=4,
                                      max_num_batched_tokens=32))
    squeezed = tight.generate(ps, params(len(ps), 16))
    assert tight.scheduler.num_preemptions > 0
    same_results(free, squeezed)


def test_hybrid_weight_update_resets_state_and_matches_a_fresh_engine():
    m, c = hybrid(seed=0)
    new = build_model("hybrid", CFG, dtype=torch.float32).init_random(7)
    ps = prompts(11, 4, max_len=70)
    engine = Engine(m, c, EngineConfig(max_num_seqs=4, num_pages=128), trainer_contract=c)
    engine.generate(ps, params(len(ps)))                       # dirties every state slot
    engine.update_weights(new)
    assert all(float(st.boundary.abs().sum()) == 0 for st in engine.runner.gdn_states)
    after = engine.generate(ps, params(len(ps)))
    fresh_model, _ = hybrid(seed=7)
    fresh = Engine(fresh_model, c, EngineConfig(max_num_seqs=4, num_pages=128)).generate(ps, params(len(ps)))
    for a, b in zip(after, fresh):
        assert a.ids == b.ids
        assert torch.equal(a.logprobs.view(torch.int32), b.logprobs.view(torch.int32))


def test_native_hybrid_engine_differs_from_its_trainer():
    """Negative control: chunked trainer GDN vs recurrent decode (and stock kernels) differ."""
    m, c = hybrid("native")
    ps = prompts(3, 9)
    results = Engine(m, c, EngineConfig(max_num_seqs=4, num_pages=256)).generate(ps, params(len(ps)))
    assert verify_engine_logprobs(m, results).differing > 0


@pytest.mark.gpu
def test_hybrid_decode_graph_replay_with_padded_lanes_equals_eager_bitwise():
    """Decode CUDA graphs on a hybrid model: padded lanes use the scratch state slot."""
    from isoexec.envinfo import runtime_arch

    c = build_contract("hybrid", "isoexec", runtime_arch(), "hybrid_tiny")
    m = build_model("hybrid", CFG, dtype=torch.bfloat16, device="cuda").init_random(1)
    m.install(c)
    ps = prompts(5, 11, max_len=90)                       # 11 lanes: a padded bucket (16)
    cfg = dict(max_num_seqs=16, num_pages=256, max_num_batched_tokens=256, max_model_len=256)
    eager = Engine(m, c, EngineConfig(cuda_graphs=False, **cfg)).generate(ps, params(len(ps)))
    graphed_engine = Engine(m, c, EngineConfig(cuda_graphs=True, **cfg))
    graphed = graphed_engine.generate(ps, params(len(ps)))
    assert graphed_engine.runner.graph_replays > 0
    same_results(eager, graphed)
    assert verify_engine_logprobs(m, eager).differing == 0


def test_decode_lookahead_on_the_hybrid_family_changes_no_bit():
    """Decode lookahead (EngineConfig.overlap_decode) with recurrent-state slots: a row computed
    ahead for a sequence that sampled a stop token updates the freed slot, which the next
    sequence to take it zeroes first; tokens and logprobs equal the run without lookahead."""
    m, c = hybrid()
    ps = prompts(7, 10, max_len=90)
    base = params(len(ps), max_tokens=14)
    cfg = dict(max_num_seqs=4, num_pages=256, max_num_batched_tokens=64, chunk_align=8)
    first = Engine(m, c, EngineConfig(**cfg)).generate(ps, base)
    common = torch.bincount(torch.tensor([t for r in first for t in r.ids[1:]]),
                            minlength=CFG["vocab_size"]).argsort(descending=True)[:2].tolist()
    stopping = [SamplingParams(temperature=p.temperature, top_k=p.top_k, seed=p.seed, max_tokens=p.max_tokens,
                               stop_token_ids=common) for p in base]
    plain = Engine(m, c, EngineConfig(**cfg)).generate(ps, stopping)
    engine = Engine(m, c, EngineConfig(overlap_decode=True, **cfg))
    got = engine.generate(ps, stopping)
    same_results(plain, got)
    assert engine.num_ahead_steps > 0 and engine.num_ahead_dropped > 0
    assert any(r.finish_reason == "stop" for r in got)
    assert verify_engine_logprobs(m, got).differing == 0
