"""Scheduler policy without a model: budget, FIFO admission, decodes first, chunk alignment,
preemption by recompute."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isoexec.engine import BlockManager, SamplingParams, Scheduler, Sequence, Status


def _make(num_pages=64, page_size=4, budget=32, max_seqs=8, align=8, slots=0, max_len=512):
    bm = BlockManager(num_pages, page_size, slots)
    return bm, Scheduler(bm, budget, max_seqs, align, max_len)


def _seq(rid, n_prompt, max_tokens=4):
    return Sequence(rid, [rid % 50 + 1] * n_prompt, SamplingParams(max_tokens=max_tokens))


def _drive(sched, arrivals: dict[int, list[Sequence]], on_batch=None, max_steps=2000):
    """Run to completion; sequences in arrivals[k] are added before step k. Returns the batches
    (as (seq, n, num_computed_before, is_decode) tuples per step)."""
    log = []
    step = 0
    while step < max_steps and (sched.has_unfinished() or any(k >= step for k in arrivals)):
        for s in arrivals.get(step, []):
            sched.add(s)
        step += 1
        batch = sched.schedule()
        if batch is None:
            continue
        rows = [(s, n, s.num_computed, batch.is_decode) for s, n in zip(batch.seqs, batch.num_tokens)]
        if on_batch:
            on_batch(batch)
        k = sum(batch.samples)
        sched.postprocess(batch, [7] * k, [-1.0] * k)
        sched.bm.check(sched.running)
        log.append(rows)
    assert not sched.has_unfinished()
    return log


def _random_load(seed, n=20, max_prompt=70):
    rng = random.Random(seed)
    arrivals: dict[int, list[Sequence]] = {}
    for i in range(n):
        arrivals.setdefault(rng.randrange(0, 10), []).append(_seq(i, rng.randint(1, max_prompt),
                                                                  rng.randint(1, 6)))
    return arrivals


def test_step_respects_token_budget_and_max_num_seqs():
    bm, sched = _make(budget=24, max_seqs=5, align=8)

    def check(batch):
        assert batch.total_tokens <= 24
        assert len(sched.running) <= 5 and len(batch.seqs) <= 5
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs)

    _drive(sched, _random_load(0), check)


def test_waiting_requests_are_admitted_fifo():
    bm, sched = _make(budget=16, max_seqs=3, align=8)
    seqs = [_seq(i, 5 + 7 * (i % 4), 3) for i in range(12)]
    admitted = []

    def record(batch):
        for s in batch.seqs:
            if s.request_id not in admitted:
                admitted.append(s.request_id)

    _drive(sched, {0: seqs[:6], 3: seqs[6:]}, record)
    assert admitted == list(range(12))


def test_running_decodes_are_scheduled_first():
    bm, sched = _make(budget=20, max_seqs=8, align=4)
    seen_decode_and_prefill = []

    def check(batch):
        kinds = [s.num_pending == 1 and s.num_computed > 0 for s in batch.seqs]
        assert kinds == sorted(kinds, reverse=True), "a prefill chunk precedes a decode row"
        ready = [s for s in sched.running if s.num_pending == 1 and s.num_computed > 0]
        # every decode that was ready when the step was planned is in it (budget allows)
        assert all(s in batch.seqs for s in ready if s.status is Status.RUNNING)
        if any(kinds) and not all(kinds):
            seen_decode_and_prefill.append(True)

    _drive(sched, _random_load(1, n=16), check)
    assert seen_decode_and_prefill, "the load never mixed decodes and prefill chunks"


def test_prefill_interval_holds_admissions_while_decodes_run():
    bm = BlockManager(64, 4, 0)
    sched = Scheduler(bm, 32, 8, 8, 512, prefill_interval=2)
    a, b = _seq(1, 5, 6), _seq(2, 5, 6)
    sched.add(a)
    first = sched.schedule()                       # nothing decodes yet: the prefill goes at once
    assert first.seqs == [a] and not first.is_decode
    sched.postprocess(first, [7], [-1.0])
    sched.add(b)
    kinds = []
    for _ in range(3):
        batch = sched.schedule()
        kinds.append((batch.is_decode, [s.request_id for s in batch.seqs]))
        sched.postprocess(batch, [7] * sum(batch.samples), [-1.0] * sum(batch.samples))
    # two decode-only steps for a, then b is admitted beside a's decode
    assert kinds == [(True, [1]), (True, [1]), (False, [1, 2])]


def test_prefill_interval_does_not_hold_a_prefill_that_fills_the_step():
    """Prompts that fill the budget join the step at once (a batch arriving together is admitted
    at full speed); a prompt smaller than the budget left waits out the interval."""
    bm = BlockManager(64, 4, 0)
    sched = Scheduler(bm, 16, 8, 8, 512, prefill_interval=3)
    a, big, small = _seq(1, 5, 30), _seq(2, 40, 4), _seq(3, 5, 4)
    sched.add(a)
    batch = sched.schedule()
    sched.postprocess(batch, [7], [-1.0])
    sched.add(big)
    batch = sched.schedule()                       # 40 pending tokens >= 15 left: not held
    assert [s.request_id for s in batch.seqs] == [1, 2] and not batch.is_decode
    sched.postprocess(batch, [7] * sum(batch.samples), [-1.0] * sum(batch.samples))
    while big.num_pending >= 15:                   # its next chunks fill their steps too
        batch = sched.schedule()
        assert [s.request_id for s in batch.seqs] == [1, 2] and not batch.is_decode
        sched.postprocess(batch, [7] * sum(batch.samples), [-1.0] * sum(batch.samples))
    sched.add(small)
    for _ in range(3):                             # 8 + 5 pending tokens < 15 left: held 3 steps
        batch = sched.schedule()
        assert batch.is_decode and [s.request_id for s in batch.seqs] == [1]
        sched.postprocess(batch, [7], [-1.0])
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == [1, 2, 3] and not batch.is_decode


def test_prefill_interval_never_stalls_a_load():
    bm, sched = _make(budget=24, max_seqs=4, align=8)
    sched.prefill_interval = 3
    log = _drive(sched, _random_load(3, n=18))
    assert sum(len(rows) for rows in log) > 0


@pytest.mark.parametrize("align", [1, 8, 16])
def test_nonfinal_prefill_chunks_end_on_chunk_align(align):
    bm, sched = _make(budget=40, max_seqs=6, align=align)
    log = _drive(sched, _random_load(2, max_prompt=90))
    chunked = 0
    for rows in log:
        for seq, n, start, _ in rows:
            end = start + n
            final = end == seq.num_prompt_tokens or n == 1 and start >= seq.num_prompt_tokens
            if not final and end < seq.num_prompt_tokens:
                assert end % align == 0, (seq.request_id, start, n)
                chunked += 1
    assert chunked > 0, "no prompt was chunked; the test proves nothing"


def test_preemption_frees_the_newest_running_request_and_requeues_it_first():
    # 4 pages of 4 tokens: two 6-token prompts take 2 pages each; the first decode past the
    # page boundary needs a 5th page and must evict the newer request.
    bm, sched = _make(num_pages=4, page_size=4, budget=32, max_seqs=4, align=4)
    a, b = _seq(0, 6, max_tokens=6), _seq(1, 6, max_tokens=6)
    c = _seq(2, 3, max_tokens=1)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and not batch.is_decode
    sched.postprocess(batch, [5, 5], [-1.0, -1.0])
    sched.add(c)                                     # waits behind the running ones
    for _ in range(2):                               # decode tokens 6 and 7 still fit
        batch = sched.schedule()
        assert batch.is_decode and batch.seqs == [a, b]
        sched.postprocess(batch, [5, 5], [-1.0, -1.0])
    assert bm.num_free_pages == 0
    batch = sched.schedule()                         # token 8 of a needs a page: b is evicted
    assert sched.num_preemptions == 1 and b.status is Status.PREEMPTED
    assert b.num_computed == 0 and b.block_table == [] and b.num_preemptions == 1
    assert list(sched.waiting) == [b, c], "the victim must be re-queued at the front"
    assert batch.seqs == [a] and b.num_generated == 3, "the victim keeps its tokens"
    sched.postprocess(batch, [5], [-1.0])
    bm.check(sched.running)
    # afterwards the victim is recomputed as one prefill of everything it has (prompt + 3 tokens)
    log = _drive(sched, {})
    rows_b = [(start, n) for rows in log for s, n, start, _ in rows if s is b]
    at = 0
    for start, n in rows_b:
        assert start == at
        at += n
        if at == 9:
            break
    assert at == 9, rows_b
    assert a.is_finished and b.is_finished and c.is_finished


def test_state_slots_bound_the_running_requests():
    bm, sched = _make(budget=64, max_seqs=8, align=4, slots=2)

    def check(batch):
        assert len(sched.running) <= 2
        assert all(s.state_slot is not None for s in sched.running)

    _drive(sched, _random_load(3, n=8), check)
    assert bm.num_free_slots == 2


def test_request_that_cannot_fit_raises_with_a_clear_message():
    bm, sched = _make(num_pages=2, page_size=4, budget=32, align=4)
    sched.add(_seq(0, 20))
    with pytest.raises(RuntimeError, match="raise num_pages"):
        for _ in range(5):                 # the first chunk fits; the rest never will
            batch = sched.schedule()
            sched.postprocess(batch, [], [])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), num_pages=st.integers(12, 40), page_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(16, 64), align=st.sampled_from([1, 4, 16]), max_seqs=st.integers(1, 6))
def test_every_request_completes_with_a_tight_page_budget(seed, num_pages, page_size, budget, align, max_seqs):
    bm, sched = _make(num_pages=num_pages, page_size=page_size, budget=budget, max_seqs=max_seqs, align=align)
    rng = random.Random(seed)
    cap = num_pages * page_size
    seqs = [_seq(i, rng.randint(1, max(1, min(40, cap - 8))), rng.randint(1, 6)) for i in range(10)]
    seqs = [s for s in seqs if bm.pages_for(s.num_prompt_tokens + s.params.max_tokens) <= num_pages]

    def check(batch):
        assert batch.total_tokens <= budget

    _drive(sched, _group(seqs), check)
    for s in seqs:
        assert s.is_finished and s.num_generated == s.params.max_tokens
    assert bm.num_free_pages == num_pages


def _group(seqs):
    out: dict[int, list[Sequence]] = {}
    for i, s in enumerate(seqs):
        out.setdefault(i % 4, []).append(s)
    return out
