"""Off-policy corrections for a rollout/trainer mismatch: truncated IS and sequence rejection.

Why they exist: when the rollout engine's logprobs differ from the trainer's for the same tokens
and weights, the samples come from a policy ``mu`` (rollout) that is not the policy ``pi_old``
(trainer) the PPO ratio assumes, and the gradient is biased. The usual remedies are

* token-level truncated importance sampling (TIS): multiply each token's loss by
  ``w = min(pi_old / mu, C) = min(exp(logp_old - logp_rollout), C)``, detached;
* sequence-level rejection (RS): score each sequence by an estimate of its log-ratio divergence
  and drop (mask out of both the loss and its denominator) sequences whose score exceeds a
  threshold: ``|K1|`` with ``K1 = mean_t lr_t`` or ``K3 = mean_t (exp(lr_t) - 1 - lr_t)``,
  where ``lr_t = logp_old_t - logp_rollout_t``.

Under an IsoExec contract the two sides are bitwise identical, so ``lr_t = 0`` exactly, every
weight is ``exp(0) = 1`` exactly, K1 = K3 = 0 and nothing is rejected: the corrections are
exact no-ops and the trainer computes the same bits with or without them. That is the point of
the project; the estimators below also serve as mismatch metrics.

All functions work on flat per-token tensors of the response tokens, sequence after sequence
(``seq_lens[b]`` tokens for sequence ``b``), and return detached results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..bits import count_differing

RS_KINDS = ("k1", "k3")

Tensor = torch.Tensor


def log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor) -> Tensor:
    """``logp_old - logp_rollout`` per token in fp32 (exactly 0 where the two agree bitwise)."""
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)} and rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} must have the same shape")
    old = old_logprobs.detach().to(torch.float32)
    return old - rollout_logprobs.detach().to(old.device, torch.float32)


def k1_terms(lr: Tensor) -> Tensor:
    """Per-token k1 terms: the log-ratio itself (its mean estimates KL(mu || pi_old) with sign)."""
    return lr


def k3_terms(lr: Tensor) -> Tensor:
    """Per-token k3 terms ``exp(lr) - 1 - lr`` >= 0, zero iff ``lr == 0``. Computed in fp64 with
    expm1 so small mismatches are not lost to cancellation; returned in fp32."""
    x = lr.to(torch.float64)
    return (torch.expm1(x) - x).to(torch.float32)


def sequence_mean(x: Tensor, seq_lens: Sequence[int]) -> Tensor:
    """Per-sequence mean of flat per-token values [T] -> [B] (fp64 accumulation, fp32 out)."""
    lens = [int(n) for n in seq_lens]
    if sum(lens) != x.shape[0]:
        raise ValueError(f"seq_lens sum to {sum(lens)} but there are {x.shape[0]} tokens")
    if any(n <= 0 for n in lens):
        raise ValueError("every sequence needs at least one response token")
    if not lens:
        return x.new_zeros(0, dtype=torch.float32)
    return torch.stack([s.to(torch.float64).mean() for s in x.split(lens)]).to(torch.float32)


def sequence_k1(old_logprobs: Tensor, rollout_logprobs: Tensor, seq_lens: Sequence[int]) -> Tensor:
    """K1 per sequence: the mean log-ratio over its response tokens."""
    return sequence_mean(k1_terms(log_ratio(old_logprobs, rollout_logprobs)), seq_lens)


def sequence_k3(old_logprobs: Tensor, rollout_logprobs: Tensor, seq_lens: Sequence[int]) -> Tensor:
    """K3 per sequence: the mean of ``exp(lr) - 1 - lr`` over its response tokens."""
    return sequence_mean(k3_terms(log_ratio(old_logprobs, rollout_logprobs)), seq_lens)


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, threshold: float) -> Tensor:
    """Token-level truncated IS weights ``min(exp(logp_old - logp_rollout), threshold)``, detached.

    ``threshold`` must be >= 1: a cap below 1 would down-weight tokens that are exactly on policy,
    which is not a truncation of the importance ratio."""
    if not threshold >= 1.0:
        raise ValueError(f"TIS threshold must be >= 1 (got {threshold}); it caps pi_old/mu from above")
    return torch.exp(log_ratio(old_logprobs, rollout_logprobs)).clamp_max(threshold)


def rejection_keep(old_logprobs: Tensor, rollout_logprobs: Tensor, seq_lens: Sequence[int], kind: str,
                   threshold: float) -> Tensor:
    """bool [B]: True for sequences kept, False for those whose |K1| (``kind="k1"``) or K3
    (``kind="k3"``) exceeds ``threshold`` (> 0)."""
    if kind not in RS_KINDS:
        raise ValueError(f"unknown rejection kind {kind!r}; choose one of {', '.join(RS_KINDS)}")
    if not threshold > 0:
        raise ValueError(f"rejection threshold must be > 0 (got {threshold})")
    if kind == "k1":
        score = sequence_k1(old_logprobs, rollout_logprobs, seq_lens).abs()
    else:
        score = sequence_k3(old_logprobs, rollout_logprobs, seq_lens)
    return ~(score > threshold) & torch.isfinite(score)


@dataclass
class Correction:
    """What the corrections do to one batch: per-token weights (None when TIS is off), the
    sequences kept by rejection, and statistics (python floats)."""

    weights: Optional[Tensor]          # [T] fp32, or None
    keep: Tensor                       # [B] bool
    seq_lens: list[int]
    stats: dict = field(default_factory=dict)

    def sequence_weights(self) -> list[Optional[Tensor]]:
        """The weights split per sequence (a list of None when TIS is off)."""
        if self.weights is None:
            return [None] * len(self.seq_lens)
        return list(self.weights.split(self.seq_lens))

    def select(self, indices: Sequence[int]) -> "Correction":
        """The correction restricted to the sequences ``indices`` (in that order); no stats."""
        idx = list(indices)
        lens = [self.seq_lens[i] for i in idx]
        per_seq = self.sequence_weights()
        weights = None if self.weights is None else (
            torch.cat([per_seq[i] for i in idx]) if idx else self.weights[:0])
        keep = self.keep[torch.tensor(idx, dtype=torch.long, device=self.keep.device)]
        return Correction(weights, keep, lens)

    @property
    def token_keep(self) -> Tensor:
        """bool [T]: the keep flag of each token's sequence."""
        return torch.repeat_interleave(self.keep, torch.tensor(self.seq_lens, device=self.keep.device))


