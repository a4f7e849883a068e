"""Which tokens of which sequences run in the next step.

Policy (one step, a budget of ``max_num_batched_tokens`` tokens):

1. **Running decodes first**, oldest admission first: one token each. A decode that needs a new
   page when none is free preempts the most recently admitted running sequence (possibly itself)
   by recompute: its pages and state slot are freed, its cache position reset to 0, and it goes
   back to the FRONT of the waiting queue, keeping its tokens.
2. **Running prefills** (a prompt, or a recompute, cut into chunks in earlier steps), oldest
   first, each takes the largest chunk that fits the budget and the free pages.
3. **Waiting requests, FIFO**, while fewer than ``max_num_seqs`` run (and a state slot is free
   where the family has recurrent state): each is admitted with its first chunk. The head of the
   queue that cannot get a chunk blocks the ones behind it (no overtaking). Skipped in a step
   that preempted, so a victim does not bounce straight back.

**Prefill interval** (``prefill_interval`` = k > 0): while decodes are running, a step carries
prefill chunks (steps 2 and 3) only once at least k decode-only steps have run since the last
step that did, unless the prefill work at hand would fill the step's budget; the steps in
between are decode-only, which CUDA graphs serve. A step with a prefill chunk runs eagerly and
on a GPU costs about as much host time as ten graph-replayed decode steps, so under staggered
arrivals admitting every step keeps almost every step eager; holding gathers the arrivals into
fewer eager steps. A step whose budget the pending prefills fill gains nothing from waiting
(it would be just as full later) while its decodes run under-filled, so it is not held: a batch
of prompts arriving at once is admitted at full speed. (``scripts/scheduler_replay.py``
replays the scheduler alone on ``bench engine``'s workloads: the 64-prompt batch takes 134
steps instead of 138 with the rule that always held; the staggered one keeps 66 eager steps of
590, against 119 of 585 with k = 0.) New requests wait at most k short steps. With no decode
running, prefills go at once.

A chunk that does not finish its sequence's pending tokens ends on a multiple of
``chunk_align`` (absolute position), so chunk shapes follow the composition's largest grid
(attention BLOCK_N = 64 by default). The kernels are invariant to any split; the alignment only
keeps shapes regular. If nothing at all can run, the most recent running sequence is preempted
and the step is planned again.

``postprocess`` then records what the step computed, appends the sampled tokens and retires the
finished sequences.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]          # new tokens per sequence, in batch order
    is_decode: bool                # every row is a decode token: the engine_decode case
    # planned by ``Scheduler.lookahead`` before the previous step's tokens were known: each
    # sequence's input is the token that step sampled for it (still on the device), one position
    # past what ``Sequence`` records until the previous step is postprocessed
    ahead: bool = False

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def samples(self) -> list[bool]:
        """Whether each sequence's chunk reaches its last token (so it yields a next token)."""
        return [s.num_computed + n == s.num_tokens for s, n in zip(self.seqs, self.num_tokens)]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 chunk_align: int, max_model_len: int, prefill_interval: int = 0):
        assert max_num_batched_tokens >= chunk_align >= 1
        assert prefill_interval >= 0
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunk_align = chunk_align
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefill_interval = prefill_interval
        self.decode_steps_since_prefill = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------ planning
    def _chunk(self, seq: Sequence, budget: int) -> int:
        """New tokens for ``seq`` this step: all it has pending if they fit, else the largest
        piece that ends on the alignment grid."""
        pending = seq.num_pending
        n = min(pending, budget, self.bm.max_new_tokens(seq))
        if 0 < n < pending:
            end = (seq.num_computed + n) // self.chunk_align * self.chunk_align
            n = max(0, end - seq.num_computed)
        return n

    def _prefill_tokens_at_hand(self, scheduled: list[Sequence], budget: int) -> int:
        """Pending tokens of the running prefills and of the waiting requests that free
        sequence slots could admit, counted up to ``budget`` (an upper bound on what steps 2
        and 3 would schedule now)."""
        total = 0
        for seq in self.running:
            if seq not in scheduled:
                total += seq.num_pending
                if total >= budget:
                    return total
        for i, seq in enumerate(self.waiting):
            if len(self.running) + i >= self.max_num_seqs:
                break
            total += seq.num_pending
            if total >= budget:
                break
        return total

    def _plan(self) -> tuple[list[Sequence], list[int], bool]:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False

        def take(seq: Sequence, n: int) -> None:
            nonlocal budget
            self.bm.allocate(seq, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n

        # 1. decodes, oldest first; make room by preempting the newest
        for seq in [s for s in self.running if s.num_pending == 1 and s.num_computed > 0]:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:       # preempted earlier in this loop
                continue
            while not self.bm.may_append(seq):
                victim = self.running[-1]
                assert victim not in seqs, "a preemption victim was already scheduled"
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                take(seq, 1)
        # a decode-only step while the prefill interval has not passed, unless the prefill
        # work at hand fills the step (module docstring)
        if seqs and self.decode_steps_since_prefill < self.prefill_interval \
                and self._prefill_tokens_at_hand(seqs, budget) < budget:
            return seqs, counts, preempted
        # 2. running prefills (continuing chunks), oldest first
        for seq in [s for s in self.running if s not in seqs]:
            n = self._chunk(seq, budget)
            if n:
                take(seq, n)
        # 3. waiting, FIFO
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.can_allocate_state():
                break
            n = self._chunk(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.bm.allocate_state(seq)
            self.running.append(seq)
            take(seq, n)
        return seqs, counts, preempted

    def schedule(self) -> Optional[ScheduledBatch]:
        """The next step's batch, or None when no request is left."""
        while self.has_unfinished():
            seqs, counts, _ = self._plan()
            if seqs:
                is_decode = all(n == 1 and s.num_computed > 0 for s, n in zip(seqs, counts))
                self.decode_steps_since_prefill = self.decode_steps_since_prefill + 1 if is_decode else 0
                return ScheduledBatch(seqs, counts, is_decode)
            if len(self.running) <= 1:   # alone with every page free and still stuck: it never fits
                head = self.running[0] if self.running else self.waiting[0]
                raise RuntimeError(f"request {head.request_id} ({head.num_tokens} tokens) cannot be scheduled "
                                   f"with {self.bm.num_pages} pages of {self.bm.page_size} tokens, a budget of "
                                   f"{self.max_num_batched_tokens} and chunk_align {self.chunk_align}; "
                                   "raise num_pages")
            self.preempt(self.running[-1])
        return None

    def lookahead(self, batch: ScheduledBatch) -> Optional[ScheduledBatch]:
        """The decode step that follows ``batch`` (a decode step launched, not yet postprocessed),
        planned before its tokens are known; None when the next step might be anything else.

        It is the step ``schedule`` would return after ``postprocess(batch)`` whatever tokens
        come back, except for sequences that sample a stop token (the engine drops their rows):
        the sequences of ``batch`` that do not reach max_tokens or max_model_len with this
        token, each decoding its one new token, and no prefill chunk (there is no prefill work,
        or the prefill interval holds it, as in ``_plan``). Every page it needs must be free (a
        step that would preempt is left to ``schedule``)."""
        if not batch.is_decode:
            return None
        seqs = [s for s in batch.seqs
                if s.num_generated + 1 < s.params.max_tokens and s.num_tokens + 1 < self.max_model_len]
        if not seqs or len(seqs) > self.max_num_batched_tokens:
            return None
        budget = self.max_num_batched_tokens - len(seqs)
        at_hand = self._prefill_tokens_at_hand(batch.seqs, budget)
        if at_hand and not (self.decode_steps_since_prefill < self.prefill_interval and at_hand < budget):
            return None
        # each sequence's next position is one past its pending token: pages for num_computed + 2
        if sum(self.bm.pages_needed(s, 2) for s in seqs) > self.bm.num_free_pages:
            return None
        for s in seqs:
            self.bm.allocate(s, 2)
        self.decode_steps_since_prefill += 1
        return ScheduledBatch(seqs, [1] * len(seqs), True, ahead=True)

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the cache of ``seq`` and queue it first."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed = 0
        seq.status = Status.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Drop every running sequence's cache (weight update): newest first so FIFO order holds."""
        for seq in reversed(list(self.running)):
            self.preempt(seq)

    # ------------------------------------------------------------------------------ results
    def postprocess(self, batch: ScheduledBatch, tokens: Seq[int], logprobs: Seq[float],
                    tops: Optional[Seq[Optional[tuple]]] = None) -> list[Sequence]:
        """Account the computed tokens, append one sampled token per sampling sequence (in batch
        order), retire the finished ones; returns them."""
        sampling = batch.samples
        assert len(tokens) == sum(sampling), f"{len(tokens)} sampled tokens for {sum(sampling)} sequences"
        finished = []
        k = 0
        for seq, n, samples in zip(batch.seqs, batch.num_tokens, sampling):
            seq.num_computed += n
            if not samples:
                continue
            seq.append(tokens[k], logprobs[k], tops[k] if tops is not None else None)
            k += 1
            reason = seq.check_stop(self.max_model_len)
            if reason is not None:
                seq.finish_reason = reason
                seq.status = Status.FINISHED
                self.running.remove(seq)
                self.bm.free(seq)
                finished.append(seq)
        return finished
