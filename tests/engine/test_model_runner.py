"""Model runner: case choice per step, sampling rows, CUDA graphs (GPU only)."""

import pytest
import torch

from engine_fixtures import contract, cuda_tiny_model, random_prompts, same_results, verify
from isoexec.engine import Engine, EngineConfig, SamplingParams


def test_mixed_steps_run_engine_prefill_and_pure_decode_steps_run_engine_decode(iso_fp32):
    engine = Engine(iso_fp32, contract(), EngineConfig(max_num_batched_tokens=32, chunk_align=8, num_pages=64))
    cases = []
    forward = engine.runner.forward

    def recording(batch, *ahead):
        hidden, case = forward(batch, *ahead)
        decode_rows = [n == 1 and s.num_computed > 0 for s, n in zip(batch.seqs, batch.num_tokens)]
        cases.append((case, all(decode_rows), any(decode_rows), hidden.shape[0], batch.total_tokens))
        return hidden, case

    engine.runner.forward = recording
    engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=6, seed=1))
    engine.step()
    engine.step()                                   # the first request decodes ...
    engine.add_request(list(range(30, 75)), SamplingParams(max_tokens=3, seed=2))   # ... a long prompt joins
    results = []
    while engine.has_unfinished():
        results += engine.step()
    for case, all_decode, some_decode, rows, tokens in cases:
        assert rows == tokens
        assert case == ("engine_decode" if all_decode else "engine_prefill")
    assert any(c == "engine_prefill" and some for c, _, some, _, _ in cases), "no mixed step happened"
    assert any(c == "engine_decode" for c, *_ in cases)
    assert verify(iso_fp32, results).differing == 0


def test_cuda_graphs_are_off_on_cpu(iso_fp32):
    engine = Engine(iso_fp32, contract(), EngineConfig(cuda_graphs=True, num_pages=8))
    assert engine.runner.graphs is None
    assert EngineConfig(max_num_seqs=48).decode_buckets() == (1, 2, 4, 8, 16, 32, 48)
    assert EngineConfig(graph_batch_sizes=(8, 1, 8)).decode_buckets() == (1, 8)


@pytest.mark.gpu
def test_decode_graph_replay_with_padded_lanes_equals_eager_bitwise():
    """docs/gates.md family 4 at engine level: graphs on (padded buckets) == graphs off. Needs CUDA."""
    model, c = cuda_tiny_model()
    prompts = random_prompts(torch.Generator().manual_seed(5), 11, 1, 40)   # 11: a padded bucket (16)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    cfg = dict(max_num_seqs=16, num_pages=256, max_num_batched_tokens=256)
    eager = Engine(model, c, EngineConfig(cuda_graphs=False, **cfg)).generate(prompts, params)
    graphed_engine = Engine(model, c, EngineConfig(cuda_graphs=True, **cfg))
    assert graphed_engine.runner.graphs is not None
    same_results(eager, graphed_engine.generate(prompts, params))
    assert verify(model, eager).differing == 0
