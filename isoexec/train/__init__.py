"""Trainer: scoring (per-token logprobs), losses and optimisation over the unified model."""

from .corrections import Correction, correct, mismatch_stats, rejection_keep, sequence_k1, sequence_k3, tis_weights
from .losses import LOSSES, dapo_loss, grpo_loss, policy_loss, reinforce_loss
from .optim import MasterAdamW, global_grad_norm
from .scoring import PackedSequences, score_logprobs
from .trainer import TrainBatch, TrainConfig, Trainer

__all__ = ["PackedSequences", "score_logprobs",
           "LOSSES", "dapo_loss", "grpo_loss", "reinforce_loss", "policy_loss",
           "Correction", "correct", "tis_weights", "rejection_keep", "sequence_k1", "sequence_k3", "mismatch_stats",
           "MasterAdamW", "global_grad_norm",
           "TrainConfig", "TrainBatch", "Trainer"]
