"""Token logprobs and log-softmax: the stock twin, ``torch.log_softmax`` in fp32 (+ gather) (the native
composition and the negative control of the gates; no promise about reduction order)."""

from __future__ import annotations

import torch


def log_softmax_native(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs_native(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    ls = torch.log_softmax(logits.float(), dim=-1)
    return ls.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
