"""Trainer-side scoring: per-token logprobs of packed sequences under the trainer cases.

``score_logprobs(model, packed)`` runs the unified model over whole sequences packed into one
variable-length batch and returns, for every token after the first of each sequence, the fp32
log-probability the model assigns to it given its prefix. ``grad=True`` is the training case
(``trainer_fwd``: autograd on, the result is differentiable); ``grad=False`` is the scoring case
(``trainer_score``: no graph). Both must produce the same bits as the engine for the same tokens.
``score_log_softmax`` gives whole fp32 log-softmax rows instead (for losses over the whole
distribution: KL, entropy), by the logprob region's full-row twin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..model.batch import ForwardBatch


@dataclass
class PackedSequences:
    """Whole token sequences concatenated; ``lengths[b]`` tokens each (every length >= 2)."""

    tokens: torch.Tensor          # [T] int64
    lengths: list[int]

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]], device="cpu") -> "PackedSequences":
        if not seqs:
            raise ValueError("score_logprobs: no sequences")
        for i, s in enumerate(seqs):
            if len(s) < 2:
                raise ValueError(f"sequence {i} has {len(s)} token(s); scoring needs at least 2")
        flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
        return cls(flat, [len(s) for s in seqs])

    @property
    def targets(self) -> torch.Tensor:
        """Next-token targets for every row; the last row of each sequence gets a dummy 0."""
        nxt = torch.roll(self.tokens, -1)
        ends = torch.tensor(self.lengths, device=self.tokens.device).cumsum(0) - 1
        nxt[ends] = 0
        return nxt

    @property
    def scored_rows(self) -> torch.Tensor:
        """Row indices whose target is a real next token (all rows but each sequence's last)."""
        keep = torch.ones(self.tokens.shape[0], dtype=torch.bool, device=self.tokens.device)
        ends = torch.tensor(self.lengths, device=self.tokens.device).cumsum(0) - 1
        keep[ends] = False
        return keep.nonzero().squeeze(1)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence views of a [sum(len - 1)] result."""
        return list(flat.split([n - 1 for n in self.lengths]))


def score_logprobs(model, packed: PackedSequences, grad: bool = False) -> torch.Tensor:
    """fp32 logprobs [sum(len_b - 1)] of tokens 1.. of each sequence given their prefixes."""
    case = "trainer_fwd" if grad else "trainer_score"
    batch = ForwardBatch.packed(packed.lengths, case, packed.tokens.device)
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx:
        hidden = model.hidden_states(packed.tokens, batch)
        rows = packed.scored_rows
        return model.token_logprobs(hidden[rows], packed.targets[rows], case)


def score_log_softmax(model, packed: PackedSequences, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 log-softmax rows [len(rows), V] of the packed rows ``rows`` (default: ``scored_rows``),
    scoring case. Row r is the distribution of the token after packed row r; its entry at that
    token is the bits ``score_logprobs`` returns. Only the asked rows go through lm_head (a row's
    logits do not depend on the others: the lm_head region is batch invariant)."""
    case = "trainer_score"
    batch = ForwardBatch.packed(packed.lengths, case, packed.tokens.device)
    with torch.no_grad():
        hidden = model.hidden_states(packed.tokens, batch)
        rows = packed.scored_rows if rows is None else rows
        return model.log_softmax_from_logits(model.logits(hidden[rows], case), case)
