"""End-to-end engine gates (docs/gates.md families 1-3, 7 through the real rollout engine).

- ``engine_generate_verify``: every token the engine samples (mixed greedy / temperature /
  top-k / top-p requests, staggered arrivals, chunked prefill, mixed prefill+decode steps) has an
  engine logprob equal, bit for bit, to the trainer's ``score_logprobs`` over prompt + response.
- ``engine_full_vocab``: the same generate-then-verify traffic; at every sampled position the
  engine's whole fp32 log-softmax row (recorded from the logits it sampled from) equals the
  trainer's row over prompt + response, bit for bit, and the row's entry at the sampled token is
  the logprob the engine returned.
- ``engine_needle``: one request alone vs inside a large random batch with staggered arrivals:
  identical tokens and bitwise-identical logprobs.
- ``engine_preemption``: a page budget so small that requests are preempted and recomputed gives
  the same tokens and bits as an unconstrained run.
- ``engine_graph_eager`` (family 4, GPU only): the same staggered traffic with decode in CUDA
  graphs (padded batch buckets) and eagerly gives the same tokens and bits, and fails if no
  graph was replayed (also a GPU test: tests/engine/test_model_runner.py).
"""

from __future__ import annotations

import random

import torch

from ..engine import Engine, EngineConfig, SamplingParams
from ..train.scoring import PackedSequences, score_log_softmax, score_logprobs
from .compare import BitReport, compare_bits

SIZES = {"cpu": dict(requests=24, max_prompt=40, max_tokens=12),
         "sm90": dict(requests=128, max_prompt=300, max_tokens=96)}
# Gates whose comparison is much larger per token than one logprob get their own sizes: the
# full-vocabulary gate compares V elements per sampled token (rows kept on both sides), so it runs
# fewer, shorter requests; they still stagger, chunk and mix prefill with decode.
GATE_SIZES = {"engine_full_vocab": {"cpu": dict(requests=8, max_prompt=24, max_tokens=8),
                                    "sm90": dict(requests=32, max_prompt=300, max_tokens=64)}}


def sizes(gate: str, arch: str) -> dict:
    """The sizes the runner passes to engine gate ``gate`` on ``arch``."""
    return GATE_SIZES.get(gate, SIZES)[arch]


def _engine(model, contract, **kw) -> Engine:
    cfg = dict(max_num_batched_tokens=96, max_num_seqs=64, num_pages=512, chunk_align=16)
    cfg.update(kw)
    return Engine(model, contract, EngineConfig(**cfg), trainer_contract=contract)


def _params(rng: random.Random, n: int, max_tokens: int) -> list[SamplingParams]:
    out = []
    for i in range(n):
        kind = i % 4
        out.append(SamplingParams(temperature=[0.0, 1.0, 0.7, 1.2][kind], top_k=[0, 0, 20, 0][kind],
                                  top_p=[1.0, 1.0, 1.0, 0.8][kind], seed=rng.randrange(2 ** 40),
                                  max_tokens=rng.randint(1, max_tokens)))
    return out