def correct(old_logprobs: Tensor, rollout_logprobs: Tensor, seq_lens: Sequence[int],
            tis_threshold: Optional[float] = None, rs_kind: Optional[str] = None,
            rs_threshold: Optional[float] = None) -> Correction:
    """Apply the configured corrections to one batch (flat tokens, sequence after sequence)."""
    lens = [int(n) for n in seq_lens]
    lr = log_ratio(old_logprobs, rollout_logprobs)
    k1 = sequence_mean(k1_terms(lr), lens)
    k3 = sequence_mean(k3_terms(lr), lens)
    weights = None if tis_threshold is None else tis_weights(old_logprobs, rollout_logprobs, tis_threshold)
    if rs_kind is None:
        if rs_threshold is not None:
            raise ValueError("rs_threshold is set but rs_kind is None; pick rs_kind 'k1' or 'k3'")
        keep = torch.ones(len(lens), dtype=torch.bool, device=lr.device)
    else:
        if rs_threshold is None:
            raise ValueError(f"rs_kind {rs_kind!r} needs rs_threshold")
        keep = rejection_keep(old_logprobs, rollout_logprobs, lens, rs_kind, rs_threshold)
    n_tok, n_seq = max(lr.shape[0], 1), max(len(lens), 1)
    stats = {
        "k1_mean": float(k1.abs().sum()) / n_seq,
        "k3_mean": float(k3.sum()) / n_seq,
        "rs_rejected_frac": float((~keep).sum()) / n_seq,
        "tis_weight_mean": 1.0 if weights is None else float(weights.sum()) / n_tok,
        "tis_truncated_frac": 0.0 if weights is None else
        float((torch.exp(lr) > tis_threshold).sum()) / n_tok,
    }
    return Correction(weights, keep, lens, stats)


@torch.no_grad()
def mismatch_stats(trainer_logprobs: Tensor, rollout_logprobs: Tensor, seq_lens: Sequence[int]) -> dict:
    """Mismatch metrics between two logprob sets for the same tokens: |diff| mean/max, the number
    of tokens that differ bitwise, and the mean per-sequence |K1| and K3 (all python floats)."""
    a = trainer_logprobs.detach().to(torch.float32)
    b = rollout_logprobs.detach().to(a.device, torch.float32)
    lr = log_ratio(a, b)
    diff = lr.abs()
    n_seq = max(len(list(seq_lens)), 1)
    differing = count_differing(a, b)
    return {
        "abs_diff_mean": float(diff.to(torch.float64).mean()) if diff.numel() else 0.0,
        "abs_diff_max": float(diff.max()) if diff.numel() else 0.0,
        "tokens_differing": differing,
        "k1_mean": float(sequence_mean(k1_terms(lr), seq_lens).abs().sum()) / n_seq,
        "k3_mean": float(sequence_mean(k3_terms(lr), seq_lens).sum()) / n_seq,
    }
