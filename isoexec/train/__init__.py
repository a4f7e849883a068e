"""Trainer: scoring (per-token logprobs), losses and optimisation over the unified model."""

from .scoring import PackedSequences, score_logprobs

__all__ = ["PackedSequences", "score_logprobs"]
