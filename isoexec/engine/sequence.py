"""One request's lifecycle: prompt, generated tokens, their fp32 logprobs, and its place in the
engine (status, computed tokens, KV pages, recurrent-state slot).

    WAITING --schedule--> RUNNING --stop token / max_tokens--> FINISHED
                             |  ^
                   preempt   v  |  schedule again (recompute prompt + generated tokens)
                          PREEMPTED

A preempted sequence keeps its tokens and logprobs; only its cache is dropped. It is re-run as a
prefill over everything it has so far, which rebuilds the KV bit for bit (the attention kernel is
invariant to how a sequence is chunked), so preemption never changes a later token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy (argmax of the logits);
    ``top_k == 0`` and ``top_p == 1`` switch those filters off. ``seed`` and the request id key
    the sampler's noise (see ``sampler``). ``logprobs = n`` also returns the n most likely
    tokens and their logprobs at every step."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    logprobs: int = 0

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams: temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"SamplingParams: seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs < 0:
            raise ValueError(f"SamplingParams: logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Result:
    """What a finished request returns: its generated ids, their fp32 logprobs under the
    untempered model distribution (the numbers the trainer recomputes), and why it stopped
    (``"stop"``: a stop token, included in ``ids``; ``"length"``: max_tokens or max_model_len)."""

    request_id: int
    prompt: list[int]
    ids: list[int]
    logprobs: torch.Tensor                       # fp32 [len(ids)]
    finish_reason: str
    top_logprobs: Optional[list[tuple[list[int], torch.Tensor]]] = None  # per token: (ids, fp32 lps)
    num_preemptions: int = 0


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    token_ids: list[int] = field(init=False)
    logprobs: list[float] = field(init=False, default_factory=list)   # fp32 values (exact as floats)
    top_logprobs: list[tuple[list[int], list[float]]] = field(init=False, default_factory=list)
    status: Status = field(init=False, default=Status.WAITING)
    finish_reason: Optional[str] = field(init=False, default=None)
    num_computed: int = field(init=False, default=0)        # tokens whose K/V are in the cache
    block_table: list[int] = field(init=False, default_factory=list)
    state_slot: Optional[int] = field(init=False, default=None)
    num_preemptions: int = field(init=False, default=0)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: empty prompt")
        self.prompt = [int(t) for t in self.prompt]
        self.token_ids = list(self.prompt)

    # ------------------------------------------------------------------------------ counts
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache; the last of them is the row that yields the next token."""
        return len(self.token_ids) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt):]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    # ------------------------------------------------------------------------------ updates
    def append(self, token: int, logprob: float, top: Optional[tuple[Seq[int], Seq[float]]] = None) -> None:
        self.token_ids.append(int(token))
        self.logprobs.append(float(logprob))
        if top is not None:
            self.top_logprobs.append((list(top[0]), list(top[1])))

    def check_stop(self, max_model_len: int) -> Optional[str]:
        """The finish reason after the last appended token, or None to go on."""
        if self.num_generated and self.token_ids[-1] in self.params.stop_token_ids:
            return "stop"
        if self.num_generated >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def result(self) -> Result:
        tops = None
        if self.params.logprobs:
            tops = [(ids, torch.tensor(lps, dtype=torch.float32)) for ids, lps in self.top_logprobs]
        return Result(self.request_id, list(self.prompt), self.output_ids,
                      torch.tensor(self.logprobs, dtype=torch.float32), self.finish_reason or "", tops,
                      self.num_preemptions)
