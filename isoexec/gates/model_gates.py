"""Whole-model gates: the trainer cases and a reference prefill/decode driver give the same bits.

``engine_logprobs_reference`` is a deliberately simple KV-cache loop (the full engine with its
scheduler is ``isoexec.engine``): sequences arrive at staggered steps, prefill their prompt in
random chunks (several sequences per call, pages shuffled), then decode their remaining tokens
one at a time; a step that mixes prefill chunks and decode tokens is one ``engine_prefill`` call
(decode rows are chunks of length 1), a step of decodes only is an ``engine_decode`` call. Every
processed token's row yields the logprob of the next token, so the driver scores exactly the
tokens the trainer scores.

Gates (docs/gates.md families 1 and 2 at model level):
- ``model_case_parity``: trainer_fwd (autograd on) == trainer_score == engine driver, for random
  sequences, batch sizes 1..64, random prompt/split points.
- ``model_batch_invariance``: one sequence scored alone == the same sequence inside a batch of
  random neighbours (trainer_score and engine driver).
- ``backward_determinism``: the same trainer step twice (forward with autograd, token logprobs,
  a random per-token weighting, backward) gives the same gradient bits for every parameter. The
  backward need not be batch invariant (only forward bits must match between trainer and engine),
  but it must be deterministic: bit-identical resume and reproducible runs depend on it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..model.batch import ForwardBatch, KVCache
from ..train.scoring import PackedSequences, score_logprobs
from .compare import BitReport, compare_bits


def engine_logprobs_reference(model, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                              gen: torch.Generator, page_size: int = 16, max_chunk: int = 48,
                              max_arrival: int = 3) -> list[torch.Tensor]:
    """Per sequence: fp32 logprobs of tokens 1..n-1, computed by prefill chunks then decode."""
    device = model.embed.device
    cfg = model.cfg
    n_seq = len(seqs)
    pages = [math.ceil(len(s) / page_size) for s in seqs]
    perm = torch.randperm(sum(pages), generator=gen).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(perm[at:at + n])
        at += n
    kv = KVCache.allocate(getattr(cfg, "num_kv_layers", cfg.num_layers), sum(pages), page_size, cfg.num_kv_heads,
                          cfg.head_dim, model.embed.dtype, device)
    state = {}
    if hasattr(model, "allocate_recurrent_state"):   # recurrent layers: one state slot per sequence, shuffled
        gdn, conv = model.allocate_recurrent_state(n_seq + 2)
        slot_of = torch.randperm(n_seq + 2, generator=gen)[:n_seq].tolist()
        state = dict(gdn_states=gdn, conv_states=conv)
    arrival = [int(torch.randint(0, max_arrival + 1, (1,), generator=gen)) for _ in seqs]
    done = [0] * n_seq
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    step = 0
    with torch.no_grad():
        while any(done[b] < len(seqs[b]) - 1 for b in range(n_seq)):
            active, q_lens = [], []
            for b in range(n_seq):
                if arrival[b] > step or done[b] >= len(seqs[b]) - 1:
                    continue
                if done[b] < prompt_lens[b]:
                    left = prompt_lens[b] - done[b]
                    q = min(left, int(torch.randint(1, max_chunk + 1, (1,), generator=gen)))
                else:
                    q = 1
                active.append(b)
                q_lens.append(q)
            step += 1
            if not active:
                continue
            prefill = any(done[b] < prompt_lens[b] for b in active)
            case = "engine_prefill" if prefill else "engine_decode"
            ids = torch.tensor([t for b, q in zip(active, q_lens) for t in seqs[b][done[b]:done[b] + q]],
                               dtype=torch.int64, device=device)
            if state:
                state["state_slots"] = [slot_of[b] for b in active]
            batch = ForwardBatch.paged(case, kv, [tables[b] for b in active], [done[b] for b in active], q_lens,
                                       device, **state)
            hidden = model.hidden_states(ids, batch)
            targets = torch.tensor([t for b, q in zip(active, q_lens) for t in seqs[b][done[b] + 1:done[b] + q + 1]
                                    + ([0] if done[b] + q >= len(seqs[b]) else [])], dtype=torch.int64,
                                   device=device)
            lp = model.token_logprobs(hidden, targets, case)
            at = 0
            for b, q in zip(active, q_lens):
                keep = min(q, len(seqs[b]) - 1 - done[b])
                rows[b].append(lp[at:at + keep])
                at += q
                done[b] += q
    return [torch.cat(r) for r in rows]


def random_sequences(gen: torch.Generator, count: int, vocab: int, min_len: int = 2, max_len: int = 96):
    seqs, prompts = [], []
    for _ in range(count):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        seqs.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
        prompts.append(int(torch.randint(1, n, (1,), generator=gen)))
    return seqs, prompts


def model_case_parity(model, gen: torch.Generator, batch_sizes=(1, 3, 8, 17, 64), max_len: int = 96
                      ) -> tuple[list[BitReport], dict]:
    """Reports comparing trainer_fwd, trainer_score and the engine driver on the same tokens."""
    device = model.embed.device
    reports: list[BitReport] = []
    info = {"batch_sizes": list(batch_sizes), "max_len": max_len, "tokens": 0}
    for bs in batch_sizes:
        seqs, prompts = random_sequences(gen, bs, model.cfg.vocab_size, max_len=max_len)
        packed = PackedSequences.from_lists(seqs, device)
        score = score_logprobs(model, packed, grad=False)
        fwd = score_logprobs(model, packed, grad=True).detach()
        engine = torch.cat(engine_logprobs_reference(model, seqs, prompts, gen))
        reports += [compare_bits(fwd, score), compare_bits(engine, score)]
        info["tokens"] += int(score.numel())
    return reports, info


def model_batch_invariance(model, gen: torch.Generator, batch_sizes=(2, 9, 33, 64), max_len: int = 96
                           ) -> tuple[list[BitReport], dict]:
    """The same sequence alone vs inside random batches (trainer_score and engine driver)."""
    device = model.embed.device
    reports: list[BitReport] = []
    needle, needle_prompt = random_sequences(gen, 1, model.cfg.vocab_size, min_len=8, max_len=max_len)
    alone_t = score_logprobs(model, PackedSequences.from_lists(needle, device))
    alone_e = engine_logprobs_reference(model, needle, needle_prompt, gen)[0]
    for bs in batch_sizes:
        seqs, prompts = random_sequences(gen, bs - 1, model.cfg.vocab_size, max_len=max_len)
        pos = int(torch.randint(0, bs, (1,), generator=gen))
        seqs.insert(pos, needle[0])
        prompts.insert(pos, needle_prompt[0])
        packed = PackedSequences.from_lists(seqs, device)
        inside_t = packed.split(score_logprobs(model, packed))[pos]
        inside_e = engine_logprobs_reference(model, seqs, prompts, gen)[pos]
        reports += [compare_bits(inside_t, alone_t), compare_bits(inside_e, alone_e), compare_bits(inside_e,
                                                                                                   alone_t)]
    return reports, {"batch_sizes": list(batch_sizes), "needle_len": len(needle[0])}


def backward_determinism(model, gen: torch.Generator, batch_sizes=(1, 8, 64), max_len: int = 96
                         ) -> tuple[list[BitReport], dict]:
    """Two identical trainer steps per batch size; one comparison per parameter gradient.

    ``info["sanity_failures"]`` lists what would make the comparison vacuous (a gradient that is
    all zeros or not finite); the gate fails if it is not empty."""
    device = model.embed.device
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    reports: list[BitReport] = []
    info = {"batch_sizes": list(batch_sizes), "max_len": max_len, "params": len(params), "tokens": 0,
            "gradient_elements": 0, "sanity_failures": []}
    for bs in batch_sizes:
        seqs, _ = random_sequences(gen, bs, model.cfg.vocab_size, max_len=max_len)
        packed = PackedSequences.from_lists(seqs, device)
        n_scored = sum(n - 1 for n in packed.lengths)
        weight = torch.randn(n_scored, generator=gen).to(device)

        def grads():
            lp = score_logprobs(model, packed, grad=True)
            return torch.autograd.grad((lp * weight).sum(), params)

        first, second = grads(), grads()
        for name, a, b in zip(names, first, second):
            reports.append(compare_bits(a, b))
            if not bool(torch.isfinite(a).all()):
                info["sanity_failures"].append(f"batch {bs}: gradient of {name} is not finite")
            elif not bool((a != 0).any()):
                info["sanity_failures"].append(f"batch {bs}: gradient of {name} is all zeros")
            info["gradient_elements"] += a.numel()
        info["tokens"] += n_scored
    return reports, info