def _prompts(gen: torch.Generator, n: int, max_len: int, vocab: int) -> list[list[int]]:
    return [torch.randint(0, vocab, (int(torch.randint(1, max_len + 1, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(n)]


def run_staggered(engine: Engine, requests) -> dict:
    """Feed (arrival_step, prompt, params, request_id) requests as the steps pass; results by id."""
    pending = sorted(requests, key=lambda r: r[0])
    results, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params, rid = pending.pop(0)
            engine.add_request(prompt, params, rid)
        for r in engine.step():
            results[r.request_id] = r
        step += 1
    return results


def _tokens_report(a: list[int], b: list[int]) -> BitReport:
    if len(a) == len(b):
        return compare_bits(torch.tensor(a, dtype=torch.int64), torch.tensor(b, dtype=torch.int64))
    n = max(len(a), len(b))
    return BitReport(compared=n, differing=n, max_abs_diff="length", max_ulp=0, first_index=[min(len(a), len(b))],
                     dtype="int64")


def verify_engine_logprobs(model, results) -> BitReport:
    """Engine logprobs of every generated token vs score_logprobs over prompt + response."""
    packed = PackedSequences.from_lists([r.prompt + r.ids for r in results], device=model.embed.device)
    parts = packed.split(score_logprobs(model, packed))
    want = torch.cat([p[len(r.prompt) - 1:] for p, r in zip(parts, results)])
    got = torch.cat([r.logprobs for r in results]).to(want.device)
    return compare_bits(got, want)


def verify_engine_full_rows(model, results, engine_rows) -> list[BitReport]:
    """Engine fp32 log-softmax rows of every sampled position (``engine_rows``: the runner's
    ``full_rows`` record) vs the trainer's rows at the same positions of prompt + response; and
    each engine row's entry at its sampled token vs the logprob the engine returned (so the rows
    compared are the distributions the returned logprobs came from)."""
    dev = model.embed.device
    packed = PackedSequences.from_lists([r.prompt + r.ids for r in results], device=dev)
    by_pos = {(rid, pos): row for rid, pos, row in engine_rows}
    starts, rows, got, missing = 0, [], [], 0
    for r, n in zip(results, packed.lengths):
        for j in range(len(r.ids)):
            # packed row starts + len(prompt) - 1 + j predicts generated token j, which the engine
            # sampled when the sequence held len(prompt) + j tokens
            rows.append(starts + len(r.prompt) - 1 + j)
            row = by_pos.get((r.request_id, len(r.prompt) + j))
            missing += row is None
            got.append(row)
        starts += n
    if missing:
        return [_vacuous(f"{missing} sampled position(s) without a recorded engine row")]
    got = torch.stack(got)
    want = score_log_softmax(model, packed, torch.tensor(rows, dtype=torch.int64, device=dev))
    ids = torch.tensor([t for r in results for t in r.ids], dtype=torch.int64, device=got.device)
    at_token = got.gather(1, ids[:, None])[:, 0]
    return [compare_bits(got, want), compare_bits(at_token, torch.cat([r.logprobs for r in results]).to(got.device))]


def _generate(model, contract, gen: torch.Generator, requests: int, max_prompt: int, max_tokens: int,
              **engine_kw) -> tuple[Engine, list]:
    """The generate-then-verify traffic: mixed sampling kinds, staggered arrivals; results in
    request order."""
    rng = random.Random(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    prompts = _prompts(gen, requests, max_prompt, model.cfg.vocab_size)
    params = _params(rng, requests, max_tokens)
    reqs = [(rng.randint(0, 8), p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]
    engine = _engine(model, contract, **engine_kw)
    results = run_staggered(engine, reqs)
    return engine, [results[i] for i in range(requests)]


def engine_generate_verify(model, contract, gen: torch.Generator, requests: int, max_prompt: int,
                           max_tokens: int) -> tuple[list[BitReport], dict]:
    _, ordered = _generate(model, contract, gen, requests, max_prompt, max_tokens)
    return [verify_engine_logprobs(model, ordered)], {"requests": requests, "tokens": sum(len(r.ids) for r in ordered)}


def engine_full_vocab(model, contract, gen: torch.Generator, requests: int, max_prompt: int, max_tokens: int
                      ) -> tuple[list[BitReport], dict]:
    """Generate-then-verify over whole rows: RL losses that read the whole distribution (KL to a
    reference, entropy bonus) need every entry of the engine's row to be the trainer's."""
    engine, ordered = _generate(model, contract, gen, requests, max_prompt, max_tokens, record_full_logprobs=True)
    reports = verify_engine_full_rows(model, ordered, engine.runner.full_rows)
    return reports, {"requests": requests, "tokens": sum(len(r.ids) for r in ordered),
                     "vocab": model.cfg.vocab_size}


def engine_needle(model, contract, gen: torch.Generator, requests: int, max_prompt: int, max_tokens: int
                  ) -> tuple[list[BitReport], dict]:
    rng = random.Random(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    needle = _prompts(gen, 1, max_prompt, model.cfg.vocab_size)[0]
    needle_params = SamplingParams(temperature=0.9, top_k=50, seed=rng.randrange(2 ** 40), max_tokens=max_tokens)
    alone = run_staggered(_engine(model, contract), [(0, needle, needle_params, 10 ** 6)])[10 ** 6]
    prompts = _prompts(gen, requests - 1, max_prompt, model.cfg.vocab_size)
    reqs = [(rng.randint(0, 8), p, sp, i) for i, (p, sp) in enumerate(zip(prompts, _params(rng, requests - 1,
                                                                                          max_tokens)))]
    reqs.insert(rng.randrange(requests), (rng.randint(0, 4), needle, needle_params, 10 ** 6))
    inside = run_staggered(_engine(model, contract), reqs)[10 ** 6]
    reports = [_tokens_report(alone.ids, inside.ids)]
    if alone.ids == inside.ids:
        reports.append(compare_bits(inside.logprobs, alone.logprobs))
    return reports, {"requests": requests, "needle_prompt": len(needle), "needle_tokens": len(alone.ids)}


def _results_reports(want, got) -> list[BitReport]:
    """Request by request: tokens equal, and where they are, logprobs bitwise equal."""
    reports = []
    for a, b in zip(want, got):
        reports.append(_tokens_report(a.ids, b.ids))
        if a.ids == b.ids:
            reports.append(compare_bits(b.logprobs, a.logprobs))
    return reports


def _vacuous(what: str) -> BitReport:
    """A failing report for a gate whose hazard never occurred (docs/gates.md, hazards)."""
    return BitReport(compared=1, differing=1, max_abs_diff=f"vacuous: {what}", max_ulp=0, first_index=None,
                     dtype="none")


def engine_preemption(model, contract, gen: torch.Generator, requests: int, max_prompt: int, max_tokens: int
                      ) -> tuple[list[BitReport], dict]:
    rng = random.Random(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    n = max(4, requests // 3)
    prompts = _prompts(gen, n, max_prompt, model.cfg.vocab_size)
    params = _params(rng, n, max_tokens)
    free = _engine(model, contract).generate(prompts, params)
    longest = max(len(p) for p in prompts) + max_tokens
    pages = -(-longest // 4) + 2          # room for the longest request alone, not for all of them
    tight = _engine(model, contract, num_pages=pages, page_size=4, chunk_align=4, max_num_batched_tokens=32)
    squeezed = tight.generate(prompts, params)
    reports = _results_reports(free, squeezed)
    if tight.scheduler.num_preemptions == 0:
        reports.append(_vacuous("no preemption"))
    return reports, {"requests": n, "preemptions": tight.scheduler.num_preemptions}


def engine_graph_eager(model, contract, gen: torch.Generator, requests: int, max_prompt: int, max_tokens: int
                       ) -> tuple[list[BitReport], dict]:
    """The same staggered traffic with decode CUDA graphs on and off: tokens and logprobs equal.
    Only meaningful where graphs exist (CUDA); ``GPU_ONLY_GATES`` keeps it off the CPU run."""
    rng = random.Random(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    prompts = _prompts(gen, requests, max_prompt, model.cfg.vocab_size)
    params = _params(rng, requests, max_tokens)
    reqs = [(rng.randint(0, 8), p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]
    graphed_engine = _engine(model, contract, cuda_graphs=True)
    graphed = run_staggered(graphed_engine, reqs)
    eager = run_staggered(_engine(model, contract, cuda_graphs=False), reqs)
    reports = _results_reports([eager[i] for i in range(requests)], [graphed[i] for i in range(requests)])
    replays = graphed_engine.runner.graph_replays
    if replays == 0:
        reports.append(_vacuous("no graph replay"))
    return reports, {"requests": requests, "graph_replays": replays}


ENGINE_GATES = {"engine_generate_verify": engine_generate_verify, "engine_full_vocab": engine_full_vocab,
                "engine_needle": engine_needle,
                "engine_preemption": engine_preemption, "engine_graph_eager": engine_graph_eager}
GPU_ONLY_GATES = frozenset({"engine_graph_eager"})
