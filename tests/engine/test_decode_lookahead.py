"""Decode lookahead (EngineConfig.overlap_decode): the next decode step is planned and launched
before the current step's tokens are read. It changes which rows share a step, never a token or
a logprob bit (the kernels are batch invariant): every test compares a run with lookahead against
the same calls without it, bitwise."""

import random

import pytest
import torch

from engine_fixtures import contract, cuda_tiny_model, random_prompts, same_results, tiny_model, verify
from isoexec.engine import Engine, EngineConfig, SamplingParams


def _engine(model, overlap, **kw):
    cfg = dict(max_num_batched_tokens=64, max_num_seqs=16, num_pages=128, chunk_align=16, overlap_decode=overlap)
    cfg.update(kw)
    c = contract("isoexec")
    return Engine(model, c, EngineConfig(**cfg), trainer_contract=c)


def _params(n, seed, stop=(), max_tokens=(4, 14)):
    rng = random.Random(seed)
    return [SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], top_p=[1.0, 0.9, 1.0][i % 3],
                           top_k=[0, 0, 20][i % 3], seed=rng.randrange(2 ** 40),
                           max_tokens=rng.randint(*max_tokens), stop_token_ids=list(stop)) for i in range(n)]


def _common_tokens(engine, prompts, params, k=3):
    """Tokens a run samples often: as stop tokens they end sequences mid-run."""
    runs = engine.generate(prompts, params)
    counts = torch.bincount(torch.tensor([t for r in runs for t in r.ids[1:]]), minlength=256)
    return counts.argsort(descending=True)[:k].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookahead_gives_the_tokens_and_logprobs_of_a_run_without_it_bitwise(dtype):
    model = tiny_model("isoexec", dtype)
    prompts = random_prompts(torch.Generator().manual_seed(80), 12, 2, 30)
    stop = _common_tokens(_engine(model, False), prompts, _params(12, 81))
    params = _params(12, 81, stop=stop)
    plain = _engine(model, False)
    want = plain.generate(prompts, params)
    ahead = _engine(model, True)
    got = ahead.generate(prompts, params)
    same_results(want, got)
    assert verify(model, got).differing == 0
    assert plain.num_ahead_steps == 0 and ahead.num_ahead_steps > 0
    # some sequence sampled a stop token while the step after it was already launched
    assert any(r.finish_reason == "stop" for r in got) and ahead.num_ahead_dropped > 0
    ahead.block_manager.check([])                    # every page and slot came back
    assert ahead.num_steps < plain.num_steps + ahead.num_ahead_dropped + 1


def test_lookahead_under_staggered_arrivals_and_prefill_interval_changes_no_bit():
    model = tiny_model("isoexec", torch.float32)
    prompts = random_prompts(torch.Generator().manual_seed(82), 10, 3, 30)
    params = _params(10, 83, max_tokens=(6, 12))

    def run(overlap, interval):
        e = _engine(model, overlap, max_num_batched_tokens=32, chunk_align=8, prefill_interval=interval)
        out = {}
        for step in range(500):
            if step < 20 and step % 2 == 0:          # one arrival every other step
                e.add_request(prompts[step // 2], params[step // 2], 700 + step // 2)
            for r in e.step():
                out[r.request_id] = r
            if step >= 20 and not e.has_unfinished():
                break
        e.block_manager.check([])
        return [out[k] for k in sorted(out)], e.num_ahead_steps

    want, _ = run(False, 0)
    for interval in (0, 3):
        got, ahead_steps = run(True, interval)
        same_results(want, got)
        assert ahead_steps > 0, interval


def test_lookahead_step_in_flight_is_dropped_by_a_weight_update():
    model = tiny_model("isoexec", torch.float32, seed=1)
    new = tiny_model("isoexec", torch.float32, seed=2).state_dict()
    prompts = random_prompts(torch.Generator().manual_seed(84), 4, 2, 20)
    params = _params(4, 85, max_tokens=(10, 14))

    def run(overlap):
        e = _engine(model, overlap)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            e.add_request(p, sp, i)
        for _ in range(4):                            # prefill, then decode steps
            e.step()
        in_flight = e._ahead is not None
        e.update_weights(new)
        out = {}
        while e.has_unfinished():
            for r in e.step():
                out[r.request_id] = r
        e.update_weights(tiny_model("isoexec", torch.float32, seed=1).state_dict())   # restore
        return [out[k] for k in sorted(out)], in_flight

    want, _ = run(False)
    got, in_flight = run(True)
    assert in_flight, "no lookahead step was in flight at the update"
    same_results(want, got)


def test_lookahead_stays_off_when_the_step_reads_top_n_logprobs_on_the_host():
    model = tiny_model("isoexec", torch.float32)
    prompts = random_prompts(torch.Generator().manual_seed(86), 3, 2, 10)
    e = _engine(model, True)
    e.generate(prompts, SamplingParams(max_tokens=6, logprobs=2, seed=3))
    assert e.num_ahead_steps == 0


@pytest.mark.gpu
def test_lookahead_in_cuda_graphs_equals_graphs_without_it_bitwise():
    """The graph path stages a lookahead step's input tokens by a device copy. Needs CUDA."""
    model, c = cuda_tiny_model()
    prompts = random_prompts(torch.Generator().manual_seed(87), 11, 1, 40)   # 11: a padded bucket (16)
    cfg = dict(max_num_seqs=16, num_pages=256, max_num_batched_tokens=256, cuda_graphs=True)
    stop = _common_tokens(Engine(model, c, EngineConfig(**cfg)), prompts, _params(11, 88))
    params = _params(11, 88, stop=stop)
    plain = Engine(model, c, EngineConfig(**cfg)).generate(prompts, params)
    ahead = Engine(model, c, EngineConfig(overlap_decode=True, **cfg))
    got = ahead.generate(prompts, params)
    same_results(plain, got)
    assert ahead.num_ahead_steps > 0 and ahead.runner.graph_replays > 0 and ahead.num_ahead_dropped > 0
    assert verify(model, got).differing == 0
